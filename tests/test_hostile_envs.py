"""Hostile environments: an env that raises, or returns what its spaces do not allow, ends ``ppokit train`` with
one line naming the env id, the env index, the phase and the global step (exit code 1, no traceback), and the
learner state the last checkpoint lacks is saved. A NaN reward is not an error: it is counted and skipped.

The envs are registered here with class entry points, so they exist only in this process (sync vector mode).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from ppokit.cli import main
from ppokit.diagnostics.plots import read_metrics
from ppokit.envs.errors import EnvError
from ppokit.runtime.checkpoint import load_checkpoint

PREFIX = "ppokit_test/Hostile"


class Hostile(gym.Env):
    """A 3-float Box, 2-action env whose episodes last 20 steps; ``mode`` picks the misbehaviour.

    ``index`` numbers the instances built since the last ``Hostile.created = 0``, in the order a sync vector env
    builds its sub-envs, so a mode can misbehave in one sub-env only.
    """

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Discrete(2)
    metadata: dict = {"render_modes": []}
    mode = "ok"
    created = 0

    def __init__(self):
        self.index = Hostile.created
        Hostile.created += 1
        self.t = 0  # steps in this episode
        self.calls = 0  # step() calls over the env's life
        self.resets = 0
        self.evaluating = False
        self.first_seed = None  # a sync or async vector env seeds sub-env i with seed + i

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.resets += 1
        self.first_seed = seed if self.first_seed is None else self.first_seed
        if self.mode == "hang_reset":
            hang()
        if self.mode == "raise_reset" or (self.mode == "raise_second_reset" and self.resets == 2):
            raise RuntimeError("reset exploded")
        if self.mode == "obs_only_reset":
            return self._obs()
        if self.mode == "raise_eval_reset" and seed is not None and seed > 1000:
            # The evaluation gate resets with seed + 7919 * (update + 1); training resets use the run's seed.
            raise RuntimeError("evaluation reset exploded")
        self.evaluating = seed is not None and seed > 1000 or self.evaluating
        return self._obs(), {}

    def _obs(self):
        if self.mode == "str_obs":
            return "hello"
        if self.mode == "object_obs":
            return np.array([object(), 1.0, 2.0], dtype=object)
        if self.mode == "shape_obs" or (self.mode == "shape_obs_later" and self.calls >= 5) or (
                self.mode == "eval_shape_obs" and self.evaluating and self.calls > 0):
            return np.zeros(5, np.float32)
        return np.full(3, 0.1 * (self.t % 5), np.float32)

    def step(self, action):
        self.t += 1
        self.calls += 1
        if self.mode == "raise_step" and self.index == 1 and self.calls == 150:
            raise RuntimeError("step exploded")
        # Sub-env 1 of a run with --seed 100, sync or async (where every worker's env is built with index 1).
        if self.mode in ("hang_step", "hang_step_swallowing") and self.first_seed == 101 and self.calls == 150:
            hang(swallow=self.mode == "hang_step_swallowing")
        reward = 1.0
        if self.mode == "none_reward":
            reward = None
        elif self.mode == "array_reward":
            reward = np.array([1.0, 2.0])
        elif self.mode == "nan_reward_sometimes" and self.calls % 7 == 0:
            reward = float("nan")
        elif self.mode == "nan_reward_always":
            reward = float("nan")
        elif self.mode == "str_reward":
            reward = "x"
        if self.mode == "four_tuple_step":  # the old Gym API
            return self._obs(), reward, self.t >= 20, {}
        return self._obs(), reward, False, self.t >= 20, {}


def hang(swallow: bool = False) -> None:
    """Never return, as far as a test can see (60 s, so a watchdog that fails fails the test, not the suite);
    ``swallow``: catch every exception on the way (an env with a broad ``except Exception``)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            time.sleep(0.05)
        except Exception:  # noqa: BLE001 - this env's point
            if not swallow:
                raise


class RaisingConstructor(Hostile):
    def __init__(self):
        raise RuntimeError("constructor exploded")


class RaisingClose(Hostile):
    def close(self):
        raise RuntimeError("close exploded")


class HangingClose(Hostile):
    def close(self):
        if self.calls:  # not the spaces probe's env (an async vector env builds and closes one first)
            hang()


class RaisingCloseAfterStep(Hostile):
    def close(self):
        if self.calls:  # not the spaces probe's env
            raise RuntimeError("close exploded")


