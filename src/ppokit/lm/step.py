"""The ``epochs.UpdateStep`` of the language-model trainers: autograd over token minibatches.

``epochs.ppo_epochs`` drives it exactly as it drives the Gymnasium trainer's ``autograd.AutogradStep``, so the
shuffle, the minibatch split, the non-finite skip and the KL early stop (approx KL to pi_old >
``KL_STOP_FACTOR * target_kl``: the minibatch is not applied and the epochs end) are the same code. Rows of a
minibatch are completions; the loss is a ``TokenLoss``: ``loss_fn(mb) -> (loss, stats)`` with ``stats`` holding
every ``epochs.STAT_NAMES`` entry but ``grad_norm`` as 0-dim tensors, plus any extra named diagnostics, which are
averaged over the applied minibatches into ``extra_means()``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import Tensor

from ppokit.lm.rollout import TokenBatch
from ppokit.update.autograd import AutogradGuards
from ppokit.update.epochs import STAT_NAMES, MinibatchResult, UpdateSettings

__all__ = ["TokenStep", "TokenLoss"]

TokenLoss = Callable[[TokenBatch], tuple[Tensor, dict[str, Tensor]]]


class TokenStep(AutogradGuards):
    """Backpropagates ``loss_fn`` into ``params``' ``.grad``, clips the global norm, steps ``optimizer``.

    ``device``: where a minibatch is moved before its forward pass (with ``offload_rollout`` the rollout lives in
    CPU memory and only one minibatch at a time is on the device).
    """

    def __init__(self, loss_fn: TokenLoss, optimizer: torch.optim.Optimizer, device: torch.device,
                 max_grad_norm: float):
        self.loss_fn = loss_fn
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
        self._loss, self._stats = self.loss_fn(mb)
        self.optimizer.zero_grad(set_to_none=False)
        # A minibatch without a single response token has a constant loss (no graph): its gradient is zero.
        if self._loss.requires_grad:
            self._loss.backward()

    def measure(self) -> MinibatchResult:
        grad_norm, loss_v, grad_v, kl_v = self.clip_and_read(self.max_grad_norm)
        stats = {name: self._stats[name] for name in STAT_NAMES if name != "grad_norm"}
        stats["grad_norm"] = grad_norm.detach()
        return MinibatchResult(loss=loss_v, grad_norm=grad_v, approx_kl=kl_v, stats=stats)

    def apply(self, result: MinibatchResult) -> None:
        self.optimizer.step()
        for name, value in self._stats.items():
            if name not in STAT_NAMES:
                self._extra_totals[name] = self._extra_totals.get(name, 0.0) + value.detach()
        self._extra_n += 1

    def extra_means(self) -> dict[str, float]:
        """Mean of each extra diagnostic over the applied minibatches of the last update (NaN when none)."""
        if self._extra_n == 0:
            return {name: float("nan") for name in self._extra_totals}
        return {name: float(total) / self._extra_n for name, total in self._extra_totals.items()}
