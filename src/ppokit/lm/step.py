"""The ``epochs.UpdateStep`` of the language-model trainers: autograd over token minibatches.

``epochs.ppo_epochs`` drives it exactly as it drives the Gymnasium trainer's ``autograd.AutogradStep``, so the
shuffle, the minibatch split, the non-finite skip and the KL early stop (approx KL to pi_old >
``KL_STOP_FACTOR * target_kl``: the minibatch is not applied and the epochs end) are the same code. Rows of a
minibatch are completions; the loss is a ``TokenLoss``: ``loss_fn(mb) -> (loss, stats)`` with ``stats`` holding
every ``epochs.STAT_NAMES`` entry but ``grad_norm`` as 0-dim tensors, plus any extra named diagnostics, which are
averaged over the applied minibatches into ``extra_means()``.

Micro-batches (``LMConfig.micro_batch_size``): a minibatch's forward and backward run over consecutive row slices,
the gradients accumulating in ``.grad``. The loss is a mean, so each slice's loss is weighted by its ``Share`` of
the minibatch's normalizer: a token mean by its share of the mask's sum, a mean over sequences by its share of the
non-empty rows (grpo's and dr_grpo's reductions), a sum over a constant (dapo's) by 1. The sum of the weighted
slice losses is then the minibatch's loss, term by term, and so is its gradient (to rounding;
tests/test_lm_micro_batch.py), while the largest ``[rows, R, V]`` tensor alive is one slice's.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from ppokit.lm.logprobs import micro_slices
from ppokit.lm.precision import Precision
from ppokit.lm.rollout import TokenBatch
from ppokit.update.autograd import AutogradGuards
from ppokit.update.epochs import STAT_NAMES, MinibatchResult, UpdateSettings

__all__ = ["TokenStep", "TokenLoss", "Share", "WHOLE", "split_micro", "weigh_stats"]

# The reductions that are a sum over a constant (``losses.LOSS_TYPES``' dapo): a slice's sum is its share already.
_CONSTANT_NORMALIZER = ("dapo",)
_TOKEN_MEANS = ("mean", "token_mean")


@dataclass(frozen=True)
class Share:
    """A micro-batch's weight in its minibatch's loss: ``tokens`` its response tokens over the minibatch's,
    ``rows`` its non-empty rows over the minibatch's (0-dim tensors, or 1.0 for the whole minibatch)."""

    tokens: Tensor | float = 1.0
    rows: Tensor | float = 1.0

    def of(self, reduction: str) -> Tensor | float:
        """The weight of a loss reduced by ``reduction`` (a ``core.reductions`` mode, or dapo)."""
        if reduction in _CONSTANT_NORMALIZER:
            return 1.0
        if reduction in _TOKEN_MEANS:
            return self.tokens
        return self.rows  # seq_mean_token_mean, seq_mean_token_sum_norm: means over the non-empty sequences


WHOLE = Share()

TokenLoss = Callable[[TokenBatch, Share], tuple[Tensor, dict[str, Tensor]]]


def split_micro(mb: TokenBatch, size: int | None) -> Iterator[tuple[TokenBatch, Share]]:
    """``mb``'s consecutive row slices of ``size`` rows with their ``Share``; ``(mb, WHOLE)`` when one slice."""
    slices = micro_slices(len(mb), size)
    if len(slices) == 1:
        yield mb, WHOLE
        return
    tokens = mb.response_mask.sum(-1)  # [B]
    all_tokens = tokens.sum().clamp(min=1).float()
    all_rows = (tokens > 0).sum().clamp(min=1).float()
    for s in slices:
        yield (mb.map(lambda t, s=s: t[s]),
               Share(tokens=tokens[s].sum() / all_tokens, rows=(tokens[s] > 0).sum() / all_rows))


def weigh_stats(stats: dict[str, Tensor], share: Share, reduction: str) -> dict[str, Tensor]:
    """Each diagnostic times its share: ``policy_loss`` is reduced like the loss, every other one is a token mean
    (approx KL, clip fraction, entropy, value loss, KL to pi_ref), so summing over the micro-batches gives the
    minibatch's value."""
    if share is WHOLE:
        return stats
    return {name: v * share.of(reduction if name == "policy_loss" else "token_mean") for name, v in stats.items()}


class TokenStep(AutogradGuards):
    """Backpropagates ``loss_fn`` into ``params``' ``.grad``, clips the global norm, steps ``optimizer``.

    ``device``: where a minibatch is moved before its forward pass (with ``offload_rollout`` the rollout lives in
    CPU memory and only one minibatch at a time is on the device).
    """

    def __init__(self, loss_fn: TokenLoss, optimizer: torch.optim.Optimizer, device: torch.device,
                 max_grad_norm: float, micro_batch_size: int | None = None, precision: Precision | None = None):
        self.loss_fn = loss_fn
        self.micro_batch_size = micro_batch_size
        self.precision = precision if precision is not None else Precision("fp32", device)
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.batch: TokenBatch | None = None
        self._extra_totals: dict[str, Tensor] = {}
        self._extra_n = 0

    @contextmanager
    def update(self, batch: TokenBatch, settings: UpdateSettings) -> Iterator[None]:
        self.batch = batch
        self._extra_totals, self._extra_n = {}, 0
        try:
            yield
        finally:
            self.batch = self._loss = self._stats = None

    def minibatches(self, perm: Tensor, sizes: list[int]) -> Iterator[TokenBatch]:
        for idx in torch.split(perm, sizes):
            yield self.batch.index(idx).to(self.device)

    def backward(self, mb: TokenBatch) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        loss_total: Tensor | None = None
        stats_total: dict[str, Tensor] = {}
        for part, share in split_micro(mb, self.micro_batch_size):
            with self.precision.autocast():  # the forward only: the backward runs outside autocast
                loss, stats = self.loss_fn(part, share)  # weighted by its share of the minibatch's normalizer
            # A slice without a single response token has a constant loss (no graph): its gradient is zero.
            if loss.requires_grad:
                self.precision.backward(loss)
            loss_total = loss.detach() if loss_total is None else loss_total + loss.detach()
            for name, v in stats.items():
                stats_total[name] = v.detach() if name not in stats_total else stats_total[name] + v.detach()
        self._loss, self._stats = loss_total, stats_total

    def measure(self) -> MinibatchResult:
        self.precision.unscale(self.optimizer)  # fp16: the true gradients before the clip and the guards
        grad_norm, loss_v, grad_v, kl_v = self.clip_and_read(self.max_grad_norm)
        stats = {name: self._stats[name] for name in STAT_NAMES if name != "grad_norm"}
        stats["grad_norm"] = grad_norm.detach()
        return MinibatchResult(loss=loss_v, grad_norm=grad_v, approx_kl=kl_v, stats=stats)

    def discard(self) -> None:
        super().discard()
        self.precision.skipped()

    def apply(self, result: MinibatchResult) -> None:
        self.precision.step(self.optimizer)
        for name, value in self._stats.items():
            if name not in STAT_NAMES:
                self._extra_totals[name] = self._extra_totals.get(name, 0.0) + value.detach()
        self._extra_n += 1

    def extra_means(self) -> dict[str, float]:
        """Mean of each extra diagnostic over the applied minibatches of the last update (NaN when none)."""
        if self._extra_n == 0:
            return {name: float("nan") for name in self._extra_totals}
        return {name: float(total) / self._extra_n for name, total in self._extra_totals.items()}