for _cls in (RaisingConstructor, RaisingClose, HangingClose, RaisingCloseAfterStep):
    if f"{PREFIX}-{_cls.__name__}-v0" not in gym.registry:
        gym.register(id=f"{PREFIX}-{_cls.__name__}-v0", entry_point=_cls, disable_env_checker=True)

MODES = ("raise_step", "raise_reset", "raise_second_reset", "raise_eval_reset", "obs_only_reset", "four_tuple_step",
         "str_obs", "object_obs", "shape_obs", "shape_obs_later", "none_reward", "array_reward", "str_reward",
         "nan_reward_sometimes", "nan_reward_always", "eval_shape_obs", "hang_step", "hang_step_swallowing",
         "hang_reset")
for _mode in MODES:
    _cls = type(f"Hostile_{_mode}", (Hostile,), {"mode": _mode})
    globals()[_cls.__name__] = _cls
    if f"{PREFIX}-{_mode}-v0" not in gym.registry:
        gym.register(id=f"{PREFIX}-{_mode}-v0", entry_point=_cls, disable_env_checker=True)


def train(mode: str, run_dir: Path, capsys, *extra: str) -> tuple[int, str]:
    """``ppokit train`` on the hostile env ``mode`` with a tiny budget: (exit code, stdout + stderr)."""
    Hostile.created = 0
    # 2 envs x 32 steps = 64 per update, 10 updates; a checkpoint every 3 updates.
    code = main(["train", "--preset", "cartpole", "--env", f"{PREFIX}-{mode}-v0", "--total-timesteps", "640",
                 "--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "1",
                 "--save-every", "3", "--quiet", "--run-dir", str(run_dir), *extra])
    out = capsys.readouterr()
    return code, out.out + out.err


def error_line(output: str) -> str:
    """The one ``error:`` line; the output holds no traceback."""
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    return lines[0]


@pytest.mark.parametrize("mode, phase, wanted", [
    ("raise_reset", "reset()", ["global step 0", "env index 0", "RuntimeError: reset exploded"]),
    # The autoreset at the end of the first 20-step episode: inside the vector env's step(), after 19 x 2 steps.
    ("raise_second_reset", "step()", ["global step 38", "env index 0", "RuntimeError: reset exploded"]),
    ("obs_only_reset", "reset()", ["env index 0", "returned array of shape (3,) and dtype float32, "
                                   "expected a tuple (obs, info)"]),
    ("four_tuple_step", "step()", ["env index 0", "(tuple), expected a tuple (obs, reward, terminated, truncated, "
                                   "info)"]),
    ("str_obs", "reset()", ["env index 0", "observation 'hello' (str)", "expected a float32 array of shape (3,)"]),
    ("object_obs", "reset()", ["env index 0", "dtype object", "expected a float32 array of shape (3,)"]),
    ("shape_obs", "reset()", ["env index 0", "observation of shape (5,)", "expected a float32 array of shape (3,)"]),
    ("shape_obs_later", "step()", ["global step 8", "observation of shape (5,)", "shape (3,)"]),
    ("none_reward", "step()", ["reward None (NoneType), expected a float", "nothing to train on"]),
    ("array_reward", "step()", ["global step 0", "env index 0", "reward array of shape (2,)",
                                "expected a float scalar"]),
    ("str_reward", "step()", ["env index 0", "reward 'x' (str), expected a float"]),
])
def test_malformed_env_output_is_one_clear_line(tmp_path, capsys, mode, phase, wanted):
    code, output = train(mode, tmp_path / "run", capsys)
    line = error_line(output)
    assert code == 1, output
    assert f"env '{PREFIX}-{mode}-v0'" in line and f"failed in {phase}" in line, line
    for text in wanted:
        assert text in line, (text, line)


