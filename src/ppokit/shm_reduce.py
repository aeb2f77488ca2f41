"""Averaging a flat buffer over the ranks of one host through shared memory (the per-minibatch gradient sync).

Why: on a small machine a gloo all-reduce of a ~10k-float gradient buffer over loopback took 1.2-2.5 ms here
(every collective hops through gloo's worker and transport threads on both ranks, and each hop is a wake-up),
and PPO syncs once per minibatch: 16 times per update at 4 epochs x 4 minibatches, ~30 ms of an update that
computes in ~29 ms. Ranks that share a host can instead write their buffer into one shared file and read
everyone's: one copy in, one rank-ordered sum, no thread hop. The result is the same bits on every rank
(every rank adds the same rows in rank order).

Layout of the file (``numpy.memmap``): ``flags int64 [2, K]`` then ``data float64 [2, K, capacity]``.
Call ``g`` (1, 2, ...) uses slot ``g % 2``: a rank copies its row in, then sets its flag to ``g`` (the data
store is ordered before the flag store on x86's total store order, the only architecture this is used on),
waits until every flag of the slot reads ``g``, and sums the rows. Two slots suffice: a rank writes slot
``g % 2`` again only at call ``g + 2``, after it has seen every flag at ``g + 1``, i.e. after every rank has
finished reading call ``g``.

A rank that stops answering is noticed by ``lost(...)`` (polled every ~0.2 s: an exited process at once) or,
at the latest, at ``timeout_s``; either raises through the caller's ``on_lost``.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from typing import Callable

import numpy as np
import torch
from torch import Tensor

__all__ = ["ShmReducer", "join", "supported"]


def supported() -> bool:
    """Whether this machine's memory order makes the flag protocol safe (x86-64's total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmReducer:
    """Rank ``rank`` of ``world_size``'s view of a shared file created by ``create`` (rank 0) and opened by all."""

    def __init__(self, path: str, rank: int, world_size: int, capacity: int):
        self.rank, self.world_size, self.capacity = rank, world_size, capacity
        k = world_size
        self._mem = np.memmap(path, dtype=np.int64, mode="r+", shape=(self.nbytes(k, capacity) // 8,))
        self._flags = self._mem[:2 * k].reshape(2, k)
        self._data = self._mem[2 * k:].view(np.float64).reshape(2, k, capacity)
        self._gen = 0

    @staticmethod
    def nbytes(world_size: int, capacity: int) -> int:
        return 8 * (2 * world_size + 2 * world_size * capacity)

    @classmethod
    def create(cls, path: str, world_size: int, capacity: int) -> None:
        """Make the zeroed file (rank 0, before the others open it)."""
        with open(path, "wb") as f:
            f.truncate(cls.nbytes(world_size, capacity))

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


def join(rank: int, world_size: int, capacity: int) -> ShmReducer:
    """Every rank of the (initialized) process group calls this: rank 0 creates the file (in /dev/shm where it
    exists), all map it, and rank 0 unlinks it once all have, so nothing is left behind, even after a kill -9."""
    import torch.distributed as dist

    name: list = [None]
    if rank == 0:
        fd, path = tempfile.mkstemp(prefix="ppokit-sync-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.close(fd)
        ShmReducer.create(path, world_size, capacity)
        name = [path]
    dist.broadcast_object_list(name, src=0)
    reducer = ShmReducer(name[0], rank, world_size, capacity)
    dist.barrier()
    if rank == 0:
        os.unlink(name[0])
    return reducer
