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
sigmoid ~8 us). Acting during the rollout (``FusedKernel.act``) runs the same network without backward on cached
"acting weights" (the tanh affine folded into the next layer, actor and critic merged into one matmul per depth;
see the acting section of ``FusedKernel``), rebuilt whenever a parameter changes.

The module stays the source of truth: its parameters become views into the flat buffer (``FlatAdam``), so acting,
checkpoints, evaluation and ``load_state_dict`` see every update, and ``FlatAdam.state_dict()`` has the per-parameter
layout of ``torch.optim.Adam(policy.parameters())`` so checkpoints move freely between the fused and autograd paths.
Eager autograd (``update.ppo_update``) remains the reference; ``tests/test_fused.py`` checks the two agree.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .advantages import normalize
from .objectives import past_clip
from .policies import ActorCritic
from .update import STAT_NAMES, Batch, UpdateSettings, kl_stops

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
        # Bumped by every write this optimizer makes to the flat buffer: the acting weights derived from the
        # parameters (``FusedKernel.act``) are rebuilt when it, or any parameter's own version counter, moves.
        self.version = 0
        self.kernel = FusedKernel(policy, self)

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
        self._params = list(policy.parameters())
        self._acting_token: int | None = None
        self._alloc_acting()

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
    # Acting needs no backward, so it runs on "acting weights" derived from the parameters:
    #  * tanh layers are computed as s = sigmoid(2z) (tanh(z) = 2s - 1), and the affine 2s - 1 and the factor 2 are
    #    folded into the next layer: 2*z' = (4W) s + 2(b - W 1), head = (2W) s + (b - W 1). Each hidden layer is
    #    then one matmul and one in-place sigmoid (instead of addmm, sigmoid, mul, sub).
    #  * actor and critic run as one network: the first layer is one matmul over concatenated weights into a
    #    [B, 2H] buffer, each deeper layer one batched matmul over the stacked [2, H, H'] weights (the two halves
    #    read as a [2, B, H] view), so each depth costs one matmul and one activation for both nets.
    # The weights are rebuilt only when a parameter changed; all intermediate buffers are kept per batch size.

    def invalidate(self) -> None:
        """Drop the cached acting weights; only needed after writing the parameters through ``.data``, which no
        version counter sees (optimizer steps, ``load_state_dict`` and in-place edits of a parameter are seen)."""
        self._acting_token = None

    def _version_token(self) -> int:
        """A number that grows whenever the parameters may have changed: FlatAdam's own step counter plus the
        autograd version counters of the flat buffer and of every module parameter (monotone, so a sum suffices)."""
        opt = self.optimizer
        return sum([p._version for p in self._params], opt.version + opt.flat._version)

    def _alloc_acting(self) -> None:
        """Allocate the acting weights once (``_fill_acting`` rewrites them in place, so the per-batch-size buffers
        and views built on them stay valid) and decide whether actor and critic can run merged."""
        aW, cW = self.actor[0], self.critic[0]
        n_hidden = len(aW) - 1
        self._merged = n_hidden > 0 and len(cW) == len(aW) and all(
            aW[i].shape == cW[i].shape for i in range(n_hidden))
        kw = dict(device=self.device, dtype=self.dtype)
        with torch.inference_mode(False):
            # Normal (not inference) tensors, so acting also works outside inference mode.
            if self._merged:
                # [in, 2H] as the transpose of a [2H, in] weight: the layout BLAS reads fastest.
                self._l0 = (torch.empty(2 * aW[0].shape[0], aW[0].shape[1], **kw).t(),
                            torch.empty(2 * aW[0].shape[0], **kw))
                self._deep = [(torch.empty(2, W.shape[1], W.shape[0], **kw), torch.empty(2, 1, W.shape[0], **kw))
                              for W in aW[1:-1]]
            else:
                self._nets = [[(torch.empty(W.shape, **kw).t(), torch.empty(W.shape[0], **kw)) for W in net[:-1]]
                              for net in (aW, cW)]
            head_w, head_b = torch.empty(aW[-1].shape, **kw), torch.empty(aW[-1].shape[0], **kw)
            self._a_head = (head_w.t(), head_b)
            # The discrete head is also read as [A, H] weight + [A, 1] bias, giving logits as [A, B]: log-softmax
            # over the A rows is vectorized across the batch (over a length-A row it is ~4x slower at 1024 envs).
            self._a_head_t = (head_w, head_b.unsqueeze(1))
            self._c_head = (torch.empty(cW[-1].shape[1], **kw), torch.empty(1, **kw))
            if self.kind == "continuous":
                self._std, self._inv_std = torch.empty_like(self.log_std), torch.empty_like(self.log_std)
                self._neg_logp_const = torch.empty((), **kw)
        self._bufs: dict[int, tuple] = {}

    def _fill_acting(self) -> None:
        """Write the acting weights (see above) from the current parameters, in place."""
        aW, _, ab, _, _ = self.actor
        cW, _, cb, _, _ = self.critic
        tanh = self.tanh
        # Folding: a tanh layer reading sigmoid(2z) takes (4W, 2(b - W 1)) to give 2z', or (2W, b - W 1) as a
        # head; the first layer only doubles (2W, 2b). The bias uses the row sums of the unscaled W.
        if self._merged:
            W0t, b0 = self._l0
            torch.cat([aW[0], cW[0]], 0, out=W0t.t())
            torch.cat([ab[0], cb[0]], out=b0)
            if tanh:
                W0t.mul_(2.0)
                b0.mul_(2.0)
            for i, (Wt, b) in enumerate(self._deep, start=1):
                torch.stack([aW[i].t(), cW[i].t()], out=Wt)
                torch.stack([ab[i], cb[i]], out=b.squeeze(1))
                if tanh:
                    b.sub_(Wt.sum(1, keepdim=True)).mul_(2.0)
                    Wt.mul_(4.0)
        else:
            for net, Ws, bs in zip(self._nets, (aW, cW), (ab, cb)):
                for i, (Wt, b) in enumerate(net):
                    Wt.copy_(Ws[i].t())
                    b.copy_(bs[i])
                    if tanh and i == 0:
                        Wt.mul_(2.0)
                        b.mul_(2.0)
                    elif tanh:
                        b.sub_(Wt.sum(0)).mul_(2.0)
                        Wt.mul_(4.0)
        head_w, head_b = self._a_head_t[0], self._a_head[1]
        head_w.copy_(aW[-1])
        head_b.copy_(ab[-1])
        if tanh and len(aW) > 1:
            head_b.sub_(head_w.sum(1))
            head_w.mul_(2.0)
        wc, bc = self._c_head
        wc.copy_(cW[-1][0])
        bc.copy_(cb[-1])
        if tanh and len(cW) > 1:
            bc.sub_(wc.sum())
            wc.mul_(2.0)
        if self.kind == "continuous":
            ls = self.log_std
            torch.exp(ls, out=self._std)
            torch.neg(ls, out=self._inv_std).exp_()
            torch.sum(ls, 0, out=self._neg_logp_const).add_(ls.numel() * _LOG_SQRT_2PI).neg_()

    def _buffers(self, B: int) -> tuple:
        """Preallocated intermediates for batch size ``B`` and the views acting reads them through (made once:
        at 8 envs each view op costs about as much as a whole activation). A few sizes are kept."""
        bufs = self._bufs.get(B)
        if bufs is None:
            if len(self._bufs) >= 8:
                self._bufs.clear()
            kw = dict(device=self.device, dtype=self.dtype)
            with torch.inference_mode(False):
                noise = torch.empty(B, self._a_head[0].shape[1], **kw)
                if self._merged:
                    W0t = self._l0[0]
                    first = torch.empty(B, W0t.shape[1], **kw)
                    outs = [torch.empty(2, B, W.shape[2], **kw) for W, _ in self._deep]
                    # Layer l+1 reads layer l's output as [2, B, H]: the first as a strided view of [B, 2H].
                    ins = [first.view(B, 2, W0t.shape[1] // 2).transpose(0, 1), *outs]
                    last = ins[-1]
                    steps = list(zip(self._deep, ins[:-1], outs))
                    bufs = (first, steps, last[0], last[1], last[0].t(), noise)
                else:
                    nets = [[torch.empty(B, W.shape[1], **kw) for W, _ in net] for net in self._nets]
                    ha, hc = (n[-1] if n else None for n in nets)
                    bufs = (nets, None, ha, hc, None if ha is None else ha.t(), noise)
            self._bufs[B] = bufs
        return bufs

    def _hidden(self, obs: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(actor's last hidden [B, H], its transpose, critic's last hidden, noise buffer [B, A]) on the acting
        weights, rebuilt first if a parameter changed. Views of preallocated buffers, valid until the next call."""
        token = self._version_token()
        if token != self._acting_token:
            self._fill_acting()
            self._acting_token = token
        first, steps, ha, hc, ha_t, noise = self._buffers(obs.shape[0])
        act_ = torch.sigmoid_ if self.tanh else torch.relu_
        if self._merged:
            W0t, b0 = self._l0
            act_(torch.addmm(b0, obs, W0t, out=first))
            for (Wt, b), h, out in steps:
                act_(torch.baddbmm(b, h, Wt, out=out))
            return ha, ha_t, hc, noise
        for net, outs in zip(self._nets, first):
            h = obs
            for (Wt, b), out in zip(net, outs):
                h = act_(torch.addmm(b, h, Wt, out=out))
        # A net without hidden layers reads the observation directly.
        if ha is None:
            ha, ha_t = obs, obs.t()
        return ha, ha_t, obs if hc is None else hc, noise

    def actor_head(self, obs: Tensor) -> Tensor:
        """The actor's output (logits or Gaussian mean) for ``obs``, as ``policy.actor(obs)``."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.actor_head(obs)
        ha, _, _, _ = self._hidden(obs)
        Wt, b = self._a_head
        return torch.addmm(b, ha, Wt)

    def act(self, obs: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """``ActorCritic.act`` on the acting weights: (actions, logp [B], values [B]), fresh tensors.

        The random numbers are drawn as ``ActorCritic.sample`` draws them (one uniform or normal fill of a
        ``[B, A]`` tensor), so for the same RNG state the actions are the same.
        """
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.act(obs, deterministic)
        ha, ha_t, hc, noise = self._hidden(obs)
        wc, bc = self._c_head
        values = torch.addmv(bc, hc, wc)
        if self.kind == "discrete":
            W, b = self._a_head_t
            head_t = torch.addmm(b, W, ha_t)  # [A, B]
            if deterministic:
                actions = noise.copy_(head_t.t()).argmax(1)
            else:
                # Gumbel-max with exactly the ops of ActorCritic.sample: head - log(-log(max(u, 1e-20))), the
                # uniforms filling a [B, A] tensor in row-major order as torch.rand_like(head) does.
                g = noise.uniform_().clamp_(min=1e-20).log_().neg_().log_()
                actions = torch.sub(head_t.t(), g, out=g).argmax(1)
            logp = torch.log_softmax(head_t, 0).gather(0, actions.unsqueeze(0)).view(-1)
        else:
            Wt, b = self._a_head
            head = torch.addmm(b, ha, Wt)
            if deterministic:
                actions = head
            else:
                actions = torch.addcmul(head, self._std, noise.normal_())
            # log N(a; mu, std) = -0.5 |(a - mu)/std|^2 - sum(log std) - D log sqrt(2 pi), from the actions as stored.
            z = torch.sub(actions, head, out=noise).mul_(self._inv_std)
            logp = torch.add(self._neg_logp_const, z.mul_(z).sum(1), alpha=-0.5)
        return actions, logp, values

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


def _normalize_rows(adv: Tensor, sizes: list[int]) -> Tensor:
    """Per-minibatch advantage normalization: ``advantages.normalize`` of each chunk (the same function, so both
    paths share its rule for constant chunks), vectorized over the chunks when they are equal-sized."""
    if len(set(sizes)) == 1:
        return normalize(adv.view(len(sizes), sizes[0]), dim=1).view(-1)
    return torch.cat([normalize(chunk) if chunk.numel() > 1 else chunk for chunk in torch.split(adv, sizes)])


def fused_ppo_update(policy: ActorCritic, optimizer: FlatAdam, batch: Batch, s: UpdateSettings,
                     generator: torch.Generator | None = None) -> dict[str, float]:
    """Drop-in for ``update.ppo_update`` (same minibatches, guards and returned diagnostics), without autograd.

    ``optimizer`` must be the policy's ``FlatAdam``; ``s.algo`` must be "ppo". The guards are the reference's
    (see ``update.ppo_update``), checked before the minibatch's step: a non-finite loss, gradient norm or approx
    KL skips the minibatch; ``update.kl_stops`` (approx KL > 1.5 * target_kl) drops that minibatch unapplied and
    stops the remaining epochs; otherwise the gradient is clipped to ``max_grad_norm`` and Adam steps.
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
                    whole_norm = _normalize_rows(aux[2], sizes) if B > 1 else aux[2]
                adv_e = whole_norm if s.norm_adv else aux[2]
            else:
                # Gathering in permuted order makes the reference's minibatches contiguous row ranges.
                obs_e, act_e, aux_e = batch.obs[perm], batch.actions[perm], aux[:, perm]
                adv_e = _normalize_rows(aux_e[2], sizes) if s.norm_adv else aux_e[2]
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
                if not (math.isfinite(loss) and math.isfinite(grad_norm) and math.isfinite(vals[3])):
                    # vals[3] is the k3 KL: Inf when the ratio overflowed, even if the clipped loss is finite.
                    n_skipped += 1
                    optimizer.zero_grad()
                    continue
                if kl_stops(vals[3], s.target_kl):
                    # Stop BEFORE this step, as the reference does: the offending minibatch is not applied.
                    optimizer.zero_grad()
                    early_stopped = True
                    break
                coef = s.max_grad_norm / (grad_norm + 1e-6)
                if coef < 1.0:
                    kernel.flat_grad.mul_(coef)
                optimizer.step()
                totals = [a + b for a, b in zip(totals, vals)]
                n_done += 1
            if early_stopped:
                break
    means = [t / n_done for t in totals] if n_done else [float("nan")] * n_stats
    out = dict(zip(STAT_NAMES, means))
    out.update(minibatches=float(n_done), skipped_minibatches=float(n_skipped), epochs_run=float(epochs_run),
               early_stopped=float(early_stopped))
    return out
