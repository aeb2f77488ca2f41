"""Adam over one flat buffer that backs every parameter of a module (``FlatAdam``).

The fused update (``fused_step``) writes its hand-derived gradient into one flat tensor, so the gradient norm and
the Adam step are one kernel each instead of one per parameter. The module stays the source of truth: its
parameters become views into the flat buffer, so acting, checkpoints, evaluation and ``load_state_dict`` see every
step, and ``FlatAdam.state_dict()`` has the per-parameter layout of ``torch.optim.Adam(policy.parameters())`` so
checkpoints move freely between the fused and autograd paths.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["FlatAdam"]


def _fused_adam_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build has the one-kernel Adam for ``device``/``dtype`` (probed on a 1-element tensor)."""
    try:
        p, g = torch.zeros(1, device=device, dtype=dtype), torch.zeros(1, device=device, dtype=dtype)
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        step = torch.ones((), device=device, dtype=torch.float32)
        torch._fused_adam_([p], [g], [m], [v], [], [step], amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999,
                           weight_decay=0.0, eps=1e-8, maximize=False, grad_scale=None, found_inf=None)
        return True
    except (AttributeError, NotImplementedError, RuntimeError, TypeError):
        return False


class FlatAdam:
    """Adam (``torch.optim.Adam`` semantics, no weight decay) over one flat buffer that backs every parameter of
    ``policy``: the module's parameters become views into it, and so do their ``.grad`` tensors.

    It is not a ``torch.optim.Optimizer`` subclass on purpose: constructing or stepping one imports
    ``torch._dynamo`` (~1.5 s, a quarter of a whole CartPole run) and wraps each step in bookkeeping that costs
    several times the fused kernel at this size. It offers what the trainer uses: ``param_groups`` (one group;
    set ``lr`` there), ``step``, ``zero_grad``, and ``state_dict``/``load_state_dict`` in the per-parameter layout
    of ``torch.optim.Adam(policy.parameters())`` (one state entry per module parameter, in ``policy.parameters()``
    order), so a checkpoint written by either optimizer loads into the other.
    """

    def __init__(self, policy: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-5, fused: bool | None = None):
        params = list(policy.parameters())
        if not params:
            raise ValueError("FlatAdam: the module has no parameters")
        device, dtype = params[0].device, params[0].dtype
        if any(p.device != device or p.dtype != dtype for p in params):
            raise ValueError("FlatAdam: all parameters must share one device and dtype")
        total = sum(p.numel() for p in params)
        flat = torch.empty(total, device=device, dtype=dtype)
        grad = torch.zeros(total, device=device, dtype=dtype)
        self.slices: list[tuple[int, int, torch.Size]] = []
        off = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                flat[off:off + n].copy_(p.detach().reshape(-1))
                # The module keeps its Parameter objects; only their storage moves into the flat buffer.
                p.data = flat[off:off + n].view(p.shape)
                p.grad = grad[off:off + n].view(p.shape)
                self.slices.append((off, n, p.shape))
                off += n
        self.module_params = params
        self.flat = nn.Parameter(flat)
        self.flat.grad = grad
        self.fused = _fused_adam_available(device, dtype) if fused is None else bool(fused)
        self.param_groups = [{"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0, "amsgrad": False,
                              "maximize": False, "foreach": None if self.fused else False, "capturable": False,
                              "differentiable": False, "fused": True if self.fused else None,
                              "decoupled_weight_decay": False}]
        self.exp_avg = torch.zeros_like(flat)
        self.exp_avg_sq = torch.zeros_like(flat)
        self.step_count = torch.zeros((), device=device, dtype=torch.float32)
        # Bumped by every write this optimizer makes to the flat buffer: the acting weights derived from the
        # parameters (``acting.ActingKernel``) are rebuilt when it, or any parameter's own version counter, moves.
        self.version = 0

    # ------------------------------------------------------------------ optimizer interface
    def step(self) -> None:
        """One Adam step on the flat buffer from the flat gradient."""
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], float(group["eps"])
        self.version += 1
        with torch.no_grad():
            self.step_count.add_(1.0)
            if self.fused:
                torch._fused_adam_([self.flat], [self.flat.grad], [self.exp_avg], [self.exp_avg_sq], [],
                                   [self.step_count], amsgrad=False, lr=lr, beta1=float(beta1), beta2=float(beta2),
                                   weight_decay=0.0, eps=eps, maximize=False, grad_scale=None, found_inf=None)
                return
            # The same arithmetic as torch.optim.Adam's single-tensor path.
            g = self.flat.grad
            self.exp_avg.lerp_(g, 1.0 - beta1)
            self.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            t = float(self.step_count)
            bias1, bias2_sqrt = 1.0 - beta1 ** t, math.sqrt(1.0 - beta2 ** t)
            denom = (self.exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
            self.flat.data.addcdiv_(self.exp_avg, denom, value=-lr / bias1)

    @property
    def state(self) -> dict:
        """Per-parameter Adam state keyed by module parameter, like ``torch.optim.Optimizer.state`` (live views
        into the flat moments; empty before the first step)."""
        if float(self.step_count) == 0:
            return {}
        return {p: {"step": self.step_count, "exp_avg": self.exp_avg[off:off + n].view(shape),
                    "exp_avg_sq": self.exp_avg_sq[off:off + n].view(shape)}
                for p, (off, n, shape) in zip(self.module_params, self.slices)}

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient in place (never ``None``: the module's ``.grad`` tensors are views of it)."""
        self.flat.grad.zero_()

    def state_dict(self) -> dict:
        """Adam state in the per-parameter layout of ``torch.optim.Adam(policy.parameters())``."""
        group = dict(self.param_groups[0])
        group["params"] = list(range(len(self.slices)))
        state: dict[int, dict] = {}
        if float(self.step_count) > 0:
            for i, (off, n, shape) in enumerate(self.slices):
                state[i] = {"step": self.step_count.clone(),
                            "exp_avg": self.exp_avg[off:off + n].view(shape).clone(),
                            "exp_avg_sq": self.exp_avg_sq[off:off + n].view(shape).clone()}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a per-parameter Adam state dict (from ``state_dict`` or a plain ``torch.optim.Adam``)."""
        groups = state_dict["param_groups"]
        n_params = sum(len(g["params"]) for g in groups)
        if len(groups) != 1 or n_params != len(self.slices):
            raise ValueError(f"FlatAdam.load_state_dict: expected one param group of {len(self.slices)} parameters, "
                             f"got {len(groups)} group(s) of {n_params}")
        if groups[0].get("amsgrad") or groups[0].get("weight_decay"):
            raise ValueError("FlatAdam.load_state_dict: amsgrad and weight decay are not supported")
        ids = list(groups[0]["params"])
        state = state_dict["state"]
        with torch.no_grad():
            if not state:
                self.exp_avg.zero_()
                self.exp_avg_sq.zero_()
                self.step_count.zero_()
            else:
                missing = [i for i in ids if i not in state]
                if missing:
                    raise ValueError(f"FlatAdam.load_state_dict: no state for parameters {missing}")
                for key, dest in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                    for pid, (off, n, _) in zip(ids, self.slices):
                        t = state[pid][key]
                        if t.numel() != n:
                            raise ValueError(f"FlatAdam.load_state_dict: state {key!r} of parameter {pid} has "
                                             f"{t.numel()} elements, the parameter has {n}")
                        dest[off:off + n].copy_(t.reshape(-1))
                self.step_count.fill_(float(state[ids[0]]["step"]))
        keep = ("lr", "betas", "eps")
        self.param_groups[0].update({k: (tuple(v) if k == "betas" else v) for k, v in groups[0].items() if k in keep})
