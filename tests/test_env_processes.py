"""Async env workers are the trainer's children and die with it, and a hung env does not make a run unstoppable:
real ``ppokit train --vector-mode async`` runs in a subprocess, their workers found by process id in /proc.

The env (written next to the run) hangs in ``step()`` once it has stepped 40 times and says so in a marker file,
so the tests act on a run whose worker is hung, not on a healthy one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")

ENV_MODULE = textwrap.dedent('''
    import os, sys, time
    import gymnasium as gym
    import numpy as np
    from gymnasium import spaces

    class Hangs(gym.Env):
        observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
        action_space = spaces.Discrete(2)
        metadata = {"render_modes": []}

        def __init__(self):
            self.calls = 0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return np.zeros(3, np.float32), {}

        def step(self, action):
            self.calls += 1
            if self.calls == 40:
                open(os.path.join(os.environ["HANG_MARKER_DIR"], f"hung-{os.getpid()}"), "w").close()
                end = time.monotonic() + 300  # a hang, bounded so that nothing outlives a failed test forever
                while time.monotonic() < end:
                    time.sleep(0.05)
            return np.zeros(3, np.float32), 1.0, False, self.calls % 20 == 0, {}

    gym.register("proc_test/Hangs-v0", entry_point=Hangs, disable_env_checker=True)

    if __name__ == "__main__":
        from ppokit.cli import main
        sys.exit(main(sys.argv[1:]))
''')


def start_run(tmp_path: Path, *extra: str) -> subprocess.Popen:
    script = tmp_path / "hangs.py"
    script.write_text(ENV_MODULE)
    env = dict(os.environ, HANG_MARKER_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(script), "train", "--preset", "cartpole", "--env", "proc_test/Hangs-v0",
                             "--vector-mode", "async", "--num-envs", "2", "--num-steps", "16", "--num-minibatches",
                             "2", "--total-timesteps", "100000", "--quiet", "--run-dir", str(tmp_path / "run"),
                             *extra], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid ...: comm may hold spaces, so split after its closing parenthesis.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie has exited; only its exit status waits to be read)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_for(predicate, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.1)


def hung_workers(tmp_path: Path, proc: subprocess.Popen, vector_mode: str = "async") -> list[int]:
    """The run's worker pids once an env hangs (async: both step in lockstep, so both hang at their 40th step;
    sync: none, the env hangs in the trainer itself)."""
    wait_for(lambda: list(tmp_path.glob("hung-*")) or proc.poll() is not None, 120, "an env hangs")
    assert proc.poll() is None, proc.communicate()
    workers = children(proc.pid)
    hung = {int(p.name.split("-")[1]) for p in tmp_path.glob("hung-*")}
    if vector_mode == "sync":
        assert workers == [] and hung == {proc.pid}, (workers, hung)
    else:
        assert len(workers) == 2 and hung <= set(workers), (workers, hung)
    return workers


def test_workers_die_when_the_trainer_is_killed_with_sigkill(tmp_path):
    proc = start_run(tmp_path, "--env-timeout", "none")
    workers: list[int] = []
    try:
        workers = hung_workers(tmp_path, proc)
        proc.kill()
        proc.wait(timeout=60)
        # PR_SET_PDEATHSIG: the kernel kills each worker when the trainer dies, hung or not.
        wait_for(lambda: not any(alive(pid) for pid in workers), 30, f"workers {workers} exit")
        assert workers and not any(alive(pid) for pid in workers)
    finally:
        stop(proc, workers)


def stop(proc: subprocess.Popen, workers: list[int]) -> None:
    """Leave nothing running when a test fails: the trainer, and its workers (orphans once it is gone)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in workers:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("vector_mode, where", [("async", "env indices 0, 1"), ("sync", "env index 0")])
def test_ctrl_c_ends_a_run_whose_env_hangs(tmp_path, vector_mode, where):
    proc = start_run(tmp_path, "--env-timeout", "none", "--save-every", "1000", "--vector-mode", vector_mode)
    workers: list[int] = []
    try:
        workers = hung_workers(tmp_path, proc, vector_mode)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
        assert proc.returncode == 130, (out, err)
        assert "Traceback" not in out + err, err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        # Step 40 of each env is the 8th of update 3 (16 steps an update): 2 x 16 x 2 + 7 x 2 steps before it.
        assert len(lines) == 1 and f"env 'proc_test/Hangs-v0' ({where}) failed in step() at global step " \
            "78: did not return within 5 s of Ctrl-C; saved the learner state of update 2" in lines[0], err
        assert elapsed < 45, elapsed  # the grace period (5 s), not the hang (300 s)
        wait_for(lambda: not any(alive(pid) for pid in workers), 30, f"workers {workers} exit")
        assert (tmp_path / "run" / "checkpoint.pt").exists()
    finally:
        stop(proc, workers)
