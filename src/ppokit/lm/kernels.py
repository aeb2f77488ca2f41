"""Faster kernels for the same function, swapped into a model's modules in place (``LMConfig.fused_activations``).

``transformers``' ``NewGELUActivation`` (``gelu_new``: GPT-2, GPT-J, CodeGen, ...) writes the tanh approximation of
GELU, ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``, as eight elementwise tensor ops (each a pass over the
``[B, L, 4d]`` activations, in the forward and again in the backward). torch computes the same formula in one
kernel, ``gelu(x, approximate="tanh")``, which is what transformers' own ``GELUTanh`` uses ("equivalent to NewGELU
and FastGELU but much faster; not an exact numerical match due to rounding errors"); measured on the demo's tiny
GPT-2: at most 2.4e-7 apart, and ~10% off a GRPO iteration on one CPU thread. The weights and the saved model are
untouched (``save_pretrained`` still writes ``gelu_new``; a reloaded model computes the same function to rounding).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FusedTanhGELU", "fuse_activations"]


class FusedTanhGELU(nn.Module):
    """``gelu(x, approximate="tanh")`` in one kernel: the function of ``NewGELUActivation``."""

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")


def _is_new_gelu(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "NewGELUActivation" and cls.__module__ == "transformers.activations"


def fuse_activations(model: nn.Module) -> int:
    """Replace every ``NewGELUActivation`` inside ``model`` by ``FusedTanhGELU``; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_new_gelu(child):
                setattr(parent, name, FusedTanhGELU())
                replaced += 1
    return replaced
