"""Mixed precision for the LM trainers (``LMConfig.dtype``): autocast forwards over float32 master weights.

``bf16`` / ``fp16`` run every forward pass (sampling, pi_old, pi_ref, the values, the update's) under
``torch.autocast``, so the matmuls run in half precision, while the trainable parameters stay (or are made)
float32 and AdamW steps them in float32: a step below a bf16 weight's rounding unit (about 0.4% of the weight) is
kept, not rounded away (issue 21: a bf16 model trained in bf16 at lr 1e-6 changed 1.4% of its weights in 8 steps,
75% in float32). The log-softmax, the entropy and the losses upcast to float32 (``logprobs``). ``fp16``'s narrow
range underflows small gradients, so its losses are scaled by ``torch.amp.GradScaler`` (Micikevicius et al. 2018,
"Mixed Precision Training"), unscaled before the norm clip; a step the scaler finds non-finite is the epoch loop's
non-finite skip, and the scale is lowered for the next. ``fp32``: no autocast, nothing changes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor, nn

__all__ = ["DTYPES", "Precision", "autocast_problem", "float32_master_weights"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_problem(device: str, dtype: str) -> str | None:
    """Why ``device`` cannot autocast to ``dtype`` (one line), or None: a small matmul is tried under autocast
    and must come out in that dtype (fp16 also needs a ``GradScaler`` for the device)."""
    if dtype == "fp32":
        return None
    kind = torch.device(device).type
    want = DTYPES[dtype]
    try:
        with torch.autocast(kind, dtype=want):
            out = torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        if dtype == "fp16":
            torch.amp.GradScaler(kind)
    except (RuntimeError, ValueError, TypeError, AssertionError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"{dtype} autocast is not available on {device} in this torch ({first}); use bf16 or fp32"
    if out.dtype != want:
        return f"{dtype} autocast does not run matmuls in {dtype} on {device} in this torch; use bf16 or fp32"
    return None


def float32_master_weights(model: nn.Module) -> int:
    """Every trainable bfloat16 / float16 parameter of ``model`` made float32 in place (the autocast master
    weights; frozen ones, e.g. a LoRA base, stay as they are); returns how many were cast."""
    cast = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16):
            p.data = p.data.float()
            cast += 1
    return cast


class Precision:
    """The forward context, the backward and the optimizer step of one trainer's ``dtype`` (``fp32``: plain)."""

    def __init__(self, dtype: str, device: torch.device):
        self.name = dtype
        self.dtype = DTYPES[dtype]
        self.device_type = device.type
        self.enabled = dtype != "fp32"
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None
        self._unscaled = False  # unscale_ ran since the last step: update() has an Inf check to read

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Forward passes inside run under autocast (nothing with fp32); backward passes belong outside."""
        if not self.enabled:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def backward(self, loss: Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients back to their true size (fp16), before they are clipped or read."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled = False

    def skipped(self) -> None:
        """A step not applied (non-finite, or the KL early stop): fp16 lowers its scale if it found an Inf."""
        if self.scaler is not None and self._unscaled:
            self.scaler.update()
            self._unscaled = False

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
