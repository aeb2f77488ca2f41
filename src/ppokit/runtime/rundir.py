"""Run directories: one owner at a time, no fresh run over an old one, and a resume that logs each update once.

``claim(run_dir, resume=..., overwrite=...)`` is what the trainer calls before it writes anything:

1. **Lock.** ``<run_dir>/.lock`` is created with ``O_CREAT | O_EXCL`` (atomic on every local filesystem) and
   holds the owner's pid, host and start time. A second process finds it and is refused, naming the owner. A lock
   whose pid is no longer alive on this host (killed with ``kill -9``, a crashed machine's container) is stale: it is
   moved aside and taken over, with a note. A lock from another host cannot be checked and is refused.
2. **No mixing.** A fresh run in a directory that already holds a run (``config.toml``, ``metrics.csv`` or
   ``checkpoint.pt``) is refused unless ``overwrite`` (which first removes the old run's files, and only those).
3. **Crash leftovers.** Temp files of a checkpoint write that was killed midway are removed.

``trim_to_checkpoint`` then drops what a killed run logged after its last checkpoint (``metrics.csv`` rows and
``alerts.jsonl`` records), so the resumed run writes each update exactly once. ``update_latest_link`` points
``runs/latest`` at the newest run of the default layout.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LOCK_NAME", "RUN_FILES", "BEST_NAME", "best_checkpoint", "RunDirError", "RunLock", "Claim", "acquire_lock", "claim",
           "trim_to_checkpoint", "update_latest_link"]

LOCK_NAME = ".lock"
# A directory holding any of these holds a run; starting a fresh one there would mix the two.
RUN_FILES = ("config.toml", "metrics.csv", "checkpoint.pt")
# The checkpoint of the best deterministic evaluation so far (the evaluation gate, eval_every), as SB3's EvalCallback
# keeps best_model.zip.
BEST_NAME = "best.pt"
# Everything a run writes into its directory: what --overwrite removes. Other files (the user's) are kept.
COMPLETIONS_FILE = "completions.jsonl"  # an LM run's sample completions (ppokit.lm.samples)
# lm_run.json, trainer_state.pt, value_model.safetensors and policy/: what the language-model trainers write.
_OUTPUT_FILES = (*RUN_FILES, BEST_NAME, "alerts.jsonl", "curves.png", "UNSAFE", "report.html", "DONE", "lm_run.json",
                 "trainer_state.pt", "value_model.safetensors", COMPLETIONS_FILE)
POLICY_DIR = "policy"  # an LM run's save_pretrained directory of its policy
REWARD_MODEL_DIR = "reward_model"  # ... and of the reward model `ppokit lm rm` trains
MODEL_DIRS = (POLICY_DIR, REWARD_MODEL_DIR)  # saved by a swap (model_swap_paths), recovered by claim()
# A sharded (fsdp) LM run's checkpoint directories, shards-<iteration>-<token> (lm.sharded_checkpoint); trainer_state.pt
# names the current one.
SHARDS_PREFIX = "shards-"
# videos: --capture-video; wandb: --track
_OUTPUT_DIRS = ("tb", "videos", "wandb", *MODEL_DIRS)
_OUTPUT_DIR_GLOBS = (f"{SHARDS_PREFIX}*",)
# Temp files of a killed checkpoint write: the Gymnasium trainer's, the LM trainers' (and their model directories,
# and a sharded run's shards directory).
_TMP_CHECKPOINT_GLOBS = (".checkpoint.pt.*.tmp", ".best.pt.*.tmp", ".trainer_state.pt.*.tmp",
                         *(f".{name}.*.tmp" for name in MODEL_DIRS), f".{SHARDS_PREFIX}*.tmp")


def model_swap_paths(run_dir: Path, token: str, name: str = POLICY_DIR) -> tuple[Path, Path, Path]:
    """``(new, aside, final)``: where an LM save writes the fresh model directory ``name`` (``new``), where the
    previous one waits while the new one is renamed in (``aside``), and ``run_dir/name`` itself. Both temp names
    match ``_TMP_CHECKPOINT_GLOBS``; ``claim`` puts an ``aside`` back when a kill came between the two renames."""
    return run_dir / f".{name}.{token}.tmp", run_dir / f".{name}.{token}.old.tmp", run_dir / name


# Tokens of the locks this process holds: the same pid in a lock is a live owner only if it is one of these.
_HELD: set[str] = set()


class RunDirError(ValueError):
    """The run dir cannot be used: locked by a live run, holding another run, or not a directory."""


def best_checkpoint(run_dir: str | os.PathLike) -> Path:
    """``run_dir/best.pt``; RunDirError saying how a run gets one when it has none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"--best needs a run directory, got {run_dir} (not a directory)")
    path = run_dir / BEST_NAME
    if not path.is_file():
        raise RunDirError(f"{run_dir} has no {BEST_NAME}: the evaluation gate keeps it (train with --eval-every N "
                          "--eval-threshold R)")
    return path


