"""Data-parallel PPO on ``torch.distributed``: K ranks, one PPO job (gloo on CPU, nccl on GPU).

Every rank steps its own vectorized envs, computes the gradient of its share of each minibatch, and the ranks
agree through this module; the trainer consults one ``Dist`` object and, in a single process, every method here
is the identity (``LOCAL``), so a plain run computes bit for bit what it did before (``tests/test_bit_identity``).

What makes the ranks one job (the pattern of CleanRL's multi-GPU PPO, written for ppokit's epoch loop):

1. identical start: rank 0's parameters are broadcast after the policy is built (and after a resume);
2. gradients averaged in the epoch loop's ``sync`` hook (``epochs.SyncHook``): ONE sum per minibatch of
   the step's flat gradient buffer (through shared memory, ``shm_reduce``, when every rank is on this host under
   gloo, ``PPOKIT_DIST_NO_SHM=1`` to use gloo's all-reduce instead; an all-reduce otherwise) (the fused path's ``FlatAdam`` buffer, or the autograd path's ``.grad``
   tensors flattened) concatenated with the device statistics the guards read, so the gradient norm, the clip,
   the non-finite skip and the KL early stop are decided on the same numbers on every rank (a per-rank KL
   break leaves the others waiting in the next all-reduce forever: the KL mean is what is compared);
3. equal minibatch counts (one min-all-reduce of the batch size per update), the after-update KL, the
   evaluation gate (rank 0's result, broadcast) and a stop (Ctrl-C, SIGTERM, a callback) agreed on every update;
4. observation/reward normalizer statistics merged from every rank's batch at every step (an all-gather of the
   batch moments combined in rank order, ``RunningMeanStd.reduce``), so every rank normalizes the same way;
5. the logged diagnostics (returns, explained variance, reward/advantage std, non-finite counts) computed over
   all ranks' data before rank 0 logs them;
6. seeds: torch/numpy ``seed + rank``; env ``i`` of rank ``r`` gets ``seed + r * num_envs + i``, so the K ranks
   together step exactly the envs of one process with ``K * num_envs`` envs (no seed is shared);
7. rank 0 alone writes the run dir (lock, logs, TensorBoard, checkpoints, report); the other ranks log to a
   private scratch directory that is deleted at exit;
8. a lost rank (crash, kill -9, stopped or hung) turns the next collective's error into ``DistributedError``
   naming it, within ``dist_timeout``; teardown collects garbage before ``destroy_process_group``.

The language-model trainers (``lm/``) use the same object: ``shard`` gives each rank its contiguous share of
the prompts (whole GRPO groups) or pairs, ``global_std`` and ``whiten`` take batch statistics over every rank,
and ``sync`` averages the token minibatches' gradients.

Batch semantics: ``num_envs`` is per rank, ``total_timesteps`` is global (all ranks' env steps together), so a
rollout has ``K * num_envs * num_steps`` steps and ``num_minibatches`` splits each rank's share: the averaged
gradient is that of a global minibatch ``K`` times larger, with the same number of optimizer steps per update
and the learning rate as given (no scaling rule). Advantages are normalized per rank's minibatch.

Debugging switches (environment variables, read at start): ``PPOKIT_DIST_CHECKSUMS=FILE`` makes rank 0 append,
after every update, the update number and a SHA-256 of each rank's parameters and normalizer statistics
(all-gathered) to FILE: equal digests on a line prove the ranks hold the same weights and statistics. ``PPOKIT_DIST_NO_SYNC=1`` disables the gradient
all-reduce (the ranks drift apart: the negative control of the tests, never for training).
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from ppokit.core.seeding import seed_everything

__all__ = ["Dist", "DistributedError", "LOCAL", "current", "shutdown", "combine_moments", "launched",
           "CHECKSUMS_VAR", "NO_SYNC_VAR"]

CHECKSUMS_VAR = "PPOKIT_DIST_CHECKSUMS"
NO_SYNC_VAR = "PPOKIT_DIST_NO_SYNC"
NO_SHM_VAR = "PPOKIT_DIST_NO_SHM"


class DistributedError(RuntimeError):
    """A collective failed: a rank was lost or did not answer within ``dist_timeout``. ``peer_exited``: another
    rank's process on this host was seen gone (its end is the news, which torchrun's launcher can tell)."""

    def __init__(self, message: str, peer_exited: bool = False):
        super().__init__(message)
        self.peer_exited = peer_exited


def launched() -> bool:
    """Whether this process was started as one of several ranks (torchrun's ``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def combine_moments(n: Tensor, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Merge per-part (count ``n [K]``, mean ``[K, *s]``, population variance ``[K, *s]``) into one (Chan et al.).

    ``M2 = sum_k n_k (var_k + (mean_k - mean)^2)``, the same stable merge ``RunningMeanStd.update`` uses, done in
    part order so every rank gets the same bits from the same gathered rows. Empty parts count zero (their NaN
    moments are masked out). Returns (total count, mean, var); mean 0 and var 1 when everything was empty.
    """
    shape = (-1,) + (1,) * (mean.dim() - 1)
    w = n.reshape(shape)
    mean, var = torch.where(w > 0, mean, 0.0), torch.where(w > 0, var, 0.0)
    total = n.sum()
    if float(total) == 0:
        return total, torch.zeros_like(mean[0]), torch.ones_like(var[0])
    mu = (w * mean).sum(0) / total
    m2 = (w * (var + (mean - mu).square())).sum(0)
    return total, mu, m2 / total


@dataclass
class Dist:
    """Where this process stands in the job, and every collective the trainer uses (identity when not active)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: a single process, no process group
    peers: list[tuple[str, int]] = field(default_factory=list)  # (hostname, pid) of every rank
    checksums: Path | None = None
    no_sync: bool = False
    _scratch: Path | None = None
    _stats: list[Any] = field(default_factory=list)  # the normalizers' RunningMeanStd, for the checksums
    timeout_s: float = 60.0  # dist_timeout: how long a rank waits for the others
    _shm: Any = None  # a ShmReducer when every rank is on this host (gloo): the per-minibatch sync without gloo

    # ------------------------------------------------------------------ who am I
    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs and writes the run dir."""
        return self.rank == 0

    def seed(self, seed: int) -> int:
        """This rank's torch/numpy/python seed (within numpy's 32-bit range)."""
        return (seed + self.rank) % 2 ** 32

    def env_seed(self, seed: int, num_envs: int) -> int:
        """The seed of this rank's first env (its envs take the next ``num_envs`` seeds)."""
        return seed + self.rank * num_envs

    def device(self, name: str) -> str:
        """``cuda`` means this rank's own GPU (``cuda:LOCAL_RANK``) under nccl; anything else as given."""
        return f"cuda:{self.local_rank}" if self.active and name == "cuda" else name

    def scratch_dir(self) -> Path:
        """A private directory for a non-main rank's logs (removed at exit): only rank 0 writes the run dir."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix=f"ppokit-rank{self.rank}-"))
            atexit.register(shutil.rmtree, self._scratch, True)
        return self._scratch / "run"

    def schedule(self, total_timesteps: int, batch_size: int, update_idx: int, global_step: int) -> tuple[int, int]:
        """``(num_updates, end_step)``: the update count at which the run ends and the global step it ends at.

        ``total_timesteps`` counts every rank's env steps; one update takes ``world_size * batch_size``. A resumed
        run finishes what is left of it at the current world size, which may differ from the checkpoint's.
        In one process this is ``config.num_updates`` (a fresh run) and the same bound on a resume.
        """
        per_update = self.world_size * batch_size
        if update_idx == 0 and global_step == 0:
            n = max(1, total_timesteps // per_update)
        else:
            n = update_idx + max(0, (total_timesteps - global_step) // per_update)
        return n, global_step + (n - update_idx) * per_update

    # ------------------------------------------------------------------ the start
    def prepare(self, policy: torch.nn.Module, acting: Any, normalizers: list[Any]) -> None:
        """Make every rank start from rank 0's weights and merge the normalizers' statistics from now on."""
        if not self.active:
            return
        with self._guard("broadcasting rank 0's parameters"), torch.no_grad():
            # Tensor by tensor, in place: no second copy of a large model (a language model) is ever held.
            for t in [p.data for p in policy.parameters()] + list(policy.buffers()):
                if t.is_contiguous() and t.dtype != torch.bool:
                    torch.distributed.broadcast(t, src=0)
                else:  # gloo has no bool; a strided view broadcasts through a contiguous copy
                    tmp = t.contiguous().to(torch.uint8 if t.dtype == torch.bool else t.dtype)
                    torch.distributed.broadcast(tmp, src=0)
                    t.copy_(tmp.to(t.dtype))
        self._share_memory(sum(p.numel() for p in policy.parameters()) + 256)  # + the sync hook's stats
        if acting is not None:
            acting.invalidate()  # its cached weights came from this rank's own initialization
        for norm in normalizers:
            # An ObsNormalizer or RewardScaler has one running statistic; a Dict observation's one per part.
            for part in (getattr(norm, "parts", {}).values() or [norm]) if norm is not None else ():
                part.rms.reduce = self.merge_moments
                self._stats.append(part.rms)

    def resume_state(self, state: dict) -> dict:
        """The checkpoint as this rank resumes it: rank 0 (the one that wrote it) continues its envs; the others
        start fresh episodes from their own seeds (the file holds rank 0's envs and discounted returns only)."""
        if self.is_main:
            return state
        scaler = state.get("reward_scaler")
        if scaler is not None:
            scaler = {k: v for k, v in scaler.items() if k != "returns"}
        return {**state, "env_state": None, "reward_scaler": scaler}

    def reseed_after_resume(self, seed: int, update_idx: int) -> None:
        """A non-main rank loaded rank 0's RNG state: give it its own stream again (fresh for this update)."""
        if self.active and not self.is_main:
            seed_everything((self.seed(seed) * 1_000_003 + update_idx) % (2 ** 31))

    # ------------------------------------------------------------------ per minibatch
    @property
    def sync(self) -> Callable[[list[Tensor], list[Tensor]], None] | None:
        """The epoch loop's ``sync`` hook (None in one process)."""
        return self._sync if self.active else None

    @property
    def stats_sync(self) -> Callable[[list[Tensor], list[Tensor]], None] | None:
        """The sync hook of a sharded (FSDP) model, whose gradients FSDP has already averaged in the backward:
        the statistics alone are averaged, so the guards decide alike on every rank (None in one process)."""
        return (lambda gradients, stats: self._sync([], stats)) if self.active else None

    def _sync(self, gradients: list[Tensor], stats: list[Tensor]) -> None:
        """Replace each gradient and statistic by its mean over the ranks: ONE all-reduce of one flat buffer."""
        tensors = list(stats) if self.no_sync else [*gradients, *stats]
        dtype = tensors[0].dtype if all(t.dtype == tensors[0].dtype for t in tensors) else torch.float64
        sizes = [t.numel() for t in tensors]
        buf = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
        if self._shm is not None and self._shm.fits(buf.numel()):
            buf = self._shm.sum(buf, self.timeout_s, self._lost_now, self._raise_lost)
        else:
            with self._guard("averaging gradients"):
                torch.distributed.all_reduce(buf)
        buf.div_(self.world_size)
        with torch.no_grad():
            for t, part in zip(tensors, torch.split(buf, sizes)):
                t.copy_(part.view_as(t))

    def _share_memory(self, capacity: int) -> None:
        """When every rank runs on this host under gloo: a shared buffer for ``_sync`` (``shm_reduce``: a gloo
        all-reduce per minibatch cost 1.2-2.5 ms here, as much as the update's compute). It is an anonymous
        memory file that rank 0 hands to the job's ranks alone (checked credentials): it never has a name, so
        nothing outside the job can open it and nothing is left behind, even after kill -9."""
        from ppokit.runtime import shm_reduce

        if self._shm is not None:  # a second model (the LM value model): one buffer for both, as they may sync together
            capacity += self._shm.capacity
        here = socket.gethostname()
        if (self.backend != "gloo" or not shm_reduce.supported() or any(h != here for h, _ in self.peers)
                or capacity > 1 << 24 or os.environ.get(NO_SHM_VAR, "") not in ("", "0")):
            return
        with self._guard("sharing memory"):
            self._shm = shm_reduce.join(self.rank, self.world_size, capacity, [pid for _, pid in self.peers],
                                        self.timeout_s, self._lost_now)

    def _lost_now(self) -> str | None:
        """``lost_ranks()`` when a rank on this host has exited or is stopped, else None (still running)."""
        here = socket.gethostname()
        gone = any(_proc_state(pid) in (None, "T") for r, (host, pid) in enumerate(self.peers)
                   if r != self.rank and host == here)
        return self.lost_ranks() if gone else None

    def _raise_lost(self, why: str | None = None) -> None:
        raise DistributedError(f"distributed: rank {self.rank} {why or self.lost_ranks()} while averaging "
                               f"gradients (shared memory, dist_timeout {self.timeout_s:g} s)",
                               peer_exited=bool(self._exited_peers()))

    def _exited_peers(self) -> list[int]:
        """The other ranks on this host whose process has exited."""
        here = socket.gethostname()
        return [r for r, (host, pid) in enumerate(self.peers)
                if r != self.rank and host == here and _proc_state(pid) is None]

    # ------------------------------------------------------------------ per update
    def agree_minibatches(self, settings: Any, batch_len: int) -> Any:
        """Settings whose minibatch count is the same on every rank: the epoch loop makes ``min(M, B)`` non-empty
        minibatches, and a rank with fewer valid steps ``B`` would otherwise run fewer all-reduces (a hang)."""
        if not self.active:
            return settings
        smallest = int(self._reduce([float(batch_len)], torch.distributed.ReduceOp.MIN)[0])
        if smallest < settings.num_minibatches:
            return replace(settings, num_minibatches=max(1, smallest))
        return settings

    def mean(self, value: float) -> float:
        """``value`` averaged over the ranks."""
        return self.means([value])[0]

    def means(self, values: list[float]) -> list[float]:
        """Each of ``values`` averaged over the ranks, in one all-reduce: a step's statistics measured on each
        rank's equal share of the rows (DPO's and the reward model's accuracy and margins) become the whole
        batch's, as one process would log them."""
        if not self.active:
            return list(values)
        return [v / self.world_size for v in self._reduce(list(values))]

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on one (a Ctrl-C reaching one rank stops all of them together)."""
        return bool(self._reduce([float(flag)], torch.distributed.ReduceOp.MAX)[0]) if self.active else flag

    def from_main(self, fn: Callable[[], float]) -> float:
        """Rank 0's ``fn()`` on every rank (the evaluation gate, which decides whether all of them stop).

        Every rank runs ``fn`` (the same deterministic evaluation), so none waits in the broadcast while rank 0
        evaluates: a long evaluation (Atari games) would otherwise outlast ``dist_timeout``. Rank 0's value is
        the one taken, so a last-bit difference between hosts cannot split the decision."""
        if not self.active:
            return fn()
        value = torch.tensor([fn()], dtype=torch.float64, device=self._comm_device())
        with self._guard("sharing rank 0's evaluation"):
            torch.distributed.broadcast(value, src=0)
        return float(value[0])

    def diagnostics(self, episodes: list[tuple[float, int]], values_old: Tensor, returns: Tensor, rewards: Tensor,
                    advantages: Tensor, nonfinite_env: int, advantages_nonfinite: float) -> dict[str, float]:
        """The logged diagnostics over every rank's data (schema names -> floats); {} in one process.

        Episodes: mean return and length over all ranks' finished episodes. Explained variance
        ``1 - Var(returns - values) / Var(returns)`` and the reward and advantage std (unbiased, as
        ``Tensor.std``) from every rank's (count, mean, variance), merged by ``combine_moments``.
        """
        if not self.active:
            return {}
        from ppokit.core import schema as S

        def moments(x: Tensor) -> list[float]:
            x = x.detach().to(torch.float64).reshape(-1)
            n = x.numel()
            return [float(n), float(x.mean()) if n else 0.0, float(x.var(unbiased=False)) if n else 0.0]

        row = [float(len(episodes)), sum(e[0] for e in episodes), sum(e[1] for e in episodes),
               float(nonfinite_env), float(advantages_nonfinite),
               *moments(returns), *moments(returns - values_old), *moments(rewards), *moments(advantages)]
        rows = self._gather(row)  # [K, 17]
        nan = float("nan")
        n_ep = float(rows[:, 0].sum())

        def merged(col: int) -> tuple[float, float]:
            n, _, var = combine_moments(rows[:, col], rows[:, col + 1], rows[:, col + 2])
            return float(n), float(var)

        n_y, var_y = merged(5)
        _, var_d = merged(8)
        n_r, var_r = merged(11)
        n_a, var_a = merged(14)
        return {
            S.EPISODIC_RETURN: float(rows[:, 1].sum()) / n_ep if n_ep else nan,
            S.EPISODIC_LENGTH: float(rows[:, 2].sum()) / n_ep if n_ep else nan,
            S.EPISODES: n_ep,
            S.NONFINITE_ENV: float(rows[:, 3].sum()),
            S.ADVANTAGES_NONFINITE: float(rows[:, 4].sum()),
            S.EXPLAINED_VARIANCE: 1.0 - var_d / var_y if n_y > 1 and var_y > 0 else nan,
            S.REWARD_STD: (var_r * n_r / (n_r - 1)) ** 0.5 if n_r > 1 else nan,
            S.ADVANTAGE_STD: (var_a * n_a / (n_a - 1)) ** 0.5 if n_a > 1 else nan,
        }

    def after_update(self, policy: torch.nn.Module, update_idx: int) -> None:
        """With ``PPOKIT_DIST_CHECKSUMS`` set: rank 0 appends every rank's digest of its parameters and
        normalizer statistics for this update."""
        if not (self.active and self.checksums):
            return
        h = hashlib.sha256()
        for t in [*policy.parameters(), *(x for rms in self._stats for x in (rms.mean, rms.var, rms.count))]:
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        data = h.digest()
        digest = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = self._gather_tensor(digest.to(torch.int64))
        if self.is_main:
            line = " ".join(bytes(row.to(torch.uint8).tolist()).hex() for row in gathered)
            with open(self.checksums, "a") as f:
                f.write(f"{update_idx} {line}\n")

    # ------------------------------------------------------------------ the language-model trainers
    def shard(self, items: list[Any], what: str = "batch_prompts") -> list[Any]:
        """This rank's contiguous share of ``items`` (every rank holds the same list): the prompts it generates
        for. Whole prompts are split, so a GRPO group (a prompt's completions) never spans two ranks."""
        if not self.active:
            return items
        if len(items) % self.world_size:
            raise ValueError(f"{what}: {len(items)} does not split evenly over {self.world_size} ranks; use a "
                             f"multiple of {self.world_size} (every rank must run the same number of minibatches)")
        k = len(items) // self.world_size
        return items[self.rank * k:(self.rank + 1) * k]

    def global_std(self, x: Tensor) -> float | None:
        """Population std of every rank's ``x`` together (what batch-level whitening needs); None in one
        process, where the caller's own computation stands."""
        if not self.active:
            return None
        x = x.detach().to(torch.float64).reshape(-1)
        row = torch.tensor([float(x.numel()), float(x.mean()), float(x.var(unbiased=False))], dtype=torch.float64)
        rows = self._gather_tensor(row).cpu()
        _, _, var = combine_moments(rows[:, 0], rows[:, 1:2], rows[:, 2:3])
        return float(var[0]) ** 0.5

    def whiten(self, x: Tensor, mask: Tensor) -> Tensor:
        """``advantages.normalize(x, mask=mask)`` with the mean and std of the counted entries of every rank
        (PPO-RLHF's masked whitening); in one process exactly that call."""
        from ppokit.core.advantages import SPREAD_ULPS, normalize

        if not self.active:
            return normalize(x, mask=mask)
        keep = mask if mask.dtype == torch.bool else mask != 0
        vals = x[keep].detach().to(torch.float64)
        n = vals.numel()
        row = torch.tensor([float(n), float(vals.mean()) if n else 0.0, float(vals.var(unbiased=False)) if n else 0.0],
                           dtype=torch.float64)
        rows = self._gather_tensor(row).cpu()
        _, mean, var = combine_moments(rows[:, 0], rows[:, 1:2], rows[:, 2:3])
        mean, std = float(mean[0]), float(var[0]) ** 0.5
        noise = std <= SPREAD_ULPS * torch.finfo(x.dtype).eps * abs(mean)  # normalize's constant rule
        return torch.where(keep & (not noise), (x - mean) / (std + 1e-8), 0.0).to(x.dtype)

    # ------------------------------------------------------------------ normalizers
    def merge_moments(self, n: int, mean: Tensor, var: Tensor) -> tuple[int, Tensor, Tensor]:
        """``RunningMeanStd.reduce``: this step's batch moments merged with every rank's (one all-gather)."""
        row = torch.cat([torch.tensor([float(n)], dtype=torch.float64, device=mean.device),
                         mean.reshape(-1).to(torch.float64), var.reshape(-1).to(torch.float64)])
        rows = self._gather_tensor(row)
        d = mean.numel()
        total, mu, v = combine_moments(rows[:, 0], rows[:, 1:1 + d], rows[:, 1 + d:])
        return int(total), mu.reshape(mean.shape), v.reshape(var.shape)

    # ------------------------------------------------------------------ collectives
    def _reduce(self, values: list[float], op: Any = None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        with self._guard("agreeing on the update"):
            torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
        return t.tolist()

    def _gather(self, values: list[float]) -> Tensor:
        return self._gather_tensor(torch.tensor(values, dtype=torch.float64)).cpu()

    def _gather_tensor(self, t: Tensor) -> Tensor:
        """``[K, *t.shape]``: every rank's ``t``, in rank order."""
        t = t.to(self._comm_device())
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        with self._guard("gathering statistics"):
            torch.distributed.all_gather(out, t)
        return torch.stack(out)

    def _comm_device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    def _guard(self, what: str) -> "_Guard":
        return _Guard(self, what)

    def lost_ranks(self) -> str:
        """Which ranks are gone, as far as this host can tell from their processes, in words."""
        here = socket.gethostname()
        state = {r: _proc_state(pid) for r, (host, pid) in enumerate(self.peers) if r != self.rank and host == here}
        exited = [r for r, st in state.items() if st is None]
        stopped = [r for r, st in state.items() if st == "T"]
        remote = [r for r, (host, _) in enumerate(self.peers) if host != here]
        of = f" of {self.world_size}"
        if exited:
            return "lost rank " + ", ".join(map(str, exited)) + f" (its process exited){of}"
        if stopped:
            return "lost rank " + ", ".join(map(str, stopped)) + f" (its process is stopped, not answering){of}"
        if remote:
            return f"lost contact with rank(s) on other hosts ({', '.join(map(str, remote))}){of}"
        return f"got no answer from rank(s) {', '.join(map(str, state))}{of} (their processes still run)"


class _Guard:
    """Turns a failed collective into one ``DistributedError`` line naming the lost rank."""

    def __init__(self, dist: Dist, what: str):
        self.dist, self.what = dist, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or isinstance(exc, (DistributedError, KeyboardInterrupt)) or not isinstance(exc, Exception):
            return False
        # A peer killed by kill -9 closes its sockets before the kernel marks it exited: gloo's error can come
        # first, and /proc still says "running". Give its exit a moment to show (polled, bounded).
        deadline = time.monotonic() + _EXIT_SETTLE_S
        while "still run" in self.dist.lost_ranks() and time.monotonic() < deadline:
            time.sleep(0.05)
        # gloo's own text (addresses, file:line) stays on the chained exception, out of the one line.
        raise DistributedError(f"distributed: rank {self.dist.rank} {self.dist.lost_ranks()} while {self.what}",
                               peer_exited=bool(self.dist._exited_peers())) from exc


_EXIT_SETTLE_S = 10.0  # how long a failed collective waits for a peer's exit to show in /proc (bounded: a loaded
# machine can take seconds to finish tearing a killed process down)


def _proc_state(pid: int) -> str | None:
    """Process ``pid``'s state letter on this host (``R``, ``S``, ``T`` stopped, ...), None once it has exited
    (a zombie, killed but not yet reaped, has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            letter = f.read().rsplit(")", 1)[1].split()[0]
        return None if letter in ("Z", "X") else letter
    except (OSError, IndexError):  # no /proc (not Linux): signal 0 tells alive from gone
        try:
            os.kill(pid, 0)
            return "R"
        except OSError:
            return None


LOCAL = Dist()
_CURRENT: Dist | None = None
_OWNED = False  # whether ppokit initialized the process group (and so destroys it at exit)


def current(timeout_s: float = 60.0, device: str = "cpu") -> Dist:
    """This process's ``Dist``: ``LOCAL`` unless it is one of several ranks, when the process group is joined
    once (gloo on CPU, nccl for CUDA) with ``timeout_s`` as every collective's deadline.

    Started by torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` set), ppokit
    joins the group itself and leaves it at exit; a group the caller initialized is used as it is and left alone.
    """
    global _CURRENT, _OWNED
    if _CURRENT is not None:
        return _CURRENT
    import torch.distributed as dist

    joined = dist.is_available() and dist.is_initialized()
    if not (launched() or joined):
        return LOCAL
    if not joined:
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            # Started by torchrun's agent, in a session of its own (torch.distributed.elastic's Popen): a SIGKILL
            # of the agent's process group does not reach this rank, which would train on, orphaned (measured: both
            # ranks of a killed launch ran on). It dies with the agent instead; the agent's own stops (a signal
            # passed on, its shutdown timeout) wait for the ranks before it exits, so they are not cut short.
            from ppokit.envs.watchdog import die_with_parent

            die_with_parent(None)
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=float(timeout_s)))
        except Exception as exc:  # noqa: BLE001 - one line, whatever the rendezvous raised
            raise DistributedError(f"distributed: rank {rank} of {world} could not join the process group within "
                                   f"{timeout_s:g} s (dist_timeout): {' '.join(str(exc).split())[:300]}") from exc
        _OWNED = True
        atexit.register(shutdown)
    if dist.get_world_size() == 1:
        return LOCAL
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, (socket.gethostname(), os.getpid()))
    checksums = os.environ.get(CHECKSUMS_VAR) or None
    _CURRENT = Dist(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")), backend=str(dist.get_backend()),
                    peers=list(out), checksums=Path(checksums) if checksums else None,
                    no_sync=os.environ.get(NO_SYNC_VAR, "") not in ("", "0"), timeout_s=float(timeout_s))
    return _CURRENT


def shutdown() -> None:
    """Leave the process group cleanly: collect first (a collected wrapper finalizing after the group is gone
    crashed one rank in six at exit in the prototype), then ``destroy_process_group``. Safe to call twice."""
    global _CURRENT, _OWNED
    import torch.distributed as dist

    _CURRENT = None
    gc.collect()
    if _OWNED and dist.is_available() and dist.is_initialized():
        _OWNED = False
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - at exit; the run's files are written
            print(f"warning: distributed teardown: {type(exc).__name__}: {exc}", file=sys.stderr)
