"""Custom envs the way users bring them: ``train(config, env=factory | instance | id)``, ``env_kwargs`` for the env's
constructor (``--env-kwargs`` JSON, a TOML table), and ``module:EnvId`` importing a module from the current
directory, also under the installed ``ppokit`` console script.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

from ppokit.cli import main
from ppokit.config.ppo_config import ConfigError, PPOConfig
from ppokit.envs import make_vec_env
from ppokit.runtime.checkpoint import CheckpointError, load_checkpoint
from ppokit.training.agent import evaluate, load
from ppokit.training.trainer import Trainer, resume, train

SMALL = dict(num_steps=16, num_minibatches=2, update_epochs=1, total_timesteps=64, tensorboard=False, log_every=1)


class Corridor(gym.Env):
    """Walk right to the end of a 5-cell corridor. ``steps_taken`` counts every step ever (never reset), so an env
    whose state was restored from a checkpoint differs from a freshly reset one."""

    observation_space = gym.spaces.Box(0.0, 1.0, (5,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        self.pos, self.t, self.steps_taken = 0, 0, 0

    def _obs(self):
        obs = np.zeros(5, np.float32)
        obs[self.pos] = 1.0
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos, self.t = int(self.np_random.integers(0, 2)), 0
        return self._obs(), {}

    def step(self, action):
        self.steps_taken += 1
        self.t += 1
        self.pos = min(4, self.pos + 1) if action == 1 else max(0, self.pos - 1)
        return self._obs(), float(self.pos == 4), self.pos == 4, self.t >= 20, {}


class CountSteps(gym.Wrapper):
    """A user's wrapper: counts the steps that went through it."""

    def __init__(self, env):
        super().__init__(env)
        self.count = 0

    def step(self, action):
        self.count += 1
        return self.env.step(action)


class OneHot(gym.ObservationWrapper):
    """FrozenLake's Discrete(16) position as a one-hot float vector."""

    def __init__(self, env):
        super().__init__(env)
        self.observation_space = gym.spaces.Box(0.0, 1.0, (int(env.observation_space.n),), np.float32)

    def observation(self, obs):
        out = np.zeros(self.observation_space.shape, np.float32)
        out[int(obs)] = 1.0
        return out


LAKES_BUILT: list[tuple[dict, bool]] = []  # (env_kwargs, slippery) of every FrozenLake built in this process


def _frozen_lake_one_hot(**kwargs):
    lake = FrozenLakeEnv(**kwargs)
    LAKES_BUILT.append((dict(kwargs), _slippery(lake)))
    return OneHot(lake)


LAKE = "ppokit_test/FrozenLakeOneHot-v0"
if LAKE not in gym.registry:
    # FrozenLake itself (its constructor takes the env_kwargs), one-hot encoded so that an MLP reads it.
    gym.register(LAKE, entry_point=_frozen_lake_one_hot, max_episode_steps=100)


def _slippery(env) -> bool:
    """True when some (state, action) of a FrozenLake has more than one outcome (FrozenLake's P table)."""
    table = env.unwrapped.P
    return any(len(outcomes) > 1 for actions in table.values() for outcomes in actions.values())


def _trainer(config, run_dir, **kw) -> Trainer:
    return Trainer(config, run_dir=run_dir, console_enabled=False, **kw)


# ------------------------------------------------------------------ a factory
def test_train_with_a_factory_builds_num_envs_and_records_the_env(tmp_path):
    calls = []

    def make_corridor():
        calls.append(1)
        return Corridor()

    run = train(PPOConfig(num_envs=3, **SMALL), run_dir=tmp_path / "run", console_enabled=False, env=make_corridor)
    assert len(calls) == 3 and run.global_step == 48  # one batch of 3 envs x 16 steps
    assert run.config.env_id == "custom:Corridor"  # no spec: the unwrapped class names it
    saved = PPOConfig.from_toml(tmp_path / "run" / "config.toml")
    assert saved.env_id == "custom:Corridor"
    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert state["custom_env"] == {"kind": "factory", "name": "custom:Corridor"}


def test_a_factory_runs_under_async_too(tmp_path):
    run = train(PPOConfig(num_envs=2, vector_mode="async", **SMALL), run_dir=tmp_path / "run", console_enabled=False,
                env=Corridor)  # a class is a zero-argument factory
    assert run.global_step == 64 and run.config.env_id == "custom:Corridor"


