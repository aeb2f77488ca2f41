"""Run directories: a lock against a second process, no fresh run over an old one, each update logged once across
kill -9 and resume, a Ctrl-C handler that only sets a flag, ``runs/latest``, hyperparameters in TensorBoard."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ppokit.cli import main
from ppokit.config.ppo_config import PPOConfig, load_preset
from ppokit.runtime import rundir
from ppokit.runtime.checkpoint import load_checkpoint
from ppokit.runtime.rundir import LOCK_NAME, RunDirError
from ppokit.training.trainer import Trainer, _install_sigint, resume, train

torch.set_num_threads(1)

BATCH = 2 * 16  # num_envs x num_steps of every run here
TINY = ["--preset", "cartpole", "--num-envs", "2", "--num-steps", "16", "--update-epochs", "1", "--torch-threads",
        "1", "--quiet", "--no-tensorboard"]


def tiny_config(run_dir, updates: int = 3, **kw) -> PPOConfig:
    cfg = load_preset("cartpole")
    over = dict(num_envs=2, num_steps=16, update_epochs=1, total_timesteps=updates * BATCH, tensorboard=False,
                torch_threads=1, run_dir=None if run_dir is None else str(run_dir))
    return PPOConfig.from_dict({**over, **kw}, cfg)


def updates_logged(run_dir: Path) -> list[int]:
    """The ``update`` column of metrics.csv, tolerating a half-written last row of a live or killed run."""
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        return []
    out = []
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return []
    col = rows[0].index("update")
    for row in rows[1:]:
        if len(row) == len(rows[0]):
            out.append(int(float(row[col])))
    return out


def alert_names(run_dir: Path) -> list[str]:
    path = Path(run_dir) / "alerts.jsonl"
    return [json.loads(line)["name"] for line in path.read_text().splitlines()] if path.is_file() else []


def start_train(run_dir: Path, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.Popen([sys.executable, "-m", "ppokit.cli", "train", *TINY, "--run-dir", str(run_dir), *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"train exited early with {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the training subprocess")
        time.sleep(0.02)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def write_lock(run_dir: Path, pid: int, host: str | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                                 "started": time.time(), "token": "old"}))


# ------------------------------------------------------------------ item 2: one process per run dir
def test_second_train_on_a_live_run_dir_is_refused_and_ctrl_c_exits_130_with_a_checkpoint(tmp_path, capsys):
    d = tmp_path / "run"
    proc = start_train(d, "--total-timesteps", "100000000", "--save-every", "2")
    try:
        wait_for(lambda: (d / "checkpoint.pt").is_file() and len(updates_logged(d)) >= 3, proc)
        # A second fresh run and a --resume on the live run dir are both refused, naming the owner's pid.
        assert main(["train", *TINY, "--total-timesteps", "64", "--run-dir", str(d)]) == 2
        assert main(["train", "--resume", str(d), "--total-timesteps", "64", "--quiet"]) == 2
        err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
        assert err.count(f"pid {proc.pid}") == 2 and "in use" in err and "Traceback" not in err
        assert json.loads((d / LOCK_NAME).read_text())["pid"] == proc.pid
        # Ctrl-C: the loop finishes the update, logs the alert, saves and the CLI exits 130.
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    logged = updates_logged(d)
    assert logged == list(range(1, len(logged) + 1))  # nothing from the refused runs mixed in, nothing twice
    assert load_checkpoint(d / "checkpoint.pt")["update"] == logged[-1]
    assert alert_names(d).count("interrupted") == 1
    assert not (d / LOCK_NAME).exists()


def test_fresh_run_over_a_finished_run_is_refused_and_overwrite_starts_clean(tmp_path, capsys):
    d = tmp_path / "run"
    assert main(["train", *TINY, "--total-timesteps", str(3 * BATCH), "--run-dir", str(d)]) == 0
    (d / "notes.txt").write_text("mine")
    (d / "alerts.jsonl").write_text(json.dumps({"step": 1, "name": "old_run_alert"}) + "\n")
    before = (d / "metrics.csv").read_bytes()
    capsys.readouterr()

    assert main(["train", *TINY, "--total-timesteps", str(2 * BATCH), "--run-dir", str(d)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "already holds a run" in err and "--overwrite" in err and "--resume" in err and "Traceback" not in err
    assert (d / "metrics.csv").read_bytes() == before  # untouched: not appended to, not replaced
    with pytest.raises(RunDirError, match="already holds a run"):
        train(tiny_config(d, updates=2), console_enabled=False)
    assert main(["train", "--resume", str(d), "--overwrite", "--quiet"]) == 2
    assert not (d / LOCK_NAME).exists()

    assert main(["train", *TINY, "--total-timesteps", str(2 * BATCH), "--run-dir", str(d), "--overwrite"]) == 0
    assert updates_logged(d) == [1, 2]
    assert "old_run_alert" not in alert_names(d)
    assert (d / "notes.txt").read_text() == "mine"  # only the old run's own files are removed
    run = train(tiny_config(d, updates=1), console_enabled=False, overwrite=True)
    assert updates_logged(run.run_dir) == [1] and not (d / LOCK_NAME).exists()


def test_a_stale_lock_is_taken_over_and_a_live_one_refused(tmp_path):
    d = tmp_path / "run"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(d, sleeper.pid)
        with pytest.raises(RunDirError, match=f"pid {sleeper.pid}"):
            Trainer(tiny_config(d), console_enabled=False)
        assert json.loads((d / LOCK_NAME).read_text())["pid"] == sleeper.pid  # the live owner's lock stays
    finally:
        sleeper.kill()
        sleeper.wait()
    # Now that pid is dead: the lock is stale and taken over with a note, then released at the end.
    trainer = Trainer(tiny_config(d), console_enabled=False)
    assert any("stale lock" in n and f"pid {sleeper.pid}" in n for n in trainer.notes)
    assert json.loads((d / LOCK_NAME).read_text())["pid"] == os.getpid()
    trainer.run()
    assert not (d / LOCK_NAME).exists()


def test_lock_owner_checks(tmp_path):
    # Another host's lock cannot be checked: refused, naming host and pid.
    write_lock(tmp_path / "a", 4242, host="some-other-host")
    with pytest.raises(RunDirError, match="pid 4242 on host some-other-host"):
        rundir.acquire_lock(tmp_path / "a")
    # Our own pid in a lock this process does not hold: the pid was reused (a restarted container), stale.
    write_lock(tmp_path / "b", os.getpid())
    lock, note = rundir.acquire_lock(tmp_path / "b")
    assert "stale lock" in note
    # ...while a lock this process holds is live: a second trainer in this process is refused.
    with pytest.raises(RunDirError, match=f"pid {os.getpid()}"):
        rundir.acquire_lock(tmp_path / "b")
    lock.release()
    assert not (tmp_path / "b" / LOCK_NAME).exists()
    # An unreadable lock (its writer died between creating and writing it) is taken over.
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / LOCK_NAME).write_text("")
    lock, note = rundir.acquire_lock(tmp_path / "c")
    assert "unreadable" in note
    lock.release()


# ------------------------------------------------------------------ item 3: each update logged exactly once
def test_kill_9_then_resume_logs_each_update_once_and_removes_temp_files(tmp_path):
    d = tmp_path / "run"
    proc = start_train(d, "--total-timesteps", "100000000", "--save-every", "2")
    deadline = time.monotonic() + 60
    try:
        # Freeze the run when metrics.csv holds a row past the checkpoint's update, then kill -9 it there.
        while True:
            wait_for(lambda: (d / "checkpoint.pt").is_file() and updates_logged(d), proc)
            os.kill(proc.pid, signal.SIGSTOP)
            saved = load_checkpoint(d / "checkpoint.pt")["update"]
            if max(updates_logged(d)) > saved:
                break
            os.kill(proc.pid, signal.SIGCONT)
            assert time.monotonic() < deadline, "never caught a row logged after the checkpoint"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    logged = updates_logged(d)
    assert max(logged) > saved  # the duplicates-to-be exist
    (d / ".checkpoint.pt.killedmidwrite.tmp").write_bytes(b"half a checkpoint")  # what a kill in save leaves
    assert (d / LOCK_NAME).exists()  # the dead run's lock: stale

    total = (saved + 3) * BATCH
    assert main(["train", "--resume", str(d), "--total-timesteps", str(total), "--quiet"]) == 0
    assert updates_logged(d) == list(range(1, saved + 4))
    with open(d / "metrics.csv", newline="") as f:
        steps = [int(row["global_step"]) for row in csv.DictReader(f)]
    assert steps == [BATCH * u for u in range(1, saved + 4)]
    assert not list(d.glob(".checkpoint.pt.*.tmp")) and not (d / LOCK_NAME).exists()


def test_crash_before_a_save_then_resume_drops_later_rows_alerts_and_tensorboard_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d = tmp_path / "run"
    trainer = Trainer(tiny_config(d, updates=6, save_every=2, tensorboard=True), console_enabled=False)
    trainer.monitor.check = lambda update, metrics: [SimpleNamespace(level="warn", name="probe",
                                                                     message=f"update {update}", data=None)]
    real_save = trainer.save

    def save_then_crash_at_4():
        if trainer.update_idx == 4:
            raise RuntimeError("simulated crash")
        return real_save()

    trainer.save = save_then_crash_at_4
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.run()
    assert updates_logged(d) == [1, 2, 3, 4]  # updates 3 and 4 are logged, the checkpoint holds update 2
    assert not (d / LOCK_NAME).exists()  # released on the exception

    resume(d, console_enabled=False)
    assert updates_logged(d) == [1, 2, 3, 4, 5, 6]
    probes = [json.loads(line)["message"] for line in (d / "alerts.jsonl").read_text().splitlines()]
    assert probes == ["update 1", "update 2"]  # the crashed run's alerts after the checkpoint are gone
    events = EventAccumulator(str(d / "tb"), purge_orphaned_data=True)
    events.Reload()
    assert [e.step for e in events.Scalars("charts/learning_rate")] == [BATCH * u for u in range(1, 7)]


# ------------------------------------------------------------------ item 4: the Ctrl-C handler only sets a flag
def test_sigint_handler_sets_a_flag_and_touches_nothing_else():
    class Tripwire:
        """A logger that records any use; the handler must not use it (its lock may be held by the loop)."""

        def __init__(self):
            self.used = []

        def __getattr__(self, name):
            self.used.append(name)
            raise AssertionError(f"the signal handler used logger.{name}")

    trainer = SimpleNamespace(_stop_requested=False, logger=Tripwire(), global_step=0)
    old = _install_sigint(trainer)
    try:
        handler = signal.getsignal(signal.SIGINT)
        t0 = time.perf_counter()
        handler(signal.SIGINT, None)
        assert time.perf_counter() - t0 < 0.01
        assert trainer._stop_requested and trainer.logger.used == []
        with pytest.raises(KeyboardInterrupt):  # the second Ctrl-C aborts
            handler(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, old)


def test_an_abort_inside_a_checkpoint_write_keeps_the_last_checkpoint_and_exits_130(tmp_path, capsys, monkeypatch):
    real_save, calls = torch.save, []

    def save_aborted_on_third(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            f.write(b"PK\x03\x04 half a checkpoint")
            raise KeyboardInterrupt  # the second Ctrl-C, landing inside the write
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_aborted_on_third)
    d = tmp_path / "run"
    try:
        rc = main(["train", *TINY, "--total-timesteps", str(5 * BATCH), "--save-every", "1", "--run-dir", str(d)])
    except KeyboardInterrupt:
        rc = "KeyboardInterrupt escaped (a traceback for the user)"
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert rc == 130 and "aborted" in err and "Traceback" not in err
    assert load_checkpoint(d / "checkpoint.pt")["update"] == 2
    assert not list(d.glob(".checkpoint.pt.*.tmp")) and not (d / LOCK_NAME).exists()


# ------------------------------------------------------------------ item 19: runs/latest, hparams
def test_runs_latest_is_a_relative_link_to_the_newest_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = train(tiny_config(None, updates=1), console_enabled=False)
    latest = tmp_path / "runs" / "latest"
    assert latest.is_symlink() and os.readlink(latest) == first.run_dir.name
    second = train(tiny_config(None, updates=1), console_enabled=False)
    assert second.run_dir != first.run_dir and os.readlink(latest) == second.run_dir.name
    assert (latest / "checkpoint.pt").is_file()
    # Resuming through the link keeps it pointing at the run, not at itself; no temp links are left.
    resume(latest, total_timesteps=2 * BATCH, console_enabled=False)
    assert os.readlink(latest) == second.run_dir.name
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(["latest", first.run_dir.name,
                                                                           second.run_dir.name])
    # A run dir outside runs/ gets no link beside it.
    train(tiny_config(tmp_path / "elsewhere" / "r", updates=1), console_enabled=False)
    assert not (tmp_path / "elsewhere" / "latest").exists()


def test_hyperparameters_are_written_to_tensorboard_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d = tmp_path / "run"
    train(tiny_config(d, updates=1, tensorboard=True, learning_rate=0.00123), console_enabled=False)
    resume(d, total_timesteps=2 * BATCH, console_enabled=False)
    events = EventAccumulator(str(d / "tb"))
    events.Reload()
    texts = events.Tensors("hparams/text_summary")
    assert len(texts) == 1 and texts[0].step == 0  # once per run, not again on resume
    table = texts[0].tensor_proto.string_val[0].decode()
    assert "| learning_rate | 0.00123 |" in table and "| env_id | CartPole-v1 |" in table
    assert set(events.PluginTagToContent("hparams")) >= {"_hparams_/experiment", "_hparams_/session_start_info"}


def test_default_run_dir_names_have_no_colon_or_slash():
    from ppokit.config.ppo_config import PPOConfig
    from ppokit.training.trainer import default_run_dir

    for env_id in ("mymod:MyEnv-v0", "custom:MyEnv", "ALE/Pong-v5"):
        name = default_run_dir(PPOConfig(env_id=env_id)).name
        assert ":" not in name and "/" not in name, name
        assert name.startswith(env_id.replace(":", "-").replace("/", "-") + "__ppo__s1__"), name


@pytest.mark.parametrize("name", ["policy", "reward_model"])
def test_claim_puts_back_a_model_directory_a_killed_swap_left_aside(tmp_path, name):
    from ppokit.runtime.rundir import MODEL_DIRS, claim, model_swap_paths

    assert name in MODEL_DIRS
    run = tmp_path / "run"
    run.mkdir()
    new, aside, final = model_swap_paths(run, "feed", name)
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    new.mkdir()  # the half-written fresh copy
    c = claim(run, resume=True)
    c.release()
    assert (final / "config.json").read_text() == "{}" and not aside.exists() and not new.exists()
    assert any("back in place" in n for n in c.notes)
