"""Averaging a flat buffer over the ranks of one host through shared memory (the per-minibatch gradient sync).

Why: on a small machine a gloo all-reduce of a ~10k-float gradient buffer over loopback took 1.2-2.5 ms here
(every collective hops through gloo's worker and transport threads on both ranks, and each hop is a wake-up),
and PPO syncs once per minibatch: 16 times per update at 4 epochs x 4 minibatches, ~30 ms of an update that
computes in ~29 ms. Ranks that share a host can instead write their buffer into one shared file and read
everyone's: one copy in, one rank-ordered sum, no thread hop. The result is the same bits on every rank
(every rank adds the same rows in rank order).

The buffer is an anonymous memory file (``memfd_create``): it has no name in /dev/shm or anywhere, so no
process outside the job can open it and nothing is left behind when a rank dies (the kernel frees it with its
last mapping). Rank 0 creates it and hands its descriptor to the other ranks over a Unix socket
(``SCM_RIGHTS``) whose abstract name is random and sent through the process group; rank 0 gives it only to a
peer whose credentials (``SO_PEERCRED``) show this user and one of the job's rank pids, and a rank takes it
only from rank 0's pid. Every rank maps it and closes the descriptor at once, so no ``/proc/PID/fd`` link
remains either (a same-user process allowed to ptrace a rank could still read its memory: that is the
ptrace policy's business, not this buffer's).

Layout of the buffer: ``flags int64 [2, K]`` then ``data float64 [2, K, capacity]``.
Call ``g`` (1, 2, ...) uses slot ``g % 2``: a rank copies its row in, then sets its flag to ``g`` (the data
store is ordered before the flag store on x86's total store order, the only architecture this is used on),
waits until every flag of the slot reads ``g``, and sums the rows. Two slots suffice: a rank writes slot
``g % 2`` again only at call ``g + 2``, after it has seen every flag at ``g + 1``, i.e. after every rank has
finished reading call ``g``.

A rank that stops answering is noticed by ``lost(...)`` (polled every ~0.2 s: an exited process at once) or,
at the latest, at ``timeout_s``; either raises through the caller's ``on_lost``.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import socket
import struct
import time
from typing import Callable

import numpy as np
import torch
from torch import Tensor

__all__ = ["ShmReducer", "join", "supported", "serve_fd", "receive_fd", "JoinError"]


class JoinError(RuntimeError):
    """The buffer could not be handed over (a peer gone, a stranger's connection, a timeout)."""


def supported() -> bool:
    """Whether this machine's memory order makes the flag protocol safe (x86-64's total store order) and it has
    anonymous memory files and descriptor passing (Linux)."""
    return (platform.machine().lower() in ("x86_64", "amd64") and hasattr(os, "memfd_create")
            and hasattr(socket, "send_fds") and hasattr(socket, "SO_PEERCRED"))


class ShmReducer:
    """Rank ``rank`` of ``world_size``'s view of the shared buffer behind descriptor ``fd`` (mapped here; the
    caller closes ``fd``)."""

    def __init__(self, fd: int, rank: int, world_size: int, capacity: int):
        self.rank, self.world_size, self.capacity = rank, world_size, capacity
        k = world_size
        size = self.nbytes(k, capacity)
        if os.fstat(fd).st_size != size:
            raise JoinError(f"the shared buffer holds {os.fstat(fd).st_size} bytes, expected {size}")
        self._map = mmap.mmap(fd, size)  # MAP_SHARED: every rank's writes are seen by the others
        self._mem = np.frombuffer(self._map, dtype=np.int64)
        self._flags = self._mem[:2 * k].reshape(2, k)
        self._data = self._mem[2 * k:].view(np.float64).reshape(2, k, capacity)
        self._gen = 0

    @staticmethod
    def nbytes(world_size: int, capacity: int) -> int:
        return 8 * (2 * world_size + 2 * world_size * capacity)

    @classmethod
    def memfd(cls, world_size: int, capacity: int) -> int:
        """A zeroed anonymous memory file of the buffer's size, its size sealed (a peer cannot shrink it under
        the others' mappings); the caller owns the descriptor."""
        import fcntl

        fd = os.memfd_create("ppokit-sync", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, cls.nbytes(world_size, capacity))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(fd)
            raise
        return fd
    def fits(self, n: int) -> bool:
        return n <= self.capacity

    def sum(self, buf: Tensor, timeout_s: float, lost: Callable[[], str | None],
            on_lost: Callable[[str | None], None]) -> Tensor:
        """Every rank's ``buf`` (1-D, float32 or float64, ``fits``) summed in rank order, in ``buf``'s dtype."""
        n = buf.numel()
        self._gen += 1
        g, slot = self._gen, self._gen % 2
        row = self._data[slot, self.rank, :n]
        row[:] = buf.detach().to(torch.float64).numpy()
        self._flags[slot, self.rank] = g  # after the data (see the module docstring)
        flags = self._flags[slot]
        if not (flags == g).all():
            self._wait(flags, g, timeout_s, lost, on_lost)
        rows = torch.from_numpy(self._data[slot, :, :n])
        out = rows[0].clone()
        for r in range(1, self.world_size):
            out += rows[r]
        return out.to(buf.dtype)

    @staticmethod
    def _wait(flags: np.ndarray, g: int, timeout_s: float, lost: Callable[[], str | None],
              on_lost: Callable[[str | None], None]) -> None:
        # Spin first (a peer is usually microseconds to a few ms behind), then yield the core in short sleeps
        # so a rank that waits long (the other one evaluating, checkpointing) does not burn its core.
        start = last_check = time.monotonic()
        spins = 0
        while not (flags == g).all():
            spins += 1
            if spins > 5_000:
                time.sleep(0.0002)
            if spins % 256 == 0:
                now = time.monotonic()
                if now - last_check > 0.2:
                    last_check = now
                    why = lost()
                    if why is not None:
                        on_lost(why)
                if now - start > timeout_s:
                    on_lost(None)  # the caller names the rank(s) that did not answer


def _peer(conn: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a connected Unix socket (``SO_PEERCRED``, Linux)."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def serve_fd(listener: socket.socket, fd: int, pids: set[int], timeout_s: float,
             lost: Callable[[], str | None] = lambda: None) -> None:
    """Rank 0: hand ``fd`` to each of ``pids`` (the other ranks) as it connects to ``listener``. A connection
    from any other process, or another user, is closed unserved; a rank that ``lost()`` reports gone (polled
    every 0.2 s) or that has not come at ``timeout_s`` ends it."""
    waiting = set(pids)
    deadline = time.monotonic() + timeout_s
    while waiting:
        why = lost()
        if why is not None:
            raise JoinError(why)
        if time.monotonic() > deadline:
            raise JoinError(f"rank(s) with pid {sorted(waiting)} did not collect the shared buffer "
                            f"within {timeout_s:g} s")
        listener.settimeout(0.2)
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        with conn:
            pid, uid = _peer(conn)
            if uid != os.getuid() or pid not in waiting:
                continue  # not one of this job's ranks: it gets nothing
            socket.send_fds(conn, [b"f"], [fd])
            waiting.discard(pid)


def receive_fd(name: bytes, owner: int, timeout_s: float) -> int:
    """A rank: the descriptor rank 0 (pid ``owner``) serves at abstract socket ``name``; refused from anyone else."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(name)
        pid, uid = _peer(conn)
        if pid != owner or uid != os.getuid():
            raise JoinError(f"the shared-buffer socket is held by pid {pid} (uid {uid}), not rank 0 (pid {owner})")
        _, fds, _, _ = socket.recv_fds(conn, 16, 4)
        if len(fds) != 1:
            for extra in fds:
                os.close(extra)
            raise JoinError("rank 0 closed the shared-buffer socket without handing the buffer over")
        return fds[0]


def join(rank: int, world_size: int, capacity: int, pids: list[int], timeout_s: float = 60.0,
         lost: Callable[[], str | None] = lambda: None) -> ShmReducer:
    """Every rank of the (initialized) process group calls this, ``pids`` being every rank's pid in rank order:
    rank 0 creates the anonymous buffer and hands it to the others (see the module docstring); all map it.
    ``lost()`` names a rank that has gone (None while all run): rank 0 stops waiting for it.

    Whatever fails (a rank lost midway, a stranger on the socket, a timeout), every descriptor and socket opened
    here is closed before the exception leaves: nothing is left behind, and the buffer never had a name."""
    import torch.distributed as dist

    fd = -1
    listener = None
    try:
        name: list = [None]
        if rank == 0:
            fd = ShmReducer.memfd(world_size, capacity)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # Abstract namespace (leading NUL): no file to create or to leave behind; random, and useless to
            # anyone who guesses it (the credential check).
            address = b"\0ppokit-sync-" + secrets.token_hex(16).encode()
            listener.bind(address)
            listener.listen(world_size)
            name = [address]
        dist.broadcast_object_list(name, src=0)
        if rank == 0:
            serve_fd(listener, fd, set(pids[1:]), timeout_s, lost)
        else:
            fd = receive_fd(name[0], pids[0], timeout_s)
        reducer = ShmReducer(fd, rank, world_size, capacity)
        dist.barrier()
        return reducer
    finally:
        if listener is not None:
            listener.close()
        if fd >= 0:
            os.close(fd)
