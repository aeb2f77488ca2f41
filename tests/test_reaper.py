"""runtime/reaper.py: the processes a run started inside ``owning()``, and what those started, end with the run,
by kill -9 or by ``close()``; nothing else is touched. Real processes, found by pid (Linux /proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ppokit.runtime.reaper import Reaper

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="the reaper finds processes by /proc (Linux)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _ignores(pid: int, *signums: int) -> bool:
    """Whether ``pid`` ignores every one of ``signums`` (the SigIgn mask of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return all(mask >> (s - 1) & 1 for s in signums)


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


# The owner starts, inside owning(), a daemon in its own session and a shell that starts a grandchild and exits
# (the grandchild, orphaned, is reparented to init: as Ray's raylet starts its agents and may die first), and
# outside it one more daemon; it prints the pids and waits to be killed.
_OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from ppokit.runtime.reaper import Reaper
    reaper = Reaper()
    with reaper.owning():
        mine = subprocess.Popen(["sleep", "300"], start_new_session=True)
        shell = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; sleep 1.5"], stdout=subprocess.PIPE, text=True)
    grandchild = int(shell.stdout.readline())
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    shell.wait()
    print(mine.pid, grandchild, other.pid, reaper.proc.pid, flush=True)
    time.sleep(300)
""")


def test_a_killed_owner_takes_what_it_started_in_the_block_and_leaves_the_rest():
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": SRC})
    mine, grandchild, other, reaper = (int(x) for x in owner.stdout.readline().split())
    try:
        with open(f"/proc/{grandchild}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[1] != str(owner.pid)  # orphaned: no longer the shell's
        assert _alive(mine) and _alive(grandchild) and _alive(other) and _alive(reaper)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        assert _gone_within(mine, 20.0), "a process started in the block outlived its killed owner"
        assert _gone_within(grandchild, 20.0), "an orphaned grandchild outlived the killed owner"
        assert _gone_within(reaper, 20.0), "the reaper did not exit after its sweep"
        assert _alive(other), "the reaper killed a process started outside the block"
    finally:
        for pid in (mine, grandchild, other, reaper):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_close_kills_at_once_what_the_block_started_and_nothing_else():
    other = subprocess.Popen(["sleep", "300"])
    reaper = Reaper()
    with reaper.owning():
        mine = subprocess.Popen(["sleep", "300"])
    try:
        reaper.close()
        assert mine.wait(timeout=10) == -signal.SIGKILL
        assert reaper.proc.returncode == 0
        assert other.poll() is None
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_the_reaper_outlives_a_ctrl_c_to_the_process_group():
    reaper = Reaper()
    with reaper.owning():
        mine = subprocess.Popen(["sleep", "300"])
    try:
        deadline = time.monotonic() + 30
        while not _ignores(reaper.proc.pid, signal.SIGINT, signal.SIGTERM):  # the reaper has set its handlers
            assert reaper.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(reaper.proc.pid, signal.SIGINT)
        os.kill(reaper.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        assert reaper.proc.poll() is None and mine.poll() is None
        reaper.close()
        assert mine.wait(timeout=10) == -signal.SIGKILL
    finally:
        mine.kill()
        mine.wait()