@dataclass
class RunLock:
    """A held ``.lock``; ``release()`` removes it if it is still ours (idempotent)."""

    path: Path
    token: str
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        _HELD.discard(self.token)
        owner = _read_lock(self.path)
        if owner is not None and owner.get("token") == self.token:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


@dataclass
class Claim:
    """A claimed run dir: the held lock plus notes worth telling the user (a stale lock taken over...)."""

    run_dir: Path
    lock: RunLock
    notes: list[str] = field(default_factory=list)

    def release(self) -> None:
        self.lock.release()


def _read_lock(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _proc_stat(pid: int) -> tuple[str, float] | None:
    """(state letter, start time in seconds since the epoch) from Linux's /proc, or None where there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        btime = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        # The command name (field 2) may hold spaces and parentheses; the fields after its last ')' are fixed.
        rest = stat[stat.rindex(")") + 2:].split()
        return rest[0], btime + int(rest[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _owner_alive(owner: dict) -> bool:
    """Whether the lock's owner still runs. Unknowable for another host or on Windows: then it counts as alive."""
    if owner.get("host") != socket.gethostname() or os.name != "posix":
        return True
    pid = owner.get("pid")
    if type(pid) is not int or pid <= 0:
        return False
    if pid == os.getpid():
        # Our own pid: a live owner only if this process holds the lock (another trainer here); otherwise the
        # pid was reused, e.g. by a restarted container whose processes count from 1 again.
        return owner.get("token") in _HELD
    try:
        os.kill(pid, 0)  # signal 0 checks existence and sends nothing
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    stat = _proc_stat(pid)
    if stat is not None:
        state, started = stat
        if state in ("Z", "X"):
            return False  # a zombie: dead, only not reaped yet
        lock_time = owner.get("started")
        if isinstance(lock_time, (int, float)) and started > lock_time + 2.0:
            return False  # this pid belongs to a process started after the lock was written: reused
    return True


def _describe(owner: dict) -> str:
    started = owner.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {owner.get('pid')} on host {owner.get('host')}, started {when}"


def acquire_lock(run_dir: str | os.PathLike) -> tuple[RunLock, str | None]:
    """Take ``run_dir/.lock``; returns the lock and a note when a stale lock was taken over.

    Raises ``RunDirError`` naming the owner when a live process holds it.
    """
    path = Path(run_dir) / LOCK_NAME
    note = None
    for _ in range(5):
        token = uuid.uuid4().hex
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "token": token}
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = _read_lock(path)
            for _wait in range(10):
                if owner is not None:
                    break
                # Empty or half-written: perhaps a lock being written right now; give its writer a moment.
                time.sleep(0.05)
                owner = _read_lock(path)
            if owner is not None and _owner_alive(owner):
                raise RunDirError(
                    f"run dir {path.parent} is in use by another training process ({_describe(owner)}); "
                    f"wait for it to finish or stop it, or use another --run-dir. If no process is using it, "
                    f"delete {path}")
            note = _take_over(path, owner)
            continue
        try:
            # One write, so a reader sees all of the record or none (no fsync: a lock that a crash loses is
            # one that would have been stale anyway).
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
        _HELD.add(token)
        return RunLock(path, token), note
    raise RunDirError(f"could not lock {path}: other processes keep taking it; try again")


