"""The processes a run has a third party start for it (a ``--ray-address local`` Ray: its GCS, raylet, dashboard
agent and actor workers) end with the run, however it ends.

Ray's own fate sharing stops most of a ``local`` Ray when its driver dies, but not all of it: after a kill -9 of
the learner, and after a clean ``ray.shutdown()`` too, Ray's ``DashboardAgent`` and ``RuntimeEnvAgent`` were
seen alive 20 s on (a loaded CI machine) and ~1 min on (here). ppokit cannot give Ray's processes a parent-death
signal (Ray spawns them, the agents from the raylet), nor find them by an environment variable (they retitle
themselves, which blanks ``/proc/PID/environ``), so it follows them by parentage instead:

- ``with reaper.owning(): <start Ray>``: the children the run gained inside the block are the roots, sent to the
  reaper, a small process started before (``python -m ppokit.runtime.reaper``);
- the reaper records every process below the roots every ``_POLL_S`` while the run lives (an orphan is
  reparented to init, so what it started must be known before its parent goes);
- it waits for EOF on a pipe whose only write end the run holds. The kernel closes that end however the run ends
  (``close()``, an exception, SIGTERM, kill -9; the launcher's pipe rule, for the same reason), and the reaper
  then kills every recorded process that is still the same process (pid and start time) and everything below,
  until a scan finds none, or for ``SWEEP_S``.

The reaper ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process group, and the run's own
shutdown must come first). Linux (``/proc``); elsewhere it only waits, and Ray's fate sharing is all there is.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from ppokit.runtime.procs import children, descendants, kill, table

__all__ = ["Reaper", "SWEEP_S"]

SWEEP_S = 10.0  # how long the reaper keeps killing after EOF (Ray's processes are gone within ~1 s of SIGKILL)
_POLL_S = 0.5  # how often the reaper records what is below the roots while the run lives (a scan: ~2 ms)


class Reaper:
    """A reaper process for one run (see the module docstring): ``with reaper.owning(): <start Ray>``, then
    ``close()`` when done (it kills what is left and waits for the reaper)."""

    def __init__(self) -> None:
        read, self._write = os.pipe()  # close-on-exec: no process Ray execs holds the write end
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "ppokit.runtime.reaper"], stdin=read,
                                         stdout=subprocess.DEVNULL)
        except BaseException:
            os.close(self._write)
            raise
        finally:
            os.close(read)

    @contextlib.contextmanager
    def owning(self) -> Iterator[None]:
        """The processes this process starts inside the block, and all they start, are the reaper's to end."""
        before = children(os.getpid())
        try:
            yield
        finally:
            roots = {p: s for p, s in children(os.getpid()).items() if before.get(p) != s and p != self.proc.pid}
            if roots and self._write is not None:
                os.write(self._write, "".join(f"{p} {s}\n" for p, s in roots.items()).encode())

    def close(self, timeout: float = SWEEP_S + 5.0) -> None:
        """Kill what is left of the owned processes now, and wait for the reaper to finish."""
        if self._write is not None:
            os.close(self._write)
            self._write = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)


def _main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    owned: dict[int, str] = {}  # every process seen below the roots: pid -> start time
    text = b""
    while True:
        readable, _, _ = select.select([0], [], [], _POLL_S)
        if readable:
            try:
                data = os.read(0, 65536)
            except OSError:
                data = b""
            if not data:  # EOF: the run closed its end, or is gone
                break
            text += data
            *lines, text = text.split(b"\n")
            for line in lines:
                pid, start = line.split()
                owned[int(pid)] = start.decode()
        owned.update(descendants(owned))
    deadline, empty = time.monotonic() + SWEEP_S, 0
    while empty < 2 and time.monotonic() < deadline:  # two empty scans in a row: nothing is still starting
        procs = table()
        left = descendants(owned, procs)
        empty = 0 if left else empty + 1
        owned.update(left)
        for pid, start in left.items():
            kill(pid, start)
        time.sleep(0.05)


if __name__ == "__main__":
    _main()