def test_sync_envs_from_a_factory_have_their_state_checkpointed_and_restored(tmp_path):
    config = PPOConfig(num_envs=2, **SMALL)
    trainer = _trainer(config, tmp_path / "run", env=Corridor)
    trainer.run()
    trained = [(e.unwrapped.pos, e.unwrapped.t, e.unwrapped.steps_taken) for e in trainer.envs.envs]
    assert all(steps == 32 for *_, steps in trained)

    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert state["env_state"] is not None
    resumed = _trainer(PPOConfig.from_dict(state["config"]), tmp_path / "run", env=Corridor, resume_state=state)
    try:
        # A fresh env would have steps_taken == 0: these continue where the checkpoint left them.
        assert [(e.unwrapped.pos, e.unwrapped.t, e.unwrapped.steps_taken) for e in resumed.envs.envs] == trained
        np.testing.assert_array_equal(resumed.next_obs_raw, trainer.next_obs_raw)
    finally:
        resumed._abandon()


def test_resume_of_a_factory_run_needs_the_env_again(tmp_path):
    train(PPOConfig(num_envs=2, **SMALL), run_dir=tmp_path / "run", console_enabled=False, env=Corridor)
    with pytest.raises(CheckpointError, match=r"trained on an env factory .*'custom:Corridor'.*env=\.\.\."):
        resume(tmp_path / "run", total_timesteps=128, console_enabled=False)
    run = resume(tmp_path / "run", total_timesteps=128, console_enabled=False, env=Corridor)
    assert run.global_step == 128 and run.config.env_id == "custom:Corridor"