def _take_over(path: Path, owner: dict | None) -> str:
    """Move a stale lock aside. Renaming (rather than deleting) it means that of two processes finding the same
    stale lock, the second renames the first's fresh lock, sees a token it did not judge stale, and puts it back."""
    aside = path.with_name(f"{LOCK_NAME}.stale.{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return "a stale lock was removed by another process"
    moved = _read_lock(aside)
    if owner is not None and moved is not None and moved.get("token") != owner.get("token"):
        try:
            os.link(aside, path)  # fails if yet another lock appeared meanwhile; that one then stands
        except OSError:
            pass
    aside.unlink(missing_ok=True)
    if owner is None:
        return f"took over an unreadable lock file {path}"
    return f"took over the stale lock of {_describe(owner)}: that process no longer runs"


def _make_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirError(f"run_dir {run_dir} exists and is not a directory; choose a directory path") from None
    except OSError as exc:
        raise RunDirError(f"run_dir {run_dir} cannot be created: {exc.strerror or exc}") from None
    if not run_dir.is_dir():
        raise RunDirError(f"run_dir {run_dir} is not a directory; choose a directory path")


def _clear_outputs(run_dir: Path) -> list[str]:
    removed = []
    for name in _OUTPUT_FILES:
        p = run_dir / name
        if p.is_file() or p.is_symlink():
            p.unlink()
            removed.append(name)
    for p in [run_dir / name for name in _OUTPUT_DIRS] + sorted(q for g in _OUTPUT_DIR_GLOBS for q in run_dir.glob(g)):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
            removed.append(p.name + "/")
    return removed


def claim(run_dir: str | os.PathLike, resume: bool = False, overwrite: bool = False) -> Claim:
    """Create and lock ``run_dir`` for one run; see the module docstring for what is refused and cleaned up."""
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise RunDirError("overwrite and resume exclude each other: a resume continues the run that overwrite "
                          "would delete")
    _make_dir(run_dir)
    try:
        lock, note = acquire_lock(run_dir)
    except OSError as exc:  # read-only filesystem, no permission
        raise RunDirError(f"run_dir {run_dir} is not writable: {exc.strerror or exc}") from None
    notes = [note] if note else []
    try:
        existing = [name for name in RUN_FILES if (run_dir / name).exists()]
        if existing and not resume:
            if not overwrite:
                raise RunDirError(
                    f"run dir {run_dir} already holds a run ({', '.join(existing)}); continue it with "
                    f"`ppokit train --resume {run_dir}` (ppokit.resume), choose another --run-dir, or replace it "
                    f"with --overwrite (overwrite=True in Python)")
            notes.append(f"--overwrite: removed the previous run's {', '.join(_clear_outputs(run_dir))} "
                         f"from {run_dir}")
        # A kill between the two renames of an LM save left the previous policy/ aside and none in place. The
        # checkpoint is written after the swap, so that previous policy/ is the one it belongs to: it goes back.
        for name in MODEL_DIRS if not overwrite else ():
            final = run_dir / name
            asides = [] if final.exists() else sorted(run_dir.glob(f".{name}.*.old.tmp"))
            for aside in asides:
                if aside.is_dir() and not aside.is_symlink():
                    os.rename(aside, final)
                    notes.append(f"a save was killed while it replaced {final}: the previous one, which the "
                                 "checkpoint belongs to, is back in place")
                    break
        # A checkpoint write killed midway leaves its temp file; nothing else writes here while we hold the lock.
        for tmp in (t for pattern in _TMP_CHECKPOINT_GLOBS for t in run_dir.glob(pattern)):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
    except BaseException:
        lock.release()
        raise
    return Claim(run_dir, lock, notes)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _trim_metrics(path: Path, update: int, global_step: int) -> int:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if not rows:
        return 0
    header, body = rows[0], rows[1:]
    # Rows are ordered by update; the update column is exact, global_step is the fallback for older files.
    col, limit = (header.index("update"), update) if "update" in header else (0, global_step)
    kept = []
    for row in body:
        try:
            # A row cut short by the kill has fewer cells than the header; it was written after the checkpoint.
            if len(row) == len(header) and float(row[col]) <= limit:
                kept.append(row)
        except ValueError:
            pass
    dropped = len(body) - len(kept)
    if dropped:
        out = io.StringIO()
        csv.writer(out).writerows([header, *kept])
        _atomic_write(path, out.getvalue())
    return dropped


def _trim_jsonl(path: Path, key: str, last: int) -> int:
    """Keep the JSONL records whose integer ``key`` is at most ``last`` (a half-written line from a kill is
    dropped); the number of records dropped."""
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # half a line from the kill
        if isinstance(record, dict) and isinstance(record.get(key), int) and record[key] <= last:
            kept.append(line)
    dropped = len([line for line in lines if line.strip()]) - len(kept)
    if dropped:
        _atomic_write(path, "".join(line + "\n" for line in kept))
    return dropped


def trim_to_checkpoint(run_dir: str | os.PathLike, update: int, global_step: int) -> list[str]:
    """Drop ``metrics.csv`` rows of updates after ``update`` and alerts after ``global_step`` (atomic rewrites).

    The loop logs an update before it checkpoints it, so a run killed in between has logged updates that the
    resumed run will log again. Returns notes saying what was dropped.
    """
    run_dir = Path(run_dir)
    notes = []
    if (run_dir / "metrics.csv").is_file():
        n = _trim_metrics(run_dir / "metrics.csv", update, global_step)
        if n:
            notes.append(f"resume: dropped {n} metrics.csv row(s) logged after the checkpoint (update {update})")
    if (run_dir / COMPLETIONS_FILE).is_file():
        n = _trim_jsonl(run_dir / COMPLETIONS_FILE, "iteration", update)
        if n:
            notes.append(f"resume: dropped {n} completions.jsonl row(s) logged after the checkpoint (update {update})")
    if (run_dir / "alerts.jsonl").is_file():
        n = _trim_jsonl(run_dir / "alerts.jsonl", "step", global_step)
        if n:
            notes.append(f"resume: dropped {n} alert(s) logged after the checkpoint (step {global_step:,})")
    return notes


def update_latest_link(run_dir: str | os.PathLike) -> Path | None:
    """Point ``runs/latest`` at ``run_dir`` when it lives directly under a ``runs`` directory (the default layout).

    The link is relative (the tree can be moved) and replaced atomically (a symlink under a temp name renamed
    over the old one), so a reader never finds it missing. Returns the link, or None where none was made
    (another layout, a real ``latest`` directory, a filesystem without symlinks).
    """
    target = Path(run_dir).resolve()
    parent = target.parent
    if parent.name != "runs" or target.name == "latest":
        return None
    link = parent / "latest"
    if link.exists() and not link.is_symlink():
        return None  # a real directory or file of that name is the user's; leave it
    tmp = parent / f".latest.{uuid.uuid4().hex}.tmp"
    try:
        os.symlink(target.name, tmp, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return None
    return link
