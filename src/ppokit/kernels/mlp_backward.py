"""The hand-derived backward of the PPO minibatch loss for MLP actor-critics (``MLPLossKernel``).

For an ``ActorCritic`` whose actor and critic are plain MLPs (tanh or relu) with a categorical or diagonal-Gaussian
head, the forward pass and the backward pass of the PPO loss (clipped surrogate, optionally clipped value loss,
entropy bonus; advantages normalized by the caller) are written out by hand into ``FlatAdam``'s flat gradient.

Why: CartPole-sized PPO spends ~80% of its time in thousands of gradient steps on 64-wide matrices, where eager
autograd's per-op dispatch and graph bookkeeping cost more than the arithmetic. Writing the backward directly
removes the graph, per-minibatch statistics are reduced in one op and read by the host once (with the gradient
norm, which also decides the clip), and tanh is evaluated as ``2*sigmoid(2x) - 1`` (on the torch 2.13 CPU build
measured, tanh of a 256x64 matrix takes ~44 us, sigmoid ~8 us). Eager autograd (``autograd.minibatch_loss``) remains
the reference; ``tests/test_fused.py`` checks the two agree.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ppokit.core.algos import ALGOS
from ppokit.core.objectives import past_clip
from ppokit.policies import ActorCritic
from ppokit.update.epochs import UpdateSettings

if TYPE_CHECKING:
    from ppokit.kernels.flat_adam import FlatAdam

__all__ = ["MLPLossKernel", "supports", "unsupported_reason"]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_GAUSS_ENT = 0.5 * math.log(2.0 * math.pi * math.e)


def unsupported_reason(policy: nn.Module, algo: str) -> str | None:
    """Why the fused path cannot run this policy/objective (None when it can)."""
    if not isinstance(policy, ActorCritic):
        return f"policy is a {type(policy).__name__}, not an ActorCritic"
    if policy.initial_state(1) is not None:
        return f"policy {type(policy).__name__} keeps a state between steps (the kernels are stateless)"
    registered = ALGOS.get(algo)
    if registered is None or not registered.fused:
        fused = ", ".join(repr(a.name) for a in ALGOS.values() if a.fused)
        return f"algo {algo!r} (only {fused} is fused)"
    if policy.kind not in ("discrete", "continuous"):
        return f"{policy.kind} action heads"
    if policy.activation not in ("tanh", "relu"):
        return f"activation {policy.activation!r}"
    act_type = {"tanh": nn.Tanh, "relu": nn.ReLU}[policy.activation]
    for net in (policy.actor, policy.critic):
        mods = list(net)
        shape_ok = len(mods) % 2 == 1 and all(isinstance(m, nn.Linear) for m in mods[0::2]) \
            and all(isinstance(m, act_type) for m in mods[1::2])
        if not shape_ok:
            return "the actor/critic are not Linear-activation stacks"
    params = list(policy.parameters())
    if len({(p.device, p.dtype) for p in params}) != 1:
        return "parameters on mixed devices or dtypes"
    return None


def supports(policy: nn.Module, algo: str) -> bool:
    """True when the fused update (``fused_step``) can replace ``autograd.ppo_update`` for this policy and objective."""
    return unsupported_reason(policy, algo) is None


class MLPLossKernel:
    """Forward + hand-derived backward of one PPO minibatch loss, writing the gradient into ``FlatAdam``'s flat
    gradient (the parameters' ``.grad`` views of it).

    Per-sample statistics are reduced in one op into ``stat_buf`` and read by the host once per minibatch together
    with the gradient norm; the scalar loss is assembled on the host from those means (``fused_step.host_stats``).
    """

    # Rows of the per-sample statistics reduced each minibatch (host turns them into STAT_NAMES).
    ROWS = ("surrogate", "sq_value_error", "neg_entropy", "k3", "logratio", "clipped")

    def __init__(self, policy: ActorCritic, optimizer: "FlatAdam"):
        reason = unsupported_reason(policy, "ppo")
        if reason is not None:
            raise ValueError(f"the fused update does not support this policy: {reason}")
        self.policy = policy
        self.kind = policy.kind
        self.tanh = policy.activation == "tanh"
        self.optimizer = optimizer
        self.flat_grad = optimizer.flat.grad
        self.device, self.dtype = optimizer.flat.device, optimizer.flat.dtype
        self.stat_buf = torch.zeros(len(self.ROWS) + 1, device=self.device, dtype=self.dtype)
        self._consts: dict[float, Tensor] = {}

        def layers(net: nn.Sequential):
            lin = [m for m in net if isinstance(m, nn.Linear)]
            # .data is the view into the flat buffer: Adam's in-place step is seen here without re-fetching.
            return ([m.weight.data for m in lin], [m.weight.data.t() for m in lin], [m.bias.data for m in lin],
                    [m.weight.grad for m in lin], [m.bias.grad for m in lin])

        self.actor = layers(policy.actor)
        self.critic = layers(policy.critic)
        if self.kind == "continuous":
            self.log_std = policy.log_std.data
            self.log_std_grad = policy.log_std.grad

    def c(self, value: float) -> Tensor:
        """A cached 0-dim constant: a Python float operand costs an extra dtype-conversion op per call."""
        t = self._consts.get(value)
        if t is None:
            t = self._consts[value] = torch.tensor(value, device=self.device, dtype=self.dtype)
        return t

    # ------------------------------------------------------------------ MLP pieces
    def _forward(self, x: Tensor, net) -> tuple[list[Tensor], Tensor]:
        """Hidden activations (input first) and the head output of one MLP."""
        W, Wt, b, _, _ = net
        hs = [x]
        h = x
        for i in range(len(W) - 1):
            if self.tanh:
                # tanh(z) = 2*sigmoid(2z) - 1; the addmm produces 2z directly.
                h = torch.addmm(b[i], h, Wt[i], beta=2.0, alpha=2.0).sigmoid_().mul_(self.c(2.0)).sub_(self.c(1.0))
            else:
                h = torch.addmm(b[i], h, Wt[i]).relu_()
            hs.append(h)
        return hs, torch.addmm(b[-1], h, Wt[-1])

    def _backward(self, g: Tensor, hs: list[Tensor], net) -> None:
        """Given dLoss/d(head output) ``g``, write every weight and bias gradient of the MLP (no accumulation)."""
        W, _, _, gW, gb = net
        for i in range(len(W) - 1, -1, -1):
            torch.mm(g.t(), hs[i], out=gW[i])
            torch.sum(g, 0, out=gb[i])
            if i == 0:
                break
            dh = torch.mm(g, W[i])
            h = hs[i]
            if self.tanh:
                g = torch.addcmul(dh, dh * h, h, value=-1.0)  # dh * (1 - h^2)
            else:
                g = torch.ops.aten.threshold_backward(dh, h, 0)  # dh where h > 0

    # ------------------------------------------------------------------ one minibatch
    def loss_and_grad(self, obs: Tensor, actions: Tensor, logp_old: Tensor, values_old: Tensor,
                      advantages: Tensor, returns: Tensor, s: UpdateSettings) -> Tensor:
        """Write the loss gradient (NOT yet norm-clipped) into the flat buffer and the means of ``ROWS`` into
        ``stat_buf[:6]``; ``advantages`` must already be normalized if ``s.norm_adv``. Returns ``stat_buf``."""
        M = obs.shape[0]
        inv_m = 1.0 / M
        eps = s.clip_coef
        hs_a, head = self._forward(obs, self.actor)
        hs_c, vhead = self._forward(obs, self.critic)
        values = vhead.view(-1)

        # Log-probability and entropy of the stored actions under pi_theta.
        if self.kind == "discrete":
            lsm = torch.log_softmax(head, 1)
            idx = actions.view(-1, 1)
            logp = lsm.gather(1, idx).view(-1)
            p = lsm.exp()
            neg_ent = torch.sum(p * lsm, 1)
        else:
            log_std = self.log_std
            inv_std = torch.exp(-log_std)
            z = (actions - head).mul_(inv_std)
            zz = z * z
            ls_sum = log_std.sum()
            logp = zz.sum(1).mul_(self.c(-0.5)).sub_(ls_sum + head.shape[1] * _LOG_SQRT_2PI)
            neg_ent = (ls_sum + head.shape[1] * _GAUSS_ENT).neg_().expand(M)

        # Clipped surrogate: d(surrogate)/d(logp) = r*A, except past the clip in the improving direction where
        # it is 0; the branch is chosen by objectives.past_clip, as in the reference (agreeing at rounding ties).
        logratio = logp - logp_old
        ratio = logratio.exp()
        unclipped = ratio * advantages
        ratio_c = ratio.clamp(1.0 - eps, 1.0 + eps)
        past = past_clip(ratio, ratio_c, advantages)
        surrogate = torch.where(past, ratio_c * advantages, unclipped)
        g_logp = unclipped.masked_fill_(past, 0.0).mul_(self.c(-inv_m))

        # Value loss 0.5*mean((V-R)^2), or PPO2's max of clipped and unclipped squared errors.
        d = values - returns
        if s.clip_vloss:
            dv = values - values_old
            dc = values_old + dv.clamp(-eps, eps) - returns
            sq_u, sq_c = d * d, dc * dc
            # The clipped branch only where it is strictly larger (ties go to the unclipped one, as in
            # objectives.value_loss). Its derivative is dc inside the clip and 0 where the value moved past it.
            use_c = sq_c > sq_u
            sq = torch.where(use_c, sq_c, sq_u)
            g_v = torch.where(use_c, dc.masked_fill(dv.abs() > eps, 0.0), d).mul_(self.c(s.vf_coef * inv_m))
        else:
            sq = d * d
            g_v = d * self.c(s.vf_coef * inv_m)

        # Actor head gradient: dL/dlogp * dlogp/dhead + dL/dH * dH/dhead with dL/dH = -ent_coef / M per sample.
        if self.kind == "discrete":
            t = g_logp.unsqueeze(1)
            if s.ent_coef != 0.0:
                # dH/dz_k = -p_k (log p_k + H)
                t = (lsm - neg_ent.unsqueeze(1)).mul_(self.c(-s.ent_coef * inv_m)).add_(t)
            g_head = (p * t).neg_()
            g_head.scatter_add_(1, idx, g_logp.unsqueeze(1))  # + dL/dlogp * onehot(a)
        else:
            # dlogp/dmu = z / std; dlogp/dlog_std = z^2 - 1; dH/dlog_std = 1 for every sample.
            g_head = (z * inv_std).mul_(g_logp.unsqueeze(1))
            torch.mv(zz.t(), g_logp, out=self.log_std_grad)
            self.log_std_grad.sub_(g_logp.sum() + s.ent_coef)
        self._backward(g_head, hs_a, self.actor)
        self._backward(g_v.unsqueeze(1), hs_c, self.critic)

        # Statistics: one stack and one reduction for all six (means over the minibatch, as the reference).
        k3 = torch.expm1(logratio).sub_(logratio)
        outside = (ratio_c != ratio).to(self.dtype)  # |r - 1| > eps
        torch.mean(torch.stack([surrogate, sq, neg_ent, k3, logratio, outside]), 1, out=self.stat_buf[:6])
        return self.stat_buf

    def grad_norm_into_stats(self) -> None:
        """Global L2 norm of the flat gradient into ``stat_buf[6]`` (the host decides on clipping)."""
        torch.linalg.vector_norm(self.flat_grad, out=self.stat_buf[6])
