"""This machine's processes by ``/proc`` (Linux): a process is its pid *and* its start time, so a pid the kernel
has since given to another process is never mistaken for it (nor killed). Without ``/proc`` every query finds
nothing. Used by the launcher (its agent's ranks) and the reaper (a local Ray's processes)."""

from __future__ import annotations

import os
import signal

__all__ = ["start_time", "table", "children", "descendants", "kill"]


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (field 3 on), None once gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if not fields or fields[0] in ("Z", "X") else fields


def start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (the start time), None once the process has exited (or is a zombie)."""
    fields = _stat(pid)
    return fields[19] if fields is not None else None


def table() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (parent pid, start time); {} without /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.isdigit() and (fields := _stat(name)) is not None:
            out[int(name)] = (int(fields[1]), fields[19])
    return out


def children(pid: int) -> dict[int, str]:
    """The live children of ``pid``: pid -> start time."""
    return {p: start for p, (parent, start) in table().items() if parent == pid}


def descendants(roots: dict[int, str], procs: dict[int, tuple[int, str]] | None = None) -> dict[int, str]:
    """``roots`` that are still the same processes, and every live process below them: pid -> start time."""
    procs = table() if procs is None else procs
    below: dict[int, list[int]] = {}
    for p, (parent, _) in procs.items():
        below.setdefault(parent, []).append(p)
    out, todo = {}, [p for p, s in roots.items() if p in procs and procs[p][1] == s]
    while todo:
        p = todo.pop()
        if p not in out:
            out[p] = procs[p][1]
            todo.extend(below.get(p, ()))
    return out


def kill(pid: int, start: str | None) -> None:
    """SIGKILL ``pid`` if it is still the process that started at ``start``."""
    if start is not None and start_time(pid) == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
