"""The K-epoch loop of one PPO update, written once for every way of computing a minibatch's gradient.

``ppo_epochs`` owns what does not depend on how the gradient is computed: the per-epoch shuffle, the minibatch
split, the two guards checked before each optimizer step (the non-finite skip and KL early stopping) and the
means of the diagnostics over the minibatches that were applied. How one minibatch's loss, gradient and
diagnostics are computed, and how its step is applied, is an ``UpdateStep``: ``autograd.AutogradStep`` (eager
autograd, the reference, any policy and objective) and ``fused_step.FusedStep`` (the hand-derived MLP backward on
``FlatAdam``'s flat buffer) implement it.

The loop is exactly the one both paths ran before it was shared, so a fixed-seed run computes the same numbers
bit for bit (``tests/test_bit_identity.py``): one ``torch.randperm`` per epoch from ``generator`` (drawn even when
there is one minibatch), minibatch sizes as ``torch.tensor_split`` makes them, statistics summed in the type the
step returns them in (device tensors for autograd, host floats for the fused step) starting from ``0.0``.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

import torch
from torch import Tensor

from ppokit.core.batch import Field, Schema, TensorBatch

__all__ = ["Batch", "SequenceBatch", "BATCH_FIELDS", "SEQUENCE_FIELDS", "UpdateSettings", "MinibatchResult", "UpdateStep", "SyncHook", "ppo_epochs", "minibatch_sizes",
           "kl_stops", "KL_STOP_FACTOR", "STAT_NAMES"]

# The diagnostics every step reports per minibatch; the update returns their means over the applied minibatches.
STAT_NAMES = ("policy_loss", "value_loss", "entropy", "approx_kl", "approx_kl_k1", "clipfrac", "grad_norm")

# Early stopping fires when a minibatch's approx KL exceeds KL_STOP_FACTOR x target_kl (SB3's margin): it lets the
# KL fluctuate around its target without stopping every update. Defined once, in the schema.
from ppokit.core.algos import UpdateSettings  # noqa: E402,F401  (the epoch loop's settings; importable from here)
from ppokit.core.schema import KL_STOP_FACTOR  # noqa: E402


def _mask_shape(dims: Mapping[str, Any]) -> tuple[int, ...] | None:
    return None if dims.get("mask_dim") is None else (dims["mask_dim"],)


def _if_stateful(dims: Mapping[str, Any]) -> tuple[int, ...] | None:
    return None if dims.get("policy_state") is None else ()


# The minibatch's fields, each declared once (per step; a flat batch is [B, ...], a sequence minibatch [L, M, ...]).
# The rollout buffer stores its carried fields under these declarations (``rollout.buffer``). ``dims`` of a run:
# ``obs`` (the encoder's layout), ``action_shape``, ``action_dtype``, ``mask_dim`` (None: no action masks),
# ``policy_state`` (the layout of one step of the policy's state; None: a stateless policy).
BATCH_FIELDS = Schema(
    Field("obs", lambda d: d["obs"], None, doc="float32 [obs_dim] | uint8 [C, H, W] | {key: one of those}"),
    Field("actions", lambda d: d["action_shape"], lambda d: d["action_dtype"], doc="long [] | [k] | float [D]"),
    Field("logp_old", doc="log pi_old(a|s), frozen at rollout time"),
    Field("values_old", doc="V at rollout time (for value clipping)"),
    Field("advantages", doc="GAE advantages, constants"),
    Field("returns", doc="value targets, constants"),
    Field("action_mask", _mask_shape, torch.bool, optional=True,
          doc="[n_logits] the actions allowed at acting time (masked envs only)"),
    Field("episode_start", _if_stateful, torch.bool, optional=True,
          doc="the observation is an episode's first (stateful policies only)"),
)


class Batch(TensorBatch):
    """A flat batch of ``B`` transitions (the rollout's valid steps, time and env axes merged): ``BATCH_FIELDS``,
    each ``[B, ...]``."""

    schema = BATCH_FIELDS


# A sequence minibatch: every field of a Batch as [L, M, ...] (M whole env chunks of L steps), plus these.
SEQUENCE_FIELDS = Schema(
    Field("mask", (), torch.bool, doc="[L, M] a valid step and not padding: what enters the loss"),
    Field("state0", lambda d: d.get("policy_state"), None, optional=True, per_step=False,
          doc="[M, ...] per tensor: the policy's state passed into act at each chunk's first step"),
    base=BATCH_FIELDS,
)


class SequenceBatch(Batch):
    """``M`` chunks of whole env sequences, time-major: ``SEQUENCE_FIELDS``. ``len`` counts chunks and ``index``
    selects chunks (axis 1 of the per-step fields, axis 0 of ``state0``)."""

    schema = SEQUENCE_FIELDS
    row_dim = 1


@dataclass
class MinibatchResult:
    """What a step measured on one minibatch, before its optimizer step.

    ``loss``, ``grad_norm`` (L2 norm of the whole gradient, before clipping) and ``approx_kl`` (k3 of pi_theta vs
    pi_old on this minibatch's forward pass) are host floats: the loop's guards read them. ``stats`` maps every
    name of ``STAT_NAMES`` to a 0-dim tensor or a float; the loop sums them as they are.
    """

    loss: float
    grad_norm: float
    approx_kl: float
    stats: dict[str, Any]


class UpdateStep(Protocol):
    """One way of computing and applying a minibatch's gradient step; ``ppo_epochs`` drives it.

    Per update the loop enters ``update(batch, settings)`` once and runs every epoch inside it. Per minibatch it
    calls, in this order::

        backward(mb)         # forward + backward: the unclipped gradient in place, the diagnostics on the device
        sync(gradients(), sync_stats())  # only when a sync hook is given (see ``SyncHook``)
        measure()            # gradient norm + ONE host read -> MinibatchResult
        apply(result)        # clip to max_grad_norm and step the optimizer  ... or, instead,
        discard()            # drop the gradient (a skipped or a KL-stopping minibatch is not applied)

    ``minibatches(perm, sizes)`` yields the minibatches of one epoch: rows ``perm[:sizes[0]]``, then the next
    ``sizes[1]``, ... in the step's own form (how it gathers them is its business, the rows are the loop's).
    """

    def update(self, batch: Batch, settings: UpdateSettings) -> AbstractContextManager: ...

    def minibatches(self, perm: Tensor, sizes: list[int]) -> Iterable[Any]: ...

    def backward(self, mb: Any) -> None: ...

    def gradients(self) -> list[Tensor]: ...

    def sync_stats(self) -> list[Tensor]: ...

    def measure(self) -> MinibatchResult: ...

    def apply(self, result: MinibatchResult) -> None: ...

    def discard(self) -> None: ...


SyncHook = Callable[[list[Tensor], list[Tensor]], None]
"""``sync(gradients, stats)``: the single place where a data-parallel run makes its ranks agree.

Called once per minibatch after the step's backward and before anything is read or decided: it must replace, in
place, every tensor of ``gradients`` (the step's unclipped gradient) and of ``stats`` (the device tensors the
guards and diagnostics are read from: the loss, the approx KL, ...) by its mean over the ranks (an all-reduce).
The gradient norm, the clip and both guards are then computed from the reduced tensors, so every rank takes the
same skip / stop / step decision without a separate vote: a non-finite value on any rank makes the mean
non-finite everywhere (all skip), and the KL compared with target_kl is the mean over ranks (all stop). With
equal per-rank minibatch sizes the means equal those of the global minibatch. ``None`` (the default) runs
nothing.
"""


def kl_stops(approx_kl: float, target_kl: float | None) -> bool:
    """KL early stopping's test: ``approx_kl > KL_STOP_FACTOR * target_kl`` (never without a target)."""
    return target_kl is not None and approx_kl > KL_STOP_FACTOR * target_kl


def minibatch_sizes(n: int, parts: int) -> list[int]:
    """Non-empty chunk sizes of ``torch.tensor_split(range(n), parts)``: the first ``n % parts`` hold one more."""
    base, extra = divmod(n, parts)
    return [size for size in (base + (1 if i < extra else 0) for i in range(parts)) if size > 0]


def ppo_epochs(batch: Batch, settings: UpdateSettings, step: UpdateStep, sync: SyncHook | None = None,
               generator: torch.Generator | None = None) -> dict[str, float]:
    """Run the update's epochs of shuffled minibatches over ``batch`` with ``step``; return named diagnostics.

    Guards on every minibatch, checked after its backward pass (and ``sync``) and before its optimizer step:

    * a non-finite loss, gradient norm or approx KL skips the minibatch (no NaN reaches the weights). The KL
      counts because an overflowing ratio (``logp_new - logp_old > 88`` in float32) can leave the clipped loss
      finite while ``r`` itself is Inf;
    * with ``target_kl`` set, KL early stopping as in Stable-Baselines3: when the minibatch's approx KL (k3 of
      pi_theta vs pi_old, measured on its own forward pass) exceeds ``KL_STOP_FACTOR * target_kl``, that
      minibatch is NOT applied and the remaining minibatches and epochs are dropped.

    Returns the mean of each of ``STAT_NAMES`` over the minibatches that were applied (NaN when none was), and
    the counters ``minibatches`` (applied), ``skipped_minibatches``, ``epochs_run`` and ``early_stopped`` (0/1),
    all floats. ``generator`` drives the shuffle (the global torch RNG when None).
    """
    B = len(batch)
    sizes = minibatch_sizes(B, settings.num_minibatches)
    totals: dict[str, Any] = dict.fromkeys(STAT_NAMES, 0.0)
    n_done, n_skipped, epochs_run, early_stopped = 0, 0, 0, False
    with step.update(batch, settings):
        for epoch in range(settings.update_epochs):
            epochs_run = epoch + 1
            perm = torch.randperm(B, device=batch.logp_old.device, generator=generator)
            for mb in step.minibatches(perm, sizes):
                step.backward(mb)
                if sync is not None:
                    sync(step.gradients(), step.sync_stats())
                result = step.measure()
                if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)
                        and math.isfinite(result.approx_kl)):
                    n_skipped += 1
                    step.discard()
                    continue
                if kl_stops(result.approx_kl, settings.target_kl):
                    # Stop BEFORE this step: the minibatch that left the trust region is not applied.
                    step.discard()
                    early_stopped = True
                    break
                step.apply(result)
                for name in STAT_NAMES:
                    totals[name] = totals[name] + result.stats[name]
                n_done += 1
            if early_stopped:
                break
    out = _means(totals, n_done)
    out.update(minibatches=float(n_done), skipped_minibatches=float(n_skipped), epochs_run=float(epochs_run),
               early_stopped=float(early_stopped))
    return out


def _means(totals: dict[str, Any], n: int) -> dict[str, float]:
    """``total / n`` per name as floats (NaN when nothing was applied); tensors are read in one host transfer."""
    if n == 0:
        return dict.fromkeys(totals, float("nan"))
    means = {name: total / n for name, total in totals.items()}
    tensors = [name for name, v in means.items() if isinstance(v, Tensor)]
    if tensors:
        for name, v in zip(tensors, torch.stack([means[name] for name in tensors]).tolist()):
            means[name] = v
    return {name: float(v) for name, v in means.items()}
