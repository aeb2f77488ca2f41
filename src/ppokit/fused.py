"""The fused PPO update: the same update as ``update.ppo_update``, without autograd.

For an ``ActorCritic`` whose actor and critic are plain MLPs (tanh or relu) with a categorical or diagonal-Gaussian
head, the forward pass, the backward pass of the PPO loss (clipped surrogate, optionally clipped value loss,
entropy bonus, per-minibatch advantage normalization) and the gradient-norm clip are written out by hand, and all
parameters live in ONE flat buffer that a single fused Adam step updates.

Why: CartPole-sized PPO spends ~80% of its time in thousands of gradient steps on 64-wide matrices, where eager
autograd's per-op dispatch and graph bookkeeping cost more than the arithmetic. Writing the backward directly
removes the graph, the flat buffer turns the gradient norm and Adam into one kernel each, per-minibatch statistics
are reduced in one op and read by the host once (with the gradient norm, which also decides the clip), and tanh
is evaluated as ``2*sigmoid(2x) - 1`` (on the torch 2.13 CPU build measured, tanh of a 256x64 matrix takes ~44 us,
sigmoid ~8 us). Acting during the rollout (``FusedKernel.act``) uses the same forward pass.

The module stays the source of truth: its parameters become views into the flat buffer (``FlatAdam``), so acting,
checkpoints, evaluation and ``load_state_dict`` see every update, and ``FlatAdam.state_dict()`` has the per-parameter
layout of ``torch.optim.Adam(policy.parameters())`` so checkpoints move freely between the fused and autograd paths.
Eager autograd (``update.ppo_update``) remains the reference; ``tests/test_fused.py`` checks the two agree.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .policies import ActorCritic
from .update import STAT_NAMES, Batch, UpdateSettings

__all__ = ["FlatAdam", "FusedKernel", "supports", "fused_ppo_update", "unsupported_reason"]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_GAUSS_ENT = 0.5 * math.log(2.0 * math.pi * math.e)


def unsupported_reason(policy: nn.Module, algo: str) -> str | None:
    """Why the fused path cannot run this policy/objective (None when it can)."""
    if not isinstance(policy, ActorCritic):
        return f"policy is a {type(policy).__name__}, not an ActorCritic"
    if algo != "ppo":
        return f"algo {algo!r} (only the clipped surrogate 'ppo' is fused)"
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
    """True when ``fused_ppo_update`` can replace ``ppo_update`` for this policy and objective."""
    return unsupported_reason(policy, algo) is None


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
        self.kernel = FusedKernel(policy, self)

    # ------------------------------------------------------------------ optimizer interface
    def step(self) -> None:
        """One Adam step on the flat buffer from the flat gradient."""
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], float(group["eps"])
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


class FusedKernel:
    """Forward + hand-derived backward of one PPO minibatch loss, writing the gradient into the flat buffer.

    Per-sample statistics are reduced in one op into ``stat_buf`` and read by the host once per minibatch together
    with the gradient norm; the scalar loss is assembled on the host from those means (see ``fused_ppo_update``).
    """

    # Rows of the per-sample statistics reduced each minibatch (host turns them into STAT_NAMES).
    ROWS = ("surrogate", "sq_value_error", "neg_entropy", "k3", "logratio", "clipped")

    def __init__(self, policy: ActorCritic, optimizer: FlatAdam):
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

    # ------------------------------------------------------------------ acting
    def actor_head(self, obs: Tensor) -> Tensor:
        """The actor's output (logits or Gaussian mean) for ``obs``, as ``policy.actor(obs)``."""
        with torch.no_grad():
            return self._forward(obs, self.actor)[1]

    def act(self, obs: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """``ActorCritic.act`` on the same forward the update differentiates: (actions, logp [B], values [B]).

        Sampling is the policy's own (``ActorCritic.sample``), so it draws the same random numbers.
        """
        with torch.no_grad():
            _, head = self._forward(obs, self.actor)
            actions = self.policy.sample(head, deterministic)
            if self.kind == "discrete":
                logp = torch.log_softmax(head, 1).gather(1, actions.view(-1, 1)).view(-1)
            else:
                z = (actions - head).mul_(torch.exp(-self.log_std))
                logp = (z * z).sum(1).mul_(self.c(-0.5)).sub_(self.log_std.sum() + head.shape[1] * _LOG_SQRT_2PI)
            _, v = self._forward(obs, self.critic)
        return actions, logp, v.view(-1)

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

        # Clipped surrogate: d(surrogate)/d(logp) = r*A where the unclipped branch is the minimum, else 0.
        logratio = logp - logp_old
        ratio = logratio.exp()
        unclipped = ratio * advantages
        ratio_c = ratio.clamp(1.0 - eps, 1.0 + eps)
        clipped = ratio_c * advantages
        surrogate = torch.minimum(unclipped, clipped)
        g_logp = unclipped.masked_fill_(unclipped > clipped, 0.0).mul_(self.c(-inv_m))

        # Value loss 0.5*mean((V-R)^2), or PPO2's max of clipped and unclipped squared errors.
        d = values - returns
        if s.clip_vloss:
            dv = values - values_old
            dc = values_old + dv.clamp(-eps, eps) - returns
            sq_u, sq_c = d * d, dc * dc
            sq = torch.maximum(sq_u, sq_c)
            # Where the clipped branch is the max and the value moved past the clip, no gradient reaches V.
            blocked = (sq_u < sq_c) & (dv.abs() > eps)
            g_v = d.masked_fill(blocked, 0.0).mul_(self.c(s.vf_coef * inv_m))
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


def _host_stats(row: list[float], s: UpdateSettings) -> tuple[float, list[float]]:
    """The minibatch loss and its ``STAT_NAMES`` values from the kernel's means of ``FusedKernel.ROWS`` + grad norm."""
    surrogate, sq, neg_ent, k3, logratio, outside, grad_norm = row
    loss_pi, loss_v, entropy = -surrogate, 0.5 * sq, -neg_ent
    loss = loss_pi + s.vf_coef * loss_v - s.ent_coef * entropy
    return loss, [loss_pi, loss_v, entropy, k3, -logratio, outside, grad_norm]


def _split_sizes(n: int, parts: int) -> list[int]:
    """Chunk sizes of ``torch.tensor_split(range(n), parts)``: the first ``n % parts`` chunks hold one more."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _normalize_rows(adv: Tensor, sizes: list[int], c) -> Tensor:
    """Per-minibatch advantage normalization (``advantages.normalize`` of each chunk), vectorized when equal-sized."""
    if len(set(sizes)) == 1:
        m = adv.view(len(sizes), sizes[0])
        std, mean = torch.std_mean(m, 1, unbiased=False, keepdim=True)
        return ((m - mean) / (std + c(1e-8))).view(-1)
    parts = []
    for chunk in torch.split(adv, sizes):
        if chunk.numel() > 1:
            std, mean = torch.std_mean(chunk, unbiased=False)
            chunk = (chunk - mean) / (std + c(1e-8))
        parts.append(chunk)
    return torch.cat(parts)


def fused_ppo_update(policy: ActorCritic, optimizer: FlatAdam, batch: Batch, s: UpdateSettings,
                     generator: torch.Generator | None = None) -> dict[str, float]:
    """Drop-in for ``update.ppo_update`` (same minibatches, guards and returned diagnostics), without autograd.

    ``optimizer`` must be the policy's ``FlatAdam``; ``s.algo`` must be "ppo". As in the reference, a minibatch
    with a non-finite loss or gradient norm is skipped, the gradient is clipped to ``max_grad_norm``, and
    ``approx_kl > 1.5 * target_kl`` stops the remaining epochs.
    """
    if s.algo != "ppo":
        raise ValueError(f"fused_ppo_update: algo {s.algo!r} is not fused; use update.ppo_update")
    if not isinstance(optimizer, FlatAdam):
        raise TypeError("fused_ppo_update needs the policy's FlatAdam optimizer")
    kernel = optimizer.kernel
    device = batch.obs.device
    B = len(batch)
    n_stats = len(STAT_NAMES)
    totals = [0.0] * n_stats
    n_done, n_skipped, epochs_run, early_stopped = 0, 0, 0, False
    sizes = [n for n in _split_sizes(B, s.num_minibatches) if n > 0]
    # Inference mode rather than no_grad: it also skips the autograd dispatch of every op (~1 us each here).
    with torch.inference_mode():
        # The per-sample scalars travel as rows of one [4, B] matrix: one gather per epoch instead of four.
        aux = torch.stack([batch.logp_old, batch.values_old, batch.advantages, batch.returns]).to(kernel.dtype)
        whole_norm = None
        for epoch in range(s.update_epochs):
            epochs_run = epoch + 1
            # The permutation is drawn even for one minibatch so the RNG stream matches the autograd path.
            perm = torch.randperm(B, device=device, generator=generator)
            if len(sizes) == 1:
                # One minibatch is the whole batch: every mean is order-free, so skip the gather, and the
                # normalized advantages are the same every epoch.
                obs_e, act_e, aux_e = batch.obs, batch.actions, aux
                if s.norm_adv and whole_norm is None:
                    whole_norm = _normalize_rows(aux[2], sizes, kernel.c) if B > 1 else aux[2]
                adv_e = whole_norm if s.norm_adv else aux[2]
            else:
                # Gathering in permuted order makes the reference's minibatches contiguous row ranges.
                obs_e, act_e, aux_e = batch.obs[perm], batch.actions[perm], aux[:, perm]
                adv_e = _normalize_rows(aux_e[2], sizes, kernel.c) if s.norm_adv else aux_e[2]
            start = 0
            for M in sizes:
                sl = slice(start, start + M)
                start += M
                if s.norm_adv and M == 1:
                    adv_mb = aux_e[2, sl]  # the reference leaves a single-sample minibatch as is
                else:
                    adv_mb = adv_e[sl]
                kernel.loss_and_grad(obs_e[sl], act_e[sl], aux_e[0, sl], aux_e[1, sl], adv_mb, aux_e[3, sl], s)
                kernel.grad_norm_into_stats()
                # One host read per minibatch serves the NaN guard, the clip, KL early stopping and the stats.
                loss, vals = _host_stats(kernel.stat_buf.tolist(), s)
                grad_norm = vals[-1]
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                    n_skipped += 1
                    optimizer.zero_grad()
                    continue
                coef = s.max_grad_norm / (grad_norm + 1e-6)
                if coef < 1.0:
                    kernel.flat_grad.mul_(coef)
                optimizer.step()
                totals = [a + b for a, b in zip(totals, vals)]
                n_done += 1
                if s.target_kl is not None and vals[3] > 1.5 * s.target_kl:
                    early_stopped = True
                    break
            if early_stopped:
                break
    means = [t / n_done for t in totals] if n_done else [float("nan")] * n_stats
    out = dict(zip(STAT_NAMES, means))
    out.update(minibatches=float(n_done), skipped_minibatches=float(n_skipped), epochs_run=float(epochs_run),
               early_stopped=float(early_stopped))
    return out
