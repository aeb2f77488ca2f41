"""LM runs as durable as the Gymnasium trainer's: a ``ppokit lm`` run killed with kill -9 after a checkpoint
continues with ``--resume`` to the same metrics rows as a run never stopped (each iteration once); Ctrl-C / SIGTERM
save and exit 130 / 143; ``resume()`` logs into the run dir it resumes; a killed write's temp files are removed; a
reward that raises mid-run ends it after saving, and the resumed run is the uninterrupted one again."""

from __future__ import annotations

import copy
import csv
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

from ppokit.lm import GRPOTrainer, LMConfig  # noqa: E402
from ppokit.lm.rewards import RewardError  # noqa: E402
from ppokit.lm.tiny import build_tiny, save_tiny  # noqa: E402
from ppokit.runtime.checkpoint import load_checkpoint  # noqa: E402

BUDGET = ["--batch-prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--num-minibatches", "1",
          "--update-epochs", "1", "--learning-rate", "3e-3", "--no-console", "--no-tensorboard"]
# The reward counts its calls (one per GRPO iteration) in $CALLS; at call $BLOCK_AT it writes "blocked" and sleeps
# $BLOCK_FOR seconds, so a test can signal or kill the run at a known iteration.
REWARD_MODULE = textwrap.dedent("""
    import os, pathlib, time

    def reward(prompts, completions, **info):
        calls = pathlib.Path(os.environ.get("CALLS", "calls.txt"))
        n = int(calls.read_text()) + 1 if calls.exists() else 1
        calls.write_text(str(n))
        if os.environ.get("BLOCK_AT") == str(n):
            pathlib.Path(os.environ.get("CALLS", "calls.txt") + ".blocked").write_text("1")
            end = time.monotonic() + float(os.environ.get("BLOCK_FOR", "600"))
            while time.monotonic() < end:
                time.sleep(0.05)
        return [c.count("a") / 4 for c in completions]
""")
DEADLINE = 240.0  # seconds a CLI run of a few tiny iterations may take under load (it takes ~5 s alone)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(*build_tiny("ab:", seed=0), tmp_path_factory.mktemp("lm_durable") / "model")


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "countreward.py").write_text(REWARD_MODULE)
    (tmp_path / "p.txt").write_text("a:\nb:\nab:\n")
    return tmp_path


@pytest.fixture
def in_process(workdir, monkeypatch, capsys):
    """``ppokit lm ARGS`` run by ``cli.main`` in this process, in ``workdir``, with the env vars given:
    ``(exit code, stdout, stderr)``."""
    from ppokit.cli import main

    monkeypatch.chdir(workdir)

    def run(*args, **env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        rc = main(["lm", *args])
        out = capsys.readouterr()
        return rc, out.out, out.err

    yield run
    sys.modules.pop("countreward", None)


def _cli(workdir, *args, env_extra=None, **popen):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "ppokit", "lm", *args], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _grpo(model_dir, run, *extra):
    return ["grpo", "--model", str(model_dir), "--reward", "countreward:reward", "--prompts", "p.txt",
            "--run-dir", str(run), *BUDGET, *extra]


def _wait_for(path: Path, proc) -> None:
    end = time.monotonic() + DEADLINE
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (rc {proc.returncode}) before {path.name}: {out}{err}")
        assert time.monotonic() < end, f"no {path.name} after {DEADLINE} s"
        time.sleep(0.05)


def _rows(run: Path) -> list[dict[str, str]]:
    """metrics.csv rows without the timing columns (wall-clock, never equal between two runs)."""
    with open(run / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in csv.DictReader(f)]


