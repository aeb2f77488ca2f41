"""FSDP2 for the LM trainers (``LMConfig.fsdp``): the policy, pi_ref and the critic sharded over the ranks.

Under torchrun (or ``ppokit lm ALGO --nproc K``, which starts torchrun through ``runtime.launcher``) each model is wrapped by torch's ``fully_shard`` (FSDP2, Zhao et al. 2023,
"PyTorch FSDP") per transformer block (the classes the model lists in ``_no_split_modules``: ``LlamaDecoderLayer``,
``GPT2Block``), then at its root (embeddings, final norm, LM head). Each rank keeps ``1/K`` of every parameter as
a ``DTensor`` shard, so AdamW's two moments and the gradient are ``1/K`` too; a block's full weights exist only
during its forward and backward (all-gathered, then freed), and its gradient is reduce-scattered (averaged over
the ranks) by FSDP in the backward. The trainers' data-parallel ``sync`` then averages the guards' statistics
alone (``Dist.stats_sync``): gradients are never reduced twice.

``dtype bf16``: FSDP's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: blocks all-gather and compute
in bf16, gradients are reduced in float32 into the float32 shards that AdamW steps (master weights). fp16 is
refused (its ``GradScaler`` is not wired for sharded gradients here).

Gradient checkpointing (``gradient_checkpointing``): transformers' own, per block, non-reentrant
(``base.enable_checkpointing``, which says why it composes with ``fully_shard`` and torch's ``checkpoint_wrapper``
would not fit): a block's activations are recomputed in its backward, after FSDP's pre-backward all-gather.

CPU offload (``fsdp_offload``): FSDP2's ``CPUOffloadPolicy``: the shards, their gradients and so AdamW's moments
(the optimizer is built on the sharded parameters) live in host memory; a block's shards are copied to the device
for its all-gather and its gradient back after its reduce-scatter, and AdamW steps on the CPU. It frees the device
of ``16 N / K`` bytes per rank (fp32 with AdamW) for host memory and PCIe traffic; on a CPU-only machine nothing
moves and the run is the same.

LoRA: the peft adapter is applied before ``shard``, so its matrices are parameters of the blocks they sit in and
are sharded with the frozen base weights (FSDP2 shards each parameter on its own, trainable or not); only the
adapter has gradients and AdamW states. pi_ref stays the sharded policy with its adapter disabled.

Generation: ``gathered(model)`` all-gathers every block's full weights once before sampling and frees them after.
A rank then samples without any collective, so ranks whose completions end at different steps do not wait for one
another (sampling with the sharded module would all-gather per block at every token, and a rank that stopped
early would leave the others blocked in the next all-gather). It holds one full copy of the policy's weights per
rank for the rollout, as verl's and OpenRLHF's rollout engines do.

Checkpoints are sharded (``lm.sharded_checkpoint``): every rank writes its own shards of the policy, PPO's critic
and AdamW's moments with ``torch.distributed.checkpoint`` into a directory that ``trainer_state.pt`` (the small host
state) names once it is whole, so no rank holds the whole model at a save and a kill -9 leaves the previous
checkpoint. A resume loads them on any number of ranks, or in one process (DCP reshards on load). The last save of
a ``train`` call also gathers the whole weights to rank 0, one tensor at a time, for ``policy/`` (``save_pretrained``,
which ``from_pretrained`` loads in one process); the periodic saves skip it. A checkpoint of the consolidated
format (a one-process run's: ``full_state``) resumes on K sharded ranks through ``load_full_state`` and
``shard_optimizer_state``.

In one process (no launch) ``fsdp`` changes nothing: the models stay whole and the run is the plain one.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn

__all__ = ["transformer_blocks", "shard", "is_sharded", "gathered", "local_bytes", "full", "full_state",
           "load_full_state", "full_optimizer_state", "shard_optimizer_state"]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks in order: modules whose class one of its modules names in
    ``_no_split_modules`` (transformers' list of the blocks a device map must not split). A sharded model's blocks
    too: ``fully_shard`` gives each one a subclass (``FSDPLlamaDecoderLayer``) of its class."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not blocks:
        raise ValueError(f"fsdp: {type(model).__name__} names no transformer block class (_no_split_modules); "
                         "FSDP shards a model per block")
    return blocks


def shard(model: nn.Module, dtype: str = "fp32", offload: bool = False) -> nn.Module:
    """``fully_shard`` on each transformer block, then on the root (in place; the same object is returned).

    Every rank must hold the same weights before (the trainers broadcast rank 0's): rank ``r`` keeps chunk ``r``
    of each parameter's first dimension. ``offload``: the shards (and so their gradients, and the moments of an
    optimizer built on them afterwards) in CPU memory, pinned when the model is on CUDA."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if dtype == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        # Pinned host memory is what lets the copies overlap compute, and it only exists beside a CUDA device.
        on_cuda = any(p.device.type == "cuda" for p in model.parameters())
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=on_cuda)
    for block in transformer_blocks(model):
        fully_shard(block, reshard_after_forward=True, **kwargs)
    # The root's weights (embeddings, LM head) are the first the backward needs: kept after its forward
    # (FSDP2's own choice for a root).
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def _fsdp_modules(model: nn.Module | None) -> list[nn.Module]:
    if model is None:
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module | None) -> bool:
    return bool(_fsdp_modules(model))


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every block of a sharded ``model`` holds its full weights inside (one all-gather per block at entry; every
    rank must enter); forwards inside run no collective. Nothing happens for an unsharded model."""
    modules = _fsdp_modules(model)
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)  # shard()'s settings back


def local_bytes(tensors: list[Tensor]) -> int:
    """Bytes this rank holds of ``tensors``: a sharded ``DTensor`` counts its local shard (``to_local()``)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def full(t: Tensor) -> Tensor:
    """A plain tensor of ``t``'s whole value (a ``DTensor`` is all-gathered: every rank must call it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state(named: dict[str, Tensor]) -> dict[str, Tensor]:
    """``named``'s tensors whole, detached, on the CPU (sharded ones all-gathered: every rank must call it, in the
    same order, which a module's ``state_dict()`` / ``named_parameters()`` gives)."""
    return {name: full(t.detach()).cpu().clone() for name, t in named.items()}


def _like(value: Tensor, target: Tensor) -> Tensor:
    """``value`` (a whole tensor every rank holds) as ``target`` is laid out: this rank's shard of a ``DTensor``."""
    value = value.to(device=target.device, dtype=target.dtype)
    if not hasattr(target, "device_mesh"):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value, target.device_mesh, target.placements)


def load_full_state(model: nn.Module, state: dict[str, Tensor], strict: bool = True) -> None:
    """Copy whole tensors (``full_state``'s) into ``model``'s parameters and buffers, sharded or not."""
    own = dict(model.state_dict(keep_vars=True))
    missing = [n for n in state if n not in own] + ([n for n in own if n not in state] if strict else [])
    if missing:
        raise KeyError(missing[0])
    with torch.no_grad():
        for name, value in state.items():
            own[name].copy_(_like(value, own[name]))


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with its sharded moments whole (every rank must call it)."""
    sd = optimizer.state_dict()
    return {"state": {i: {k: full(v) if isinstance(v, Tensor) else v for k, v in s.items()}
                      for i, s in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` of a ``full_optimizer_state``: each moment of a sharded parameter cut to this
    rank's shard (AdamW's ``step`` counter, a scalar, stays as it is)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, Tensor) and hasattr(p, "device_mesh") and not hasattr(v, "device_mesh") \
                        and tuple(v.shape) == tuple(p.shape):
                    optimizer.state[p][k] = _like(v, p)