def test_env_raising_in_step_names_env_index_and_step_and_saves_the_learner(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, output = train("raise_step", run_dir, capsys)
    line = error_line(output)
    assert code == 1
    # Sub-env 1 raises on its 150th step: during update 5's rollout, after 4 * 64 + 149 * 2 = ... steps; the
    # global step named is the one before the failed vector step (both sub-envs step together: 2 * 149).
    assert f"env '{PREFIX}-raise_step-v0' (env index 1) failed in step() at global step 298" in line, line
    assert "RuntimeError: step exploded" in line
    # The checkpoint of update 3 (save_every 3) is replaced by the learner state of update 4, whose step count
    # is that of the update (not of the failed rollout) and whose env state is left out (a resume starts afresh).
    assert f"saved the learner state of update 4 to {run_dir / 'checkpoint.pt'}" in line, line
    state = load_checkpoint(run_dir / "checkpoint.pt")
    assert state["update"] == 4 and state["global_step"] == 4 * 64 and state["env_state"] is None
    alerts = [json.loads(x) for x in (run_dir / "alerts.jsonl").read_text().splitlines()]
    assert [a["name"] for a in alerts if a["level"] == "alert"][-1:] == ["env_error"]
    # What was logged stays: one row per finished update.
    assert read_metrics(run_dir / "metrics.csv")["update"] == [1.0, 2.0, 3.0, 4.0]



def test_resume_after_env_error_continues_from_the_saved_update(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train("raise_step", run_dir, capsys)[0] == 1
    Hostile.created = 0  # sub-env 1 raises on its 150th step again: 4 updates later
    code = main(["train", "--resume", str(run_dir), "--quiet"])
    line = error_line(capsys.readouterr().err)
    assert code == 1
    # 256 steps at the checkpoint + 149 x 2 more before the failing step.
    assert "at global step 554" in line and "saved the learner state of update 8" in line, line
    assert read_metrics(run_dir / "metrics.csv")["update"] == [float(u) for u in range(1, 9)]


def test_env_error_keeps_an_up_to_date_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, output = train("raise_step", run_dir, capsys, "--save-every", "2")
    line = error_line(output)
    assert code == 1
    assert f"the checkpoint of update 4 in {run_dir / 'checkpoint.pt'} is up to date" in line, line
    state = load_checkpoint(run_dir / "checkpoint.pt")
    assert state["update"] == 4 and state["env_state"] is not None  # the regular save, untouched


def test_evaluation_env_failure_saves_the_update_just_made(tmp_path, capsys):
    run_dir = tmp_path / "run"
    # save_every 1: the gate runs before the update's regular save, so that save must not be taken as done.
    code, output = train("raise_eval_reset", run_dir, capsys, "--eval-every", "1", "--eval-threshold", "1e9",
                         "--save-every", "1")
    line = error_line(output)
    assert code == 1
    assert f"env '{PREFIX}-raise_eval_reset-v0' (env index 0) failed in evaluation reset() at global step 64" \
        in line, line
    assert "RuntimeError: evaluation reset exploded" in line
    assert f"saved the learner state of update 1 to {run_dir / 'checkpoint.pt'}" in line, line
    assert load_checkpoint(run_dir / "checkpoint.pt")["update"] == 1


def test_evaluation_env_bad_observation_names_the_evaluation_step(tmp_path, capsys):
    code, output = train("eval_shape_obs", tmp_path / "run", capsys, "--eval-every", "2", "--eval-threshold", "1e9")
    line = error_line(output)
    assert code == 1
    assert f"env '{PREFIX}-eval_shape_obs-v0' (env index 0) failed in evaluation step() at global step 128: " \
           "returned observation of shape (5,), expected a float32 array of shape (3,)" in line, line
    assert "saved the learner state of update 2" in line, line


def test_nan_reward_is_counted_and_skipped_not_an_error(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, output = train("nan_reward_sometimes", run_dir, capsys)
    assert code == 0, output
    assert "Traceback" not in output
    metrics = read_metrics(run_dir / "metrics.csv")
    assert len(metrics["update"]) == 10
    # Each sub-env's every 7th step is NaN: 64 steps per update -> about 9 per update, never trained on.
    assert 8 * 10 <= sum(metrics["diag/nonfinite_env"]) <= 10 * 10
    assert load_checkpoint(run_dir / "checkpoint.pt")["update"] == 10


def test_all_nan_rollout_is_an_error_not_an_empty_update(tmp_path, capsys):
    code, output = train("nan_reward_always", tmp_path / "run", capsys)
    line = error_line(output)
    assert code == 1
    assert "every step of this rollout had a NaN/Inf/None reward or observation (64 steps)" in line, line
    assert "no update had finished, so there is no checkpoint" in line


def test_python_api_raises_env_error(tmp_path):
    from ppokit.config.ppo_config import PPOConfig
    from ppokit.training.trainer import train as train_api

    config = PPOConfig(env_id=f"{PREFIX}-str_obs-v0", num_envs=2, num_steps=16, total_timesteps=64,
                       run_dir=str(tmp_path / "run"))
    with pytest.raises(EnvError, match=r"observation 'hello' \(str\)"):
        train_api(config, console_enabled=False)
    assert issubclass(EnvError, RuntimeError)


class EmptyObs(Hostile):
    observation_space = spaces.Box(-1.0, 1.0, (0,), np.float32)


gym.register(id=f"{PREFIX}-empty_obs-v0", entry_point=EmptyObs, disable_env_checker=True)


def test_observation_space_without_elements_is_refused(tmp_path, capsys):
    code, output = train("empty_obs", tmp_path / "run", capsys)
    assert code == 2
    assert "Traceback" not in output
    assert "it has no elements" in " ".join(output.split())


@pytest.mark.filterwarnings("ignore::UserWarning")  # gymnasium logs each worker's error as a warning
def test_async_workers_failure_is_one_line_too(tmp_path, capsys):
    # Subprocess workers: the error comes back through a pipe, so neither the index (both workers fail) nor the
    # value can be probed; the line still names the env, the phase and the step.
    code, output = train("str_obs", tmp_path / "run", capsys, "--vector-mode", "async")
    line = error_line(output)
    assert code == 1
    assert f"env '{PREFIX}-str_obs-v0' failed in reset() at global step 0: raised ValueError: could not convert " \
           "string to float: 'hello'" in line, line


def test_env_raising_while_the_planner_probes_it_is_one_line(tmp_path, capsys):
    # A bare --env (no preset or file) plans the config first, which steps the env: that probe fails cleanly too.
    Hostile.created = 0
    code = main(["train", "--env", f"{PREFIX}-raise_reset-v0", "--total-timesteps", "640", "--quiet",
                 "--run-dir", str(tmp_path / "run")])
    line = error_line(capsys.readouterr().err)
    assert code == 1
    assert f"env '{PREFIX}-raise_reset-v0'" in line and "planner probe" in line and "reset exploded" in line, line


def test_env_whose_constructor_raises_is_one_line(tmp_path, capsys):
    code, output = train("RaisingConstructor", tmp_path / "run", capsys)
    line = error_line(output)
    assert code == 1
    assert "failed in make()" in line and "RuntimeError: constructor exploded" in line, line


def test_env_whose_close_raises_costs_a_warning_not_the_run(tmp_path, capsys):
    code, output = train("RaisingClose", tmp_path / "run", capsys)
    assert code == 0, output
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if "close exploded" in line]
    assert lines == [f"warning: env '{PREFIX}-RaisingClose-v0' failed in close() at global step 640: raised "
                     "RuntimeError: close exploded"], output
    assert (tmp_path / "run" / "checkpoint.pt").exists() and (tmp_path / "run" / "curves.png").exists()


def test_eval_of_an_env_whose_close_raises_is_one_line_naming_the_env(tmp_path, capsys):
    assert train("RaisingClose", tmp_path / "run", capsys)[0] == 0
    code = main(["eval", str(tmp_path / "run"), "--episodes", "2"])
    output = capsys.readouterr()
    assert code == 0, output
    assert "Traceback" not in output.out + output.err
    assert output.err.splitlines() == [f"warning: env '{PREFIX}-RaisingClose-v0' failed in close() at global step "
                                       "40: raised RuntimeError: close exploded"], output.err
    assert "mean return 20.00" in output.out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_async_worker_whose_close_raises_is_one_line_naming_the_env(tmp_path, capfd):
    # The workers close their envs in their own processes: each says so in one line, no worker traceback.
    Hostile.created = 0
    code = main(["train", "--preset", "cartpole", "--env", f"{PREFIX}-RaisingCloseAfterStep-v0", "--total-timesteps",
                 "128", "--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "1",
                 "--quiet", "--run-dir", str(tmp_path / "run"), "--vector-mode", "async"])
    output = capfd.readouterr()
    output = output.out + output.err
    assert code == 0, output
    assert "Traceback" not in output, output
    lines = sorted(line for line in output.splitlines() if "close exploded" in line)
    assert lines == [f"warning: env '{PREFIX}-RaisingCloseAfterStep-v0' (env index {i}) failed in close(): raised "
                     "RuntimeError: close exploded" for i in (0, 1)], output


def test_env_whose_close_hangs_is_one_line_and_does_not_block(tmp_path, capsys):
    start = time.monotonic()
    code, output = train("HangingClose", tmp_path / "run", capsys, "--env-timeout", "1")
    assert code == 0, output
    assert time.monotonic() - start < 40  # the hang lasts 60 s
    lines = [line for line in output.splitlines() if "close()" in line]
    assert lines == [f"warning: env '{PREFIX}-HangingClose-v0' failed in close() at global step 640: did not "
                     "return within 1 s (env_timeout, --env-timeout)"], output
    assert (tmp_path / "run" / "checkpoint.pt").exists()


# ----------------------------------------------------------------------------------- envs that do not return
# hang_step_swallowing: an env whose own ``except Exception`` would swallow the interruption. (Async: the trainer
# waits on a pipe, never inside the env's code, so one mode covers it.)
@pytest.mark.parametrize("mode, vector_mode", [("hang_step", "sync"), ("hang_step_swallowing", "sync"),
                                               ("hang_step", "async")])
def test_env_hanging_in_step_ends_the_run_after_the_timeout_and_saves(tmp_path, capsys, mode, vector_mode):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    code, output = train(mode, run_dir, capsys, "--env-timeout", "1", "--vector-mode", vector_mode, "--seed", "100")
    elapsed = time.monotonic() - start
    line = error_line(output)
    assert code == 1, output
    assert elapsed < 40, elapsed  # the env hangs for 60 s
    # Sub-env 1 hangs on its 150th step (update 5), as raise_step raises there: the same line, another reason.
    assert f"env '{PREFIX}-{mode}-v0' (env index 1) failed in step() at global step 298: did not return within " \
           "1 s (env_timeout, --env-timeout)" in line, line
    assert f"saved the learner state of update 4 to {run_dir / 'checkpoint.pt'}" in line, line
    state = load_checkpoint(run_dir / "checkpoint.pt")
    assert state["update"] == 4 and state["global_step"] == 4 * 64 and state["env_state"] is None
    assert read_metrics(run_dir / "metrics.csv")["update"] == [1.0, 2.0, 3.0, 4.0]


def test_env_hanging_in_reset_names_reset(tmp_path, capsys):
    code, output = train("hang_reset", tmp_path / "run", capsys, "--env-timeout", "0.5")
    line = error_line(output)
    assert code == 1
    assert f"env '{PREFIX}-hang_reset-v0' (env index 0) failed in reset() at global step 0: did not return " \
           "within 0.5 s (env_timeout, --env-timeout)" in line, line


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_env_timeout_is_validated(tmp_path, capsys, value):
    code, output = train("raise_step", tmp_path / "run", capsys, "--env-timeout", value)
    line = error_line(output)
    assert code == 2 and "env_timeout" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value, expected", [("none", None), ("0", 0.0), ("30", 30.0)])
def test_env_timeout_none_or_zero_disables_it(value, expected):
    from ppokit.config.ppo_config import PPOConfig

    assert PPOConfig.from_dict({"env_timeout": value}).validate().env_timeout == expected
    assert PPOConfig().env_timeout == 120.0


@pytest.mark.parametrize("command", [["plan", "--budget", "1000"], ["train", "--quiet", "--total-timesteps", "640"]])
def test_the_planners_probe_of_an_env_that_hangs_ends_after_the_timeout(tmp_path, capsys, command):
    # `ppokit plan` and a bare `ppokit train --env` probe the env before anything is built: that probe is bounded
    # by --env-timeout as training is, and ends in one line naming the phase.
    Hostile.created = 0
    start = time.monotonic()
    code = main([*command, "--env", f"{PREFIX}-hang_reset-v0", "--env-timeout", "1",
                 *(["--run-dir", str(tmp_path / "run")] if command[0] == "train" else [])])
    elapsed = time.monotonic() - start
    out = capsys.readouterr()
    line = " ".join(error_line(out.out + out.err).split())
    assert code == 1, line
    assert elapsed < 40, elapsed  # the env hangs for 60 s
    assert f"env '{PREFIX}-hang_reset-v0' failed in reset() (planner probe) at global step 0" in line
    assert "did not return within 1 s (env_timeout, --env-timeout)" in line
    assert not (tmp_path / "run").exists()  # nothing was built
