"""Acting on cached "acting weights": ``ActorCritic.act`` for MLP policies at a fraction of the eager cost.

During the rollout the policy runs without backward, once per env step; at CartPole's sizes the eager modules'
per-op dispatch costs more than the arithmetic. ``ActingKernel`` runs the same network on weights derived from
the parameters (see the comment in the class), rebuilt whenever a parameter changes, with every intermediate
buffer preallocated per batch size, and draws its random numbers exactly as ``ActorCritic.sample`` does, so for
the same RNG state it takes the same actions. On the torch 2.13 CPU build measured, tanh of a 256x64 matrix takes
~44 us and sigmoid ~8 us, hence tanh as ``2*sigmoid(2x) - 1`` with the affine folded into the next layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ppokit.kernels.mlp_backward import unsupported_reason
from ppokit.policies import ActorCritic

__all__ = ["ActingKernel"]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


class ActingKernel:
    """``act`` and ``actor_head`` of an MLP ``ActorCritic`` (see ``mlp_backward.unsupported_reason``) on cached
    acting weights. With the policy's ``FlatAdam`` as ``optimizer`` its steps are seen as well (they write the
    flat buffer, which the parameters' own version counters do not see)."""

    # ``act`` takes ``out=``, so a rollout loop can have it write straight into its buffer rows (``one_env``).
    writes_into_out = True

    def __init__(self, policy: ActorCritic, optimizer=None):
        reason = unsupported_reason(policy, "ppo")
        if reason is not None:
            raise ValueError(f"the acting kernel does not support this policy: {reason}")
        self.kind = policy.kind
        self.tanh = policy.activation == "tanh"
        self.optimizer = optimizer
        first = policy.actor[0].weight
        self.device, self.dtype = first.device, first.dtype

        def layers(net: nn.Sequential) -> tuple[list[Tensor], list[Tensor]]:
            lin = [m for m in net if isinstance(m, nn.Linear)]
            # .data: under FlatAdam the views into the flat buffer, so its in-place steps are read here.
            return [m.weight.data for m in lin], [m.bias.data for m in lin]

        self.actor = layers(policy.actor)
        self.critic = layers(policy.critic)
        if self.kind == "continuous":
            self.log_std = policy.log_std.data
        self._params = list(policy.parameters())
        self._acting_token: int | None = None
        self._alloc_acting()

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
        """A number that grows whenever the parameters may have changed: the autograd version counters of every
        module parameter plus, with a ``FlatAdam``, its own step counter and the flat buffer's version counter
        (monotone, so a sum suffices)."""
        opt = self.optimizer
        base = 0 if opt is None else opt.version + opt.flat._version
        return sum([p._version for p in self._params], base)

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
        aW, ab = self.actor
        cW, cb = self.critic
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

    def act(self, obs: Tensor, state: None, episode_start: Any, action_mask: None = None,
            deterministic: bool = False, out: tuple[Tensor, Tensor, Tensor] | None = None,
            ) -> tuple[Tensor, Tensor, Tensor, None]:
        """``ActorCritic.act`` on the acting weights: (actions, logp [B], values [B], None), fresh tensors, or
        written into ``out`` (three tensors of those shapes and dtypes, e.g. the rollout buffer's rows of this
        step: the same ops with ``out=``, so the same bits, without a copy each). Stateless, as the policy:
        ``state`` is None and ``episode_start`` is ignored. No action masks (a masked run acts eagerly).

        The random numbers are drawn as ``ActorCritic.sample`` draws them (one uniform or normal fill of a
        ``[B, A]`` tensor), so for the same RNG state the actions are the same.
        """
        if action_mask is not None:
            raise ValueError("the acting kernel has no action masks; act with the policy itself")
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.act(obs, state, episode_start, None, deterministic, out)
        a_out, logp_out, v_out = (None, None, None) if out is None else out
        ha, ha_t, hc, noise = self._hidden(obs)
        wc, bc = self._c_head
        values = torch.addmv(bc, hc, wc, out=v_out)
        if self.kind == "discrete":
            W, b = self._a_head_t
            head_t = torch.addmm(b, W, ha_t)  # [A, B]
            if deterministic:
                scores = noise.copy_(head_t.t())
            else:
                # Gumbel-max with exactly the ops of ActorCritic.sample: head - log(-log(max(u, 1e-20))), the
                # uniforms filling a [B, A] tensor in row-major order as torch.rand_like(head) does.
                g = noise.uniform_().clamp_(min=1e-20).log_().neg_().log_()
                scores = torch.sub(head_t.t(), g, out=g)
            actions = torch.argmax(scores, 1, out=a_out)
            logp = torch.gather(torch.log_softmax(head_t, 0), 0, actions.unsqueeze(0),
                                out=None if logp_out is None else logp_out.view(1, -1)).view(-1)
        else:
            Wt, b = self._a_head
            head = torch.addmm(b, ha, Wt)
            if deterministic:
                actions = head if a_out is None else a_out.copy_(head)
            else:
                actions = torch.addcmul(head, self._std, noise.normal_(), out=a_out)
            # log N(a; mu, std) = -0.5 |(a - mu)/std|^2 - sum(log std) - D log sqrt(2 pi), from the actions as stored.
            z = torch.sub(actions, head, out=noise).mul_(self._inv_std)
            logp = torch.add(self._neg_logp_const, z.mul_(z).sum(1), alpha=-0.5, out=logp_out)
        return actions, logp, values, None
