"""Nothing a checkpoint or config says is taken on trust: forged counters, absurd weights, a config naming another
env than the one the policy was trained on, a W&B project name W&B would refuse, and a network too big for the
machine are each refused with one line naming the field or tensor, through the API and the command line.

The checkpoints are real: short runs write them, a test loads one, changes one field and saves it back in
ppokit's format (valid checksum), as someone editing the file would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.envs.classic_control.pendulum import PendulumEnv

import ppokit
from ppokit.cli import main
from ppokit.config.ppo_config import ConfigError, PPOConfig
from ppokit.runtime.checkpoint import BOUNDED_KEYS, WEIGHT_BOUND, CheckpointError, load_checkpoint, save_checkpoint
from ppokit.training.trainer import CHECKPOINT_NAME, resume, train

torch.set_num_threads(1)


class WidePendulum(PendulumEnv):
    """Pendulum with torques in [-4, 4]: the same shapes as Pendulum-v1, other action bounds."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.action_space = gym.spaces.Box(-4.0, 4.0, (1,), np.float32)


if "ppokit-test/WidePendulum-v0" not in gym.registry:
    gym.register("ppokit-test/WidePendulum-v0", entry_point=WidePendulum, max_episode_steps=200)


def _tiny(env_id: str, run_dir: Path) -> PPOConfig:
    return PPOConfig(env_id=env_id, num_envs=2, num_steps=16, num_minibatches=2, update_epochs=1,
                     total_timesteps=64, tensorboard=False, run_dir=str(run_dir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Finished CartPole, Acrobot and Pendulum runs (2 updates of 32 steps each), trained once, copied per test."""
    base = tmp_path_factory.mktemp("trained")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for env_id, name in (("CartPole-v1", "cartpole"), ("Acrobot-v1", "acrobot"), ("Pendulum-v1", "pendulum")):
            train(_tiny(env_id, base / name), console_enabled=False)
    return base


def _copy(runs: Path, name: str, dest: Path) -> Path:
    shutil.copytree(runs / name, dest, ignore=shutil.ignore_patterns("*.lock", "latest"))
    return dest


def _forge(run_dir: Path, edit) -> None:
    """Load the checkpoint a real run wrote, apply ``edit(state)``, save it back with a valid checksum."""
    path = run_dir / CHECKPOINT_NAME
    state = load_checkpoint(path)
    del state["format"], state["version"]
    edit(state)
    save_checkpoint(path, state, finite=())


def _cli(args: list[str], cwd: Path) -> tuple[int, str]:
    """``python -m ppokit ARGS`` in a wide terminal (rich wraps at 80 columns otherwise); (exit code, output)."""
    proc = subprocess.run([sys.executable, "-m", "ppokit", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "400"})
    return proc.returncode, proc.stdout + proc.stderr


def _one_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), text
    assert "Traceback" not in text
    return lines[0]


# ------------------------------------------------------------------ counters
@pytest.mark.parametrize("edit, shown", [
    (lambda s: s.__setitem__("global_step", -5), "its global_step is -5, not a non-negative integer"),
    (lambda s: s.__setitem__("update", -1), "its update is -1, not a non-negative integer"),
    (lambda s: s.__setitem__("global_step", 2.5), "its global_step is 2.5"),
    # 2 updates of 32 steps wrote 64; 50 is no multiple of the batch, 32 is one batch short.
    (lambda s: s.__setitem__("global_step", 50), "global_step 50 does not fit update 2 with a batch of 32"),
    (lambda s: s.__setitem__("global_step", 32), "global_step 32 does not fit update 2"),
    (lambda s: s.__setitem__("update", 0), "global_step 64 does not fit update 0"),
    (lambda s: s.__setitem__("kl_beta", float("inf")), "its kl_beta is inf"),
    (lambda s: s["perf"].__setitem__("rollout", -3.0), "perf entry"),
])
def test_forged_counters_are_refused_by_resume_and_load(runs, tmp_path, capsys, edit, shown):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    _forge(run_dir, edit)
    metrics = (run_dir / "metrics.csv").read_text()
    with pytest.raises(CheckpointError, match="cannot be used") as exc:
        resume(run_dir, console_enabled=False)
    assert shown in str(exc.value)
    with pytest.raises(CheckpointError, match="cannot be used"):
        ppokit.load(run_dir)
    for args in (["train", "--resume", str(run_dir), "--quiet"], ["eval", str(run_dir), "--episodes", "1"]):
        assert main(args) == 2
        assert shown in " ".join(capsys.readouterr().err.split())
    assert (run_dir / "metrics.csv").read_text() == metrics  # refused before anything was logged


@pytest.mark.slow  # subprocesses: seconds each; CI runs it
def test_a_negative_global_step_is_one_line_on_the_command_line(runs, tmp_path):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    _forge(run_dir, lambda s: s.__setitem__("global_step", -5))
    for args in (["train", "--resume", "run", "--quiet"], ["eval", "run", "--episodes", "1"]):
        rc, out = _cli(args, tmp_path)
        assert rc == 2
        assert "its global_step is -5" in _one_error_line(out)


# ------------------------------------------------------------------ weights
def test_huge_weights_are_refused_naming_the_tensor(runs, tmp_path, capsys):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    _forge(run_dir, lambda s: s["policy"]["critic.2.weight"].fill_(3e38))  # finite: the NaN check passes it
    where = "state['policy']['critic.2.weight'] holds a weight of 3e+38"
    with pytest.raises(CheckpointError, match=r"beyond \+-1e\+06") as exc:
        ppokit.load(run_dir)
    assert where in str(exc.value)
    with pytest.raises(CheckpointError) as exc:
        resume(run_dir, console_enabled=False)
    assert where in str(exc.value)
    assert main(["eval", str(run_dir), "--episodes", "1"]) == 2
    assert where in " ".join(capsys.readouterr().err.split())
    before = (run_dir / CHECKPOINT_NAME).read_bytes()
    assert main(["train", "--resume", str(run_dir), "--quiet"]) == 2
    assert where in " ".join(capsys.readouterr().err.split())
    assert (run_dir / CHECKPOINT_NAME).read_bytes() == before  # refused before anything was written


def test_large_but_plausible_weights_still_load(runs, tmp_path):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    _forge(run_dir, lambda s: s["policy"]["critic.2.weight"].fill_(WEIGHT_BOUND / 10))
    agent = ppokit.load(run_dir)
    assert np.isfinite(agent.value(np.zeros(4, np.float32)))


def test_a_policy_beyond_the_bound_is_never_saved(runs, tmp_path):
    """A run never writes a checkpoint it cannot read back: the bound applies at save too."""
    state = load_checkpoint(runs / "cartpole" / CHECKPOINT_NAME)
    del state["format"], state["version"]
    state["policy"]["actor.0.weight"].fill_(-2e6)
    with pytest.raises(CheckpointError, match=r"state\['policy'\]\['actor.0.weight'\] holds a weight of -2e\+06"):
        save_checkpoint(tmp_path / "c.pt", state, bounded=BOUNDED_KEYS)
    assert not (tmp_path / "c.pt").exists()


@pytest.mark.slow  # a subprocess: seconds; CI runs it
def test_huge_weights_are_one_line_for_train_resume(runs, tmp_path):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    _forge(run_dir, lambda s: s["policy"]["actor.0.weight"].fill_(3e38))
    rc, out = _cli(["train", "--resume", "run", "--quiet"], tmp_path)
    assert rc == 2
    assert "state['policy']['actor.0.weight'] holds a weight of 3e+38" in _one_error_line(out)


# ------------------------------------------------------------------ the config's env against the stored spaces
def test_load_refuses_a_policy_whose_config_names_another_env(runs, tmp_path, capsys):
    run_dir = _copy(runs, "acrobot", tmp_path / "run")
    _forge(run_dir, lambda s: s["config"].__setitem__("env_id", "CartPole-v1"))
    with pytest.raises(CheckpointError, match="its config's env CartPole-v1 does not match") as exc:
        ppokit.load(run_dir)
    text = str(exc.value)
    assert "Discrete(3)" in text and "Discrete(2)" in text and "(6,)" in text and "(4,)" in text
    assert main(["eval", str(run_dir), "--episodes", "1"]) == 2
    assert "its config's env CartPole-v1 does not match" in " ".join(capsys.readouterr().err.split())
    # Naming the env to act in replaces the config's: the Acrobot policy evaluates on Acrobot.
    assert ppokit.evaluate(ppokit.load(run_dir, env_id="Acrobot-v1"), episodes=1)["returns"]


def test_same_shapes_other_action_bounds_are_refused_by_load_and_resume(runs, tmp_path):
    """The policy's shapes fit (3 observations, 1 torque), so only the stored spaces can tell."""
    run_dir = _copy(runs, "pendulum", tmp_path / "run")
    _forge(run_dir, lambda s: s["config"].__setitem__("env_id", "ppokit-test/WidePendulum-v0"))
    for attempt in (lambda: ppokit.load(run_dir), lambda: resume(run_dir, console_enabled=False)):
        with pytest.raises(CheckpointError) as exc:
            attempt()
        text = str(exc.value)
        assert "Box(-2.0, 2.0, (1,), float32)" in text and "Box(-4.0, 4.0, (1,), float32)" in text
        assert "ppokit-test/WidePendulum-v0" in text


def test_checkpoints_without_space_signatures_still_load_and_resume(runs, tmp_path):
    """Checkpoints written before the signatures were stored are checked through the policy's shapes."""
    run_dir = _copy(runs, "pendulum", tmp_path / "run")

    def strip(state):
        del state["spaces"]["observation_signature"], state["spaces"]["action_signature"]

    _forge(run_dir, strip)
    agent = ppokit.load(run_dir)
    assert agent.action_high.tolist() == [2.0]
    assert resume(run_dir, total_timesteps=96, console_enabled=False).global_step == 96


@pytest.mark.slow  # a subprocess: seconds; CI runs it
def test_a_config_naming_another_env_is_one_line_for_eval(runs, tmp_path):
    run_dir = _copy(runs, "acrobot", tmp_path / "run")
    _forge(run_dir, lambda s: s["config"].__setitem__("env_id", "CartPole-v1"))
    rc, out = _cli(["eval", "run", "--episodes", "1"], tmp_path)
    assert rc == 2
    assert "its config's env CartPole-v1 does not match the trained policy" in _one_error_line(out)


# ------------------------------------------------------------------ wandb_project
@pytest.mark.parametrize("name, shown", [
    ("team/project", "cannot contain"),
    ("a:b", "cannot contain"),
    ("100%", "cannot contain"),
    ("what?", "cannot contain"),
    ("run#1", "cannot contain"),
    ("back\\slash", "cannot contain"),
    ("x" * 129, "at most 128 characters"),
    ("   ", "non-empty"),
])
def test_wandb_project_names_wandb_refuses_are_refused(name, shown):
    with pytest.raises(ConfigError) as exc:
        PPOConfig(wandb_project=name).validate()
    assert exc.value.field == "wandb_project" and shown in exc.value.reason
    if name.strip():  # W&B's own validator (wandb.Settings) refuses the same names; the all-blank one is ours
        wandb_settings = pytest.importorskip("wandb.sdk.wandb_settings")
        with pytest.raises(Exception, match="Invalid project name"):
            wandb_settings.Settings(project=name)


@pytest.mark.parametrize("name", ["ppokit", "my-team_project.v2", "x" * 128, "CartPole runs"])
def test_wandb_project_names_wandb_accepts_are_accepted(name):
    assert PPOConfig(wandb_project=name).validate().wandb_project == name  # validate() raises on a refused name


def test_a_bad_wandb_project_is_one_line_on_the_command_line(tmp_path, capsys):
    rc = main(["train", "--env", "CartPole-v1", "--wandb-project", "me/proj", "--run-dir", str(tmp_path / "r"),
               "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "'wandb_project'" in err and "cannot contain" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ the network in the memory check
def test_hidden_sizes_too_big_for_the_machine_are_refused_before_anything_is_built(tmp_path, capsys):
    rc = main(["train", "--env", "CartPole-v1", "--hidden-sizes", "100000,100000", "--run-dir",
               str(tmp_path / "r"), "--quiet"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "Traceback" not in err
    assert "'hidden_sizes'" in err and "20,000,800,002 parameters" in err and "GiB available on cpu" in err
    assert not (tmp_path / "r").exists()


class WideObservationEnv(gym.Env):
    """A million observation floats: small to store for one step, enormous under a wide first layer."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1_000_000,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(self.observation_space.shape, np.float32), {}

    def step(self, action):
        return np.zeros(self.observation_space.shape, np.float32), 0.0, True, False, {}


def test_the_trainer_counts_the_real_network_before_building_it(tmp_path):
    """validate() counts a one-float observation (a lower bound); the trainer counts the policy the spaces make:
    here 2 x 1,000,000 x 20,000 first-layer weights, 640 GB with gradients and Adam, refused before allocation
    (without the check torch would try to allocate them)."""
    from ppokit.policies.build import policy_parameters

    cfg = PPOConfig(env_id="wide", num_envs=1, num_steps=8, num_minibatches=1, update_epochs=1,
                    total_timesteps=8, hidden_sizes=[20_000, 1], tensorboard=False, run_dir=str(tmp_path / "r"))
    cfg.validate()  # the lower bound fits
    with pytest.raises(ConfigError) as exc:
        train(cfg, env=WideObservationEnv, console_enabled=False)
    n = policy_parameters(WideObservationEnv.observation_space, WideObservationEnv.action_space, [20_000, 1], "tanh")
    assert exc.value.field == "hidden_sizes" and f"of {n:,} parameters" in exc.value.reason
    assert n > 2 * 1_000_000 * 20_000


@pytest.mark.parametrize("make_spaces", [
    lambda: (gym.make("CartPole-v1").observation_space, gym.spaces.Discrete(2)),
    lambda: (gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Box(-2, 2, (2,), np.float32)),
    lambda: (gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), gym.spaces.Discrete(6)),
    lambda: (gym.spaces.Dict({"img": gym.spaces.Box(0, 255, (3, 36, 36), np.uint8),
                              "vec": gym.spaces.Box(-1, 1, (5,), np.float32)}), gym.spaces.MultiDiscrete([3, 4])),
])
def test_the_parameter_count_is_the_built_policys(make_spaces):
    from ppokit.policies import build_policy
    from ppokit.policies.build import policy_parameters

    obs_space, act_space = make_spaces()
    built = build_policy(obs_space, act_space, [64, 32], "tanh")
    assert policy_parameters(obs_space, act_space, [64, 32], "tanh") == sum(p.numel() for p in built.parameters())
