"""Acting with a recurrent policy's cores as plain cell arithmetic: ``RecurrentActorCritic.act`` at a third of
the eager cost.

A rollout step of a recurrent policy runs each core (``nn.LSTM`` / ``nn.GRU``) over one step of every env. The
eager call goes through oneDNN's sequence kernel, which at one step of a few envs costs far more than the
arithmetic. Here the cores step on cached, stacked weights: the input part of every core as one matmul (they read
the same features), the hidden part as one batched matmul over the cores, then the gate arithmetic (LSTM: both
biases folded into one; GRU: the hidden bias kept with ``W_hh``, as its candidate gate needs ``W_hn h + b_hn``).
The heads' hidden layers run as batched matmuls over the stacked actor and critic weights. A discrete head without
a mask samples with ``ActorCritic.sample``'s ops inline; any other head goes through the policy's own
``apply_mask``/``sample``/``log_prob_entropy``; so for the same RNG state the same random numbers are drawn.
Measured on this machine's CPU (one thread; 8 envs; LSTM of 64 units over 2 inputs, separate critic core, ReLU
heads of 64: the cartpole-novel preset; ``benchmarks/bench_acting.py --envs 8``): 185 us per call against 550 us
for the eager ``act``.

The cell arithmetic equals oneDNN's only to rounding (a few float32 ulps), so the log-probs it stores are not bit
for bit those the update's replay (``evaluate_sequence``) computes; ``exact_logp = False`` tells the trainer to
take pi_old's log-probs from one replay of the rollout's chunks before the update (``Trainer.update_batch``),
which keeps the first ratio of every update exactly 1 for one forward pass per update.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ppokit.policies.recurrent import RecurrentActorCritic, reset_state

__all__ = ["RecurrentActingKernel", "recurrent_kernel_supports"]


def recurrent_kernel_supports(policy: Any) -> bool:
    """Whether ``policy`` is a ``RecurrentActorCritic`` (LSTM or GRU cores, any encoder, any action kind)."""
    return isinstance(policy, RecurrentActorCritic)


class RecurrentActingKernel:
    """``act`` of a ``RecurrentActorCritic`` with its cores and heads stepped on cached stacked weights (see the
    module docstring); rebuilt after every step of ``optimizer`` (a step hook: torch's fused Adam writes the
    parameters without moving their version counters) and whenever a version counter moves (``load_state_dict``,
    in-place edits)."""

    # Its log-probs equal the update's replay only to rounding: the trainer recomputes pi_old's by one replay.
    exact_logp = False

    def __init__(self, policy: RecurrentActorCritic, optimizer: torch.optim.Optimizer | None = None):
        if not recurrent_kernel_supports(policy):
            raise ValueError(f"the recurrent acting kernel needs a RecurrentActorCritic, got {type(policy).__name__}")
        self.policy = policy
        self.lstm = policy.cell == "lstm"
        self.cores = [policy.actor_core] + ([policy.critic_core] if policy.critic_core is not None else [])
        self.H = policy.recurrent_hidden
        self.act_ = torch.relu_ if policy.activation == "relu" else torch.tanh_
        self._params = list(policy.parameters())
        self._token: int | None = None
        if optimizer is not None:
            optimizer.register_step_post_hook(lambda *_: self.invalidate())

    def invalidate(self) -> None:
        """Drop the cached weights (needed only after writing the parameters through ``.data``)."""
        self._token = None

    def _refresh(self) -> None:
        """Rebuild the stacked weights when a parameter changed (the sum of the version counters grows)."""
        token = sum(p._version for p in self._params)
        if token == self._token:
            return
        pi, cores = self.policy, self.cores
        with torch.no_grad(), torch.inference_mode(False):
            # The input part of every core as one [F, C * G] matmul (the cores read the same features), the hidden
            # part per core as a batched [C, H, G] one; G = 4H (LSTM: i, f, g, o) or 3H (GRU: r, z, n).
            self._Wx = torch.cat([c.weight_ih_l0 for c in cores], 0).t().contiguous()
            self._Wh = torch.stack([c.weight_hh_l0.t() for c in cores]).contiguous()
            if self.lstm:  # both biases add to every gate
                self._bx = torch.cat([c.bias_ih_l0 + c.bias_hh_l0 for c in cores])
            else:  # the GRU's candidate gate reads r * (W_hn h + b_hn): the hidden bias stays with W_hh
                self._bx = torch.cat([c.bias_ih_l0 for c in cores])
                self._bh = torch.stack([c.bias_hh_l0.unsqueeze(0) for c in cores])
            # The heads' hidden layers, actor's and critic's stacked ([2, in, out]); their output layers apart.
            a = [m for m in pi.actor_head if isinstance(m, torch.nn.Linear)]
            v = [m for m in pi.critic_head if isinstance(m, torch.nn.Linear)]
            self._hidden = [(torch.stack([la.weight.t(), lv.weight.t()]).contiguous(),
                             torch.stack([la.bias.unsqueeze(0), lv.bias.unsqueeze(0)]))
                            for la, lv in zip(a[:-1], v[:-1])]
            self._a_out = (a[-1].weight.t().contiguous(), a[-1].bias.clone())
            self._v_out = (v[-1].weight[0].clone(), v[-1].bias.clone())
        self._token = token

    def _cores(self, feats: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """One step of every core: (outputs ``[C, B, H]``, next state ``[B, k, H]`` in the policy's layout)."""
        C, B, H = len(self.cores), feats.shape[0], self.H
        per = 2 if self.lstm else 1
        hs = state.view(B, C, per, H)  # core-major: (h, c) or (h,) per core
        h = hs[:, :, 0].transpose(0, 1)  # [C, B, H]
        gx = torch.addmm(self._bx, feats, self._Wx).view(B, C, -1).transpose(0, 1)  # [C, B, G]
        if self.lstm:
            gates = torch.baddbmm(gx, h, self._Wh)  # [C, B, 4H]: i, f, g, o
            s = torch.sigmoid(gates)
            c = torch.addcmul(s[..., H:2 * H] * hs[:, :, 1].transpose(0, 1), s[..., :H], gates[..., 2 * H:3 * H].tanh())
            h_new = s[..., 3 * H:] * torch.tanh(c)
            new = torch.stack((h_new, c), 2)  # [C, B, 2, H]
        else:
            gh = torch.baddbmm(self._bh, h, self._Wh)  # [C, B, 3H]: r, z, n
            rz = torch.sigmoid(gx[..., :2 * H] + gh[..., :2 * H])
            n = torch.tanh(torch.addcmul(gx[..., 2 * H:], rz[..., :H], gh[..., 2 * H:]))
            h_new = torch.addcmul(n, rz[..., H:], h - n)  # (1 - z) n + z h
            new = h_new.unsqueeze(2)
        return h_new, new.transpose(0, 1).reshape(B, C * per, H)

    def act(self, obs: Any, state: Tensor, episode_start: Any, action_mask: Tensor | None = None,
            deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``RecurrentActorCritic.act`` (same signature and outputs) on the cached weights. The sampling and the
        log-prob are the policy's own (a discrete head without a mask: the same ops inline), so for the same RNG
        state the actions are the same."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.act(obs, state, episode_start, action_mask, deterministic)
        pi = self.policy
        self._refresh()
        state = reset_state(state, episode_start)
        out, state = self._cores(pi.trunk(obs), state)
        x = out.expand(2, *out.shape[1:])  # [actor, critic] inputs (a shared core feeds both)
        for W, b in self._hidden:
            x = self.act_(torch.baddbmm(b, x, W))
        W, b = self._a_out
        head = torch.addmm(b, x[0], W)
        w, bv = self._v_out
        values = torch.addmv(bv, x[1], w)
        if pi.kind == "discrete" and action_mask is None:
            if deterministic:
                actions = head.argmax(-1)
            else:  # ActorCritic.sample's Gumbel-max, op for op
                u = torch.rand_like(head).clamp_(min=1e-20)
                actions = (head - torch.log(-torch.log(u))).argmax(-1)
            logp = torch.log_softmax(head, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
            return actions, logp, values, state
        head = pi.apply_mask(head, action_mask)
        actions = pi.sample(head, deterministic)
        logp, _ = pi.log_prob_entropy(head, actions)
        return actions, logp, values, state