def test_the_cli_cannot_resume_or_evaluate_a_factory_run_and_says_why(tmp_path, capsys):
    train(PPOConfig(num_envs=2, **SMALL), run_dir=tmp_path / "run", console_enabled=False, env=Corridor)
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "run"), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "'custom:Corridor'" in err and "pass the same env again" in err and "Traceback" not in err
    # Never "would import the Python module 'custom'": the record is a name, not a module to import.
    assert main(["eval", str(tmp_path / "run"), "--episodes", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "trained on an env factory" in err and "--env" in err and "import" not in err.replace("ppokit.", "")


def test_load_and_evaluate_a_factory_run_with_the_env_passed_again(tmp_path):
    train(PPOConfig(num_envs=2, **SMALL), run_dir=tmp_path / "run", console_enabled=False, env=Corridor)
    agent = load(tmp_path / "run")  # acting needs no env
    assert agent.act(Corridor()._obs()) in (0, 1)
    with pytest.raises(ValueError, match=r"trained on an env factory .*evaluate\(agent, env=\.\.\.\)"):
        evaluate(agent, episodes=1)
    assert len(evaluate(agent, env=Corridor, episodes=2)["returns"]) == 2
    assert len(evaluate(load(tmp_path / "run", env=Corridor), episodes=2)["returns"]) == 2
    # An env of other spaces is refused naming both sides.
    with pytest.raises(ValueError, match="does not match the trained policy"):
        load(tmp_path / "run", env=lambda: gym.make("CartPole-v1"))


# ------------------------------------------------------------------ an instance
def test_train_with_an_instance(tmp_path):
    env = Corridor()
    run = train(PPOConfig(num_envs=1, **SMALL), run_dir=tmp_path / "run", console_enabled=False, env=env)
    assert env.steps_taken == 64  # that very object was stepped, not a copy
    assert run.config.env_id == "custom:Corridor"
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["custom_env"]["kind"] == "instance"
    assert len(evaluate(load(tmp_path / "run"), env=env, episodes=1)["returns"]) == 1


def test_train_with_a_wrapped_instance_records_its_spec_id_and_uses_the_wrapper(tmp_path):
    env = CountSteps(gym.make("CartPole-v1"))
    run = train(PPOConfig(num_envs=1, **SMALL), run_dir=tmp_path / "run", console_enabled=False, env=env)
    assert env.count == 64  # through the user's wrapper: not rebuilt from the id
    assert run.config.env_id == "CartPole-v1"
    assert PPOConfig.from_toml(tmp_path / "run" / "config.toml").env_id == "CartPole-v1"
    # The id alone would rebuild CartPole without the wrapper: the same env must be passed again.
    with pytest.raises(CheckpointError, match=r"an env instance .*'CartPole-v1'"):
        resume(tmp_path / "run", total_timesteps=128, console_enabled=False)
    assert resume(tmp_path / "run", total_timesteps=128, console_enabled=False, env=env).global_step == 128
    assert env.count == 128


@pytest.mark.parametrize("fields,env,field,words", [
    (dict(num_envs=2), "instance", "num_envs", "pass a factory instead"),
    (dict(num_envs=1, vector_mode="async"), "instance", "vector_mode", "subprocess"),
    (dict(num_envs=1, eval_every=1, eval_threshold=1.0), "instance", "eval_every", "pass a factory instead"),
    (dict(num_envs=2, vector_mode="native"), "factory", "vector_mode", "registered id"),
    (dict(num_envs=2, vector_mode="envpool"), "factory", "vector_mode", "registered id"),
    (dict(num_envs=2, env_kwargs={"size": 5}), "factory", "env_kwargs", "give those arguments to your factory"),
], ids=["instance-num_envs", "instance-async", "instance-eval-gate", "factory-native", "factory-envpool",
        "factory-env_kwargs"])
def test_what_a_custom_env_cannot_serve_is_refused_naming_the_field(fields, env, field, words, tmp_path):
    given = Corridor() if env == "instance" else Corridor
    with pytest.raises(ConfigError) as e:
        train(PPOConfig(**{**SMALL, **fields}), run_dir=tmp_path / "run", console_enabled=False, env=given)
    assert e.value.field == field and words in str(e.value)
    assert not (tmp_path / "run").exists()


SHARED = Corridor()


@pytest.mark.parametrize("env,words", [
    (lambda: "CartPole-v1", "returned str, not a gymnasium.Env"),
    (lambda: SHARED, "returned the same env object more than once"),
    (42, "must be a registered id, a zero-argument callable"),
    (gym.vector.SyncVectorEnv([Corridor]), "a vector env instance is not supported"),
], ids=["factory-returns-a-string", "factory-returns-one-object-twice", "a-number", "a-vector-env"])
def test_a_wrong_env_object_is_one_clear_error(env, words, tmp_path):
    with pytest.raises(ValueError, match=words):
        train(PPOConfig(num_envs=2, **SMALL), run_dir=tmp_path / "run", console_enabled=False, env=env)
    assert not (tmp_path / "run").exists()


def test_a_factory_that_raises_is_an_env_error_naming_it(tmp_path):
    from ppokit.envs.errors import EnvError

    def make_broken_env():
        raise RuntimeError("no simulator licence")

    with pytest.raises(EnvError, match=r"custom:.*make_broken_env.*make\(\).*no simulator licence"):
        train(PPOConfig(num_envs=2, **SMALL), run_dir=tmp_path / "run", console_enabled=False, env=make_broken_env)


def test_an_id_given_as_env_replaces_the_configs(tmp_path):
    config = PPOConfig(num_envs=2, **SMALL)
    run = train(config, run_dir=tmp_path / "run", console_enabled=False, env="ppokit/GridWorld-v0")
    assert run.config.env_id == "ppokit/GridWorld-v0" and config.env_id == "CartPole-v1"  # copied, not changed


# ------------------------------------------------------------------ env_kwargs
def test_env_kwargs_from_the_cli_reach_config_toml_the_env_and_a_resume(tmp_path, capsys):
    kwargs = {"is_slippery": False, "map_name": "4x4"}
    LAKES_BUILT.clear()
    run_dir = tmp_path / "run"
    argv = ["train", "--env", LAKE, "--env-kwargs", '{"is_slippery": false, "map_name": "4x4"}', "--num-envs", "2",
            "--num-steps", "32", "--total-timesteps", "64", "--run-dir", str(run_dir), "--quiet", "--no-tensorboard"]
    assert main(argv) == 0, capsys.readouterr().err
    # Every lake the run built (the planner's probe, both training envs) took the kwargs: none is slippery.
    assert len(LAKES_BUILT) >= 2 and all(built == (kwargs, False) for built in LAKES_BUILT), LAKES_BUILT
    assert 'env_kwargs = {is_slippery = false, map_name = "4x4"}' in (run_dir / "config.toml").read_text()
    assert PPOConfig.from_toml(run_dir / "config.toml").env_kwargs == kwargs
    assert load_checkpoint(run_dir / "checkpoint.pt")["config"]["env_kwargs"] == kwargs

    LAKES_BUILT.clear()
    assert main(["train", "--resume", str(run_dir), "--total-timesteps", "128", "--quiet"]) == 0
    assert len(LAKES_BUILT) >= 2 and all(built == (kwargs, False) for built in LAKES_BUILT), LAKES_BUILT
    # The default really is slippery, so the assertions above could fail.
    assert _slippery(gym.make(LAKE)) and not _slippery(gym.make("FrozenLake-v1", is_slippery=False))


def test_evaluation_uses_the_runs_env_kwargs(tmp_path, capsys):
    config = PPOConfig(env_id=LAKE, env_kwargs={"map_name": "8x8"}, num_envs=2, **SMALL)
    train(config, run_dir=tmp_path / "run", console_enabled=False)
    agent = load(tmp_path / "run")
    # 8x8 has 64 states: without the run's kwargs the 4x4 default (16) would not fit the policy.
    assert len(evaluate(agent, episodes=1)["returns"]) == 1
    assert main(["eval", str(tmp_path / "run"), "--episodes", "1"]) == 0
    assert main(["eval", str(tmp_path / "run"), "--episodes", "1", "--env-kwargs", '{"map_name": "4x4"}']) == 2
    assert "does not match the trained policy" in " ".join(capsys.readouterr().err.split())
    assert main(["eval", str(tmp_path / "run"), "--episodes", "1", "--env-kwargs", "{bad"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "config field 'env_kwargs'" in err and "Traceback" not in err


class NeedsSize(Corridor):
    """A corridor whose constructor has a required argument: no env of it exists without env_kwargs."""

    def __init__(self, size):
        super().__init__()
        self.size = size


if "ppokit_test/NeedsSize-v0" not in gym.registry:
    gym.register("ppokit_test/NeedsSize-v0", entry_point=NeedsSize, max_episode_steps=20)


def test_the_planner_probes_a_bare_env_with_its_env_kwargs(tmp_path, capsys):
    # --env alone means the planner's config, and the planner builds the env to probe it: with the kwargs.
    argv = ["train", "--env", "ppokit_test/NeedsSize-v0", "--num-envs", "2", "--num-steps", "32",
            "--total-timesteps", "64", "--quiet", "--no-tensorboard"]
    assert main([*argv, "--env-kwargs", '{"size": 5}', "--run-dir", str(tmp_path / "a")]) == 0
    assert PPOConfig.from_toml(tmp_path / "a" / "config.toml").env_kwargs == {"size": 5}
    capsys.readouterr()
    assert main([*argv, "--env-kwargs", '{"sise": 5}', "--run-dir", str(tmp_path / "b")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "config field 'env_kwargs'" in err and "sise" in err and "Traceback" not in err


@pytest.mark.parametrize("mode,env_id,kwargs,check", [
    ("sync", LAKE, {"is_slippery": False}, lambda envs: not any(_slippery(e) for e in envs.envs)),
    ("async", LAKE, {"map_name": "8x8"}, lambda envs: envs.single_observation_space.shape == (64,)),
    ("native", "CartPole-v1", {"max_episode_steps": 7}, lambda envs: envs.max_episode_steps == 7),
], ids=["sync", "async", "native"])
def test_env_kwargs_reach_every_vector_mode(mode, env_id, kwargs, check):
    envs = make_vec_env(env_id, 2, 0, mode, kwargs)
    try:
        assert check(envs)
    finally:
        envs.close()


def test_env_kwargs_reach_envpool():
    pytest.importorskip("envpool", reason="envpool is optional: pip install -e '.[envpool]'")
    envs = make_vec_env("CartPole-v1", 2, 0, "envpool", {"max_episode_steps": 7})
    try:
        assert envs._pool.spec.config.max_episode_steps == 7
        envs.reset(seed=0)
        for _ in range(7):
            *_, truncated, _ = envs.step(np.zeros(2, dtype=np.int64))
        assert truncated.all()
    finally:
        envs.close()


@pytest.mark.parametrize("mode,env_id", [("sync", LAKE), ("async", LAKE), ("native", "CartPole-v1"),
                                         ("envpool", "CartPole-v1")])
def test_an_unknown_env_kwarg_is_a_config_error_naming_it(mode, env_id):
    if mode == "envpool":
        pytest.importorskip("envpool", reason="envpool is optional: pip install -e '.[envpool]'")
    with pytest.raises(ConfigError) as e:
        make_vec_env(env_id, 2, 0, mode, {"no_such_arg": 1})
    assert e.value.field == "env_kwargs" and "no_such_arg" in str(e.value)
    assert "was raised from the environment creator" not in str(e.value)  # Gymnasium's kwargs dump is cut


@pytest.mark.slow  # subprocesses: seconds each; CI runs it
def test_a_bad_env_kwarg_on_the_real_cli_is_one_line_exit_2(tmp_path):
    env = {**os.environ, "COLUMNS": "200"}
    for value, words in [('{"no_such_arg": 1}', "no_such_arg"), ('{"map_name": "9x9"}', "KeyError"),
                         ("{not json", "not valid JSON")]:
        proc = subprocess.run([sys.executable, "-m", "ppokit.cli", "train", "--env", "FrozenLake-v1", "--env-kwargs",
                               value, "--preset", "gridworld", "--quiet"], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "config field 'env_kwargs'" in proc.stderr and words in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("text", [
    'env_kwargs = { is_slippery = false, map_name = "4x4" }',
    '[env_kwargs]\nis_slippery = false\nmap_name = "4x4"',
    '[ppo]\nnum_envs = 2\n[ppo.env_kwargs]\nis_slippery = false\nmap_name = "4x4"',
], ids=["inline-table", "table", "under-ppo"])
def test_env_kwargs_in_toml(text, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(text + "\n")
    config = PPOConfig.from_toml(path)
    assert config.env_kwargs == {"is_slippery": False, "map_name": "4x4"}
    # config.toml round trip, including the values TOML and JSON share.
    config.env_kwargs = {"a": [1, 2.5, "x", [True]], "café": -3}  # a non-ASCII identifier is a quoted TOML key
    path.write_text(config.to_toml())
    assert PPOConfig.from_toml(path).env_kwargs == {"a": [1, 2.5, "x", [True]], "café": -3}


def test_env_kwargs_from_python_are_checked_and_copied():
    kwargs = {"map_name": "8x8"}
    config = PPOConfig(env_kwargs=kwargs)
    assert config.to_dict()["env_kwargs"] is not kwargs  # a checkpoint's config never aliases the caller's dict
    assert PPOConfig.from_dict({"env_kwargs": '{"a": [1, 2]}'}).env_kwargs == {"a": [1, 2]}
    for bad in [{"a": None}, {1: 2}, {"a": {"b": 1}}, {"a": float("nan")}, "{}", [("a", 1)]]:
        with pytest.raises(ConfigError) as e:
            PPOConfig(env_kwargs=bad).validate()
        assert e.value.field == "env_kwargs"


# ------------------------------------------------------------------ module:EnvId from the current directory
MYMOD = textwrap.dedent("""
    import gymnasium as gym
    import numpy as np


    class MyEnv(gym.Env):
        observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def __init__(self, goal=1):
            self.goal, self.t = goal, 0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return np.zeros(3, np.float32), {}

        def step(self, action):
            self.t += 1
            return np.zeros(3, np.float32), float(action == self.goal), False, self.t >= 10, {}


    gym.register("MyEnv-v0", entry_point="mymod:MyEnv")
""")


def _console_script() -> str:
    script = Path(sys.executable).parent / "ppokit"
    if not script.exists():
        pytest.skip("the ppokit console script is not installed next to this python (pip install -e .)")
    return str(script)


@pytest.mark.slow  # subprocesses: seconds each; CI runs it
def test_module_env_id_imports_from_the_cwd_under_the_console_script(tmp_path):
    (tmp_path / "mymod.py").write_text(MYMOD)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["COLUMNS"] = "200"
    proc = subprocess.run([_console_script(), "train", "--env", "mymod:MyEnv-v0", "--env-kwargs", '{"goal": 0}',
                           "--num-envs", "2", "--num-steps", "32", "--total-timesteps", "64", "--run-dir", "run",
                           "--quiet", "--no-tensorboard"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    saved = PPOConfig.from_toml(tmp_path / "run" / "config.toml")
    assert (saved.env_id, saved.env_kwargs) == ("mymod:MyEnv-v0", {"goal": 0})
    # A stored module id still needs permission to be imported again (a checkpoint never chooses what runs).
    proc = subprocess.run([_console_script(), "train", "--resume", "run", "--total-timesteps", "128", "--quiet"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=180)
    assert proc.returncode == 2 and "--import-module mymod" in proc.stderr, proc.stderr
    proc = subprocess.run([_console_script(), "train", "--resume", "run", "--total-timesteps", "128", "--quiet",
                           "--import-module", "mymod"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr


def test_the_cwd_goes_to_the_end_of_sys_path_after_the_import(tmp_path, monkeypatch):
    from ppokit.envs.factory import check_env_id

    (tmp_path / "mymod_cwd_probe.py").write_text(MYMOD.replace('"MyEnv-v0"', '"MyEnvCwdProbe-v0"')
                                                 .replace("mymod:MyEnv", "mymod_cwd_probe:MyEnv"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymod_cwd_probe", raising=False)
    check_env_id("mymod_cwd_probe:MyEnvCwdProbe-v0")
    assert sys.path[-1] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1
    assert gym.make("MyEnvCwdProbe-v0").reset(seed=0)[0].shape == (3,)
    sys.modules.pop("mymod_cwd_probe", None)
    gym.registry.pop("MyEnvCwdProbe-v0", None)