def test_kill_9_after_a_save_then_resume_gives_the_uninterrupted_runs_rows_once(workdir, model_dir, in_process):
    assert in_process(*_grpo(model_dir, workdir / "whole", "--iterations", "6", "--save-every", "2"),
                      CALLS="whole.calls")[0] == 0
    # The same run as a real process, stopped dead inside iteration 4: iterations 1-3 are logged, the checkpoint
    # holds 2.
    run = workdir / "killed"
    proc = _cli(workdir, *_grpo(model_dir, run, "--iterations", "6", "--save-every", "2"),
                env_extra={"CALLS": "killed.calls", "BLOCK_AT": "4"})
    _wait_for(workdir / "killed.calls.blocked", proc)
    proc.kill()  # SIGKILL: no handler runs, the lock stays behind
    proc.communicate(timeout=DEADLINE)
    assert _updates(run) == [1, 2, 3]
    assert load_checkpoint(run / "trainer_state.pt")["iteration"] == 2
    (run / ".trainer_state.pt.deadbeef.tmp").write_bytes(b"half a checkpoint")  # a write the kill cut short
    (run / ".policy.deadbeef.tmp").mkdir()
    rc, out, err = in_process("grpo", "--resume", str(run), "--reward", "countreward:reward", CALLS="resumed.calls")
    assert rc == 0, out + err
    assert "Traceback" not in err
    assert "6 iterations" in out
    assert _rows(run) == _rows(workdir / "whole")  # every column of every iteration, each once
    assert load_checkpoint(run / "trainer_state.pt")["iteration"] == 6
    assert not list(run.glob(".*.tmp")) and not (run / ".lock").exists()
    assert (run / "policy" / "config.json").is_file()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_finishes_the_iteration_saves_and_exits_128_plus_it(workdir, model_dir, sig, code):
    run = workdir / "run"
    proc = _cli(workdir, *_grpo(model_dir, run, "--iterations", "50", "--save-every", "25"),
                env_extra={"BLOCK_AT": "3", "BLOCK_FOR": "1"})
    _wait_for(workdir / "calls.txt.blocked", proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == code, out + err
    assert "Traceback" not in out + err
    saved = load_checkpoint(run / "trainer_state.pt")["iteration"]
    assert 3 <= saved < 50  # the iteration the signal landed in was finished, then saved (save_every alone: 25)
    assert f"stopped by {sig.name} after iteration {saved}" in out
    assert f"--resume {run}" in out
    assert _updates(run) == list(range(1, saved + 1))
    assert not (run / ".lock").exists()


def test_resume_refuses_config_flags_and_needs_the_reward_again(workdir, model_dir, in_process):
    run = workdir / "run"
    assert in_process(*_grpo(model_dir, run, "--iterations", "1"))[0] == 0
    for args, needle in [(["--resume", str(run)], "--reward: give the reward function again"),
                         (["--resume", str(run), "--reward", "countreward:reward", "--kl-coef", "0.1"],
                          "--kl-coef: --resume continues the run with its saved config"),
                         (["--resume", str(workdir / "nothing"), "--reward", "countreward:reward"],
                          "no LM checkpoint there")]:
        rc, out, err = in_process("grpo", *args)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and needle in lines[0], err
    rc, out, err = in_process("grpo", "--resume", str(run), "--reward", "countreward:reward")
    assert rc == 0 and "already at iteration 1 of 1" in out, out + err


def _updates(run: Path) -> list[int]:
    return [int(float(r["update"])) for r in _rows(run)]


# ---------------------------------------------------------------- the API
PROMPTS = ["X:", "AB:"]
CFG = dict(learning_rate=3e-3, batch_prompts=2, group_size=2, max_new_tokens=4, update_epochs=1, num_minibatches=1,
           tensorboard=False, console=False)


def x_reward(prompts, completions):
    return [c.count("X") / max(len(c), 4) for c in completions]


@pytest.fixture(scope="module")
def base():
    return build_tiny("ABX:", pad_is_eos=True, seed=0)


def _trainer(base, run_dir, reward=x_reward, **cfg):
    return GRPOTrainer(copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS,
                       config=LMConfig(**{**CFG, **cfg}), run_dir=run_dir)


def _resume(base, run_dir, reward=x_reward):
    return GRPOTrainer.resume(run_dir, copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS)


def test_api_resume_without_run_dir_logs_and_saves_into_the_dir_it_resumes(base, tmp_path):
    run = tmp_path / "run"
    t = _trainer(base, run, save_every=2)
    t.train(3)  # saves at 2 and at the end (3)
    t.close()
    assert load_checkpoint(run / "trainer_state.pt")["iteration"] == 3
    (run / ".trainer_state.pt.0123.tmp").write_bytes(b"")  # left by a kill during a save
    r = _resume(base, run)
    r.train(2)
    r.close()
    assert _updates(run) == [1, 2, 3, 4, 5]
    assert load_checkpoint(run / "trainer_state.pt")["iteration"] == 5
    assert not list(run.glob(".*.tmp"))


def test_a_reward_raising_mid_run_saves_the_last_iteration_and_the_resume_is_the_uninterrupted_run(base, tmp_path):
    whole = _trainer(base, tmp_path / "whole", save_every=10)
    whole.train(4)
    whole.close()
    calls = []

    def flaky(prompts, completions):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("score table")
        return x_reward(prompts, completions)

    run = tmp_path / "run"
    t = _trainer(base, run, reward=flaky, save_every=10)
    with pytest.raises(RewardError) as info:
        t.train(4)
    t.close()
    message = str(info.value)
    assert "reward test_lm_durable.test_a_reward_raising_mid_run" in message and "flaky raised KeyError" in message
    assert "score table" in message and f"saved iteration 2 to {run / 'trainer_state.pt'}" in message
    assert "\n" not in message
    assert load_checkpoint(run / "trainer_state.pt")["iteration"] == 2
    r = _resume(base, run)  # the reward fixed
    r.train(2)
    r.close()
    assert _rows(run) == _rows(tmp_path / "whole")


# The reward breaks TensorBoard's event file on its 3rd call (iteration 3): /dev/full fails every write with ENOSPC
# (TensorBoard reopens the file for each record). Run in a subprocess: pytest replaces threading.excepthook, which
# would hide the writer thread's traceback that must not be printed.
FULL_DISK_REWARD = textwrap.dedent("""
    import os, pathlib

    calls = []

    def reward(prompts, completions, **info):
        calls.append(1)
        if len(calls) == 3:
            (event_file,) = pathlib.Path("run", "tb").glob("events.out.tfevents.*")
            # Swapped in by one rename: TensorBoard's writer thread reopens the file for each record, and would
            # recreate it between an unlink and a symlink.
            link = event_file.with_name("full.link")
            link.symlink_to("/dev/full")
            os.replace(link, event_file)
        return [c.count("a") / 4 for c in completions]
""")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_under_tensorboard_ends_an_lm_run_in_one_line_after_saving(workdir, model_dir):
    (workdir / "fullreward.py").write_text(FULL_DISK_REWARD)
    args = _grpo(model_dir, workdir / "run", "--iterations", "6")
    args[args.index("countreward:reward")] = "fullreward:reward"
    args.remove("--no-tensorboard")
    proc = _cli(workdir, *args)
    out, err = proc.communicate(timeout=DEADLINE)
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert proc.returncode == 1, lines
    assert len(lines) == 1 and "Traceback" not in lines[0] and "Exception in thread" not in lines[0], lines
    assert lines[0].startswith("error: TensorBoard could not write its event file in ") and "ENOSPC" in lines[0]
    saved = load_checkpoint(workdir / "run" / "trainer_state.pt")["iteration"]
    assert saved >= 3 and f"saved iteration {saved} to {workdir / 'run' / 'trainer_state.pt'}" in lines[0]
    # Every finished iteration's row is in metrics.csv once, up to the one saved: a resume continues from there.
    assert _updates(workdir / "run")[:saved] == list(range(1, saved + 1))
