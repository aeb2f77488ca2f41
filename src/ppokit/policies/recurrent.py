"""Recurrent actor-critics: an LSTM or GRU core between the observation encoder and the heads.

``RecurrentActorCritic`` (registered as ``"recurrent_actor_critic"``) is for tasks where one observation does not
show the state (hidden velocities, a cue to remember). Its layout is sb3-contrib's ``RecurrentActorCriticPolicy``
(features -> recurrent core -> MLP heads), with CleanRL's ``ppo_atari_lstm.py`` as the image case:

* features: a flat observation as it is (sb3's ``FlattenExtractor``); an image through the Nature CNN (512
  features, CleanRL's layout); a Dict/Tuple through a CNN per image part, its vector parts concatenated
  (``encoder_networks.ObservationTrunk`` with no MLP);
* the core, ``nn.LSTM`` or ``nn.GRU`` of ``recurrent_hidden`` units. ``critic="separate"`` gives the critic its
  own core over the same features (sb3-contrib's ``enable_critic_lstm``, its default), ``"shared"`` lets both
  heads read one core (CleanRL); the core's weights orthogonal (gain 1) and its biases 0, as CleanRL initializes
  them;
* the heads: an actor MLP (``hidden_sizes``, ``activation``, output gain 0.01) and a critic MLP (output gain 1).

The state is one float tensor ``[B, k, H]`` with the env on the first axis (so a buffer stores it per env and a
chunk's initial state is a row gather): ``k`` = 2 per LSTM core (h, c), 1 per GRU core, the actor's core first.
It starts at zeros (``initial_state``) and is zeroed where ``episode_start`` is True before the step.

``evaluate_sequence`` replays chunks of env sequences in order from their stored initial state, restarting the
state at every episode start inside a chunk. Two ways compute the same numbers (to the last bits: on one CI
machine's CPU the stepped LSTM with gradients on rounded differently from the padded call, which matched act's):
``_segments`` makes every stretch between resets its own sequence of one zero-padded ``nn.LSTM``/``nn.GRU`` call;
``_stepped`` steps the core once per step with the resets masked in (sb3-contrib's way). Measured on this
machine's CPU (one thread, CPU time of forward + backward, LSTM 64 units over 2 inputs, separate critic, heads of
64; ``benchmarks/bench_recurrent_sequence.py``), L = 32..128 steps by M = 8..64 chunks, episode starts with
probability 0.01-0.2 per step: the single call is 2-10x faster (3.7 ms against 39 ms at L = 32, M = 8) until the
padding grows (many resets in long, wide chunks: 0.6-0.9x at L = 128, M = 64 with a start every 5-20 steps). A
stepped call costs about as much as ``STEP_CALL_ROWS`` padded rows plus one per chunk, so ``evaluate_sequence``
takes the single call when its padded rows ``S * L_max`` cost less than ``L`` stepped calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ppokit.config.ppo_config import RECURRENT_CRITICS
from ppokit.envs.encoders import DictEncoder, ImageEncoder, encoder_from_spec, obs_map
from ppokit.policies.actor_critic import ACTIVATIONS, PolicyBase, mlp
from ppokit.policies.encoder_networks import ObservationTrunk
from ppokit.policies.registry import register_policy

__all__ = ["RecurrentActorCritic", "STEP_CALL_ROWS", "RECURRENT_CELLS", "RECURRENT_CRITICS", "RECURRENT_TYPE", "reset_state"]

RECURRENT_TYPE = "recurrent_actor_critic"
RECURRENT_CELLS = {"lstm": nn.LSTM, "gru": nn.GRU}  # config.ppo_config.RECURRENT's cores
# One stepped core call (forward + backward, two cores and heads) costs about as much CPU time as this many rows of
# the single padded call: 1.2 ms against 7.3 us a row, measured as in the module docstring.
STEP_CALL_ROWS = 160


def reset_state(state: Tensor, episode_start: Any) -> Tensor:
    """``state`` ``[B, ...]`` with the rows where ``episode_start`` (bool ``[B]``, numpy or tensor) is True zeroed."""
    starts = torch.as_tensor(np.array(episode_start, dtype=bool) if not isinstance(episode_start, Tensor)
                             else episode_start, device=state.device)
    if not bool(starts.any()):
        return state
    return state.masked_fill(starts.view(-1, *([1] * (state.dim() - 1))), 0.0)


def init_core(core: nn.RNNBase) -> nn.RNNBase:
    """CleanRL's init of the recurrent weights (``ppo_atari_lstm.py``): every weight matrix orthogonal with gain
    1, every bias 0."""
    for name, param in core.named_parameters():
        if name.startswith("bias"):
            nn.init.constant_(param, 0.0)
        else:
            nn.init.orthogonal_(param, 1.0)
    return core


class _Identity(nn.Module):
    """The features of a flat observation: the observation itself (``out_dim`` of them)."""

    def __init__(self, out_dim: int):
        super().__init__()
        self.out_dim = out_dim

    def forward(self, obs: Tensor) -> Tensor:
        return obs


class RecurrentActorCritic(PolicyBase):
    """Features -> LSTM/GRU core(s) -> actor and critic MLP heads; see the module docstring.

    ``obs_encoding`` is the observation encoder's spec (None: a flat Box of ``obs_dim`` features); ``kind`` and
    ``action_dims`` as for ``ActorCritic``; ``hidden_sizes``/``activation`` are the heads'; ``cell`` is
    ``"lstm"`` or ``"gru"``, ``recurrent_hidden`` its width, ``critic`` ``"separate"`` or ``"shared"``.
    """

    def __init__(self, obs_dim: int, kind: str, action_dims: list[int], hidden_sizes: list[int],
                 activation: str = "tanh", obs_encoding: dict | None = None, cell: str = "lstm",
                 recurrent_hidden: int = 128, critic: str = "separate"):
        super().__init__(kind, action_dims)
        if cell not in RECURRENT_CELLS:
            raise ValueError(f"unknown recurrent cell {cell!r} (known: {', '.join(RECURRENT_CELLS)})")
        if critic not in RECURRENT_CRITICS:
            raise ValueError(f"recurrent critic must be one of {', '.join(RECURRENT_CRITICS)}, got {critic!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}")
        if not (isinstance(recurrent_hidden, int) and recurrent_hidden >= 1):
            raise ValueError(f"recurrent_hidden must be a positive integer, got {recurrent_hidden!r}")
        encoder = encoder_from_spec(obs_encoding, obs_dim)
        if int(obs_dim) != encoder.flat_dim:
            raise ValueError(f"obs_dim {obs_dim} does not match the observation encoding ({encoder.flat_dim})")
        self.obs_dim, self.obs_encoding = int(obs_dim), obs_encoding
        self.hidden_sizes, self.activation = list(hidden_sizes), activation
        self.cell, self.recurrent_hidden, self.critic = cell, int(recurrent_hidden), critic
        # Images and Dict/Tuple through the CNN trunk (no MLP on the vector parts: the core reads them directly).
        self.trunk = ObservationTrunk(encoder, [], activation) if isinstance(encoder, (ImageEncoder, DictEncoder)) \
            else _Identity(encoder.flat_dim)
        make = RECURRENT_CELLS[cell]
        self.actor_core = init_core(make(self.trunk.out_dim, self.recurrent_hidden))
        self.critic_core = init_core(make(self.trunk.out_dim, self.recurrent_hidden)) if critic == "separate" \
            else None
        self.actor_head = mlp(self.recurrent_hidden, self.hidden_sizes, self.n_out, activation, out_gain=0.01)
        self.critic_head = mlp(self.recurrent_hidden, self.hidden_sizes, 1, activation, out_gain=1.0)
        if kind == "continuous":
            self.log_std = nn.Parameter(torch.zeros(action_dims[0]))
        self._per_core = 2 if cell == "lstm" else 1  # state vectors per core: (h, c) or h

    # ------------------------------------------------------------------ the state
    @property
    def state_size(self) -> int:
        """``k``: state vectors per env (2 per LSTM core, 1 per GRU core)."""
        return self._per_core * (2 if self.critic_core is not None else 1)

    def initial_state(self, num_envs: int) -> Tensor:
        """Zeros ``[num_envs, k, recurrent_hidden]`` on the policy's device."""
        p = self.actor_head[0].weight
        return torch.zeros(num_envs, self.state_size, self.recurrent_hidden, dtype=p.dtype, device=p.device)

    def _core(self, core: nn.RNNBase, x: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """``core`` over ``x`` ``[L, B, F]`` from ``state`` ``[B, per_core, H]`` -> (outputs ``[L, B, H]``, the
        state after the last step ``[B, per_core, H]``)."""
        hx = state.transpose(0, 1).contiguous()  # [per_core, B, H]: nn.LSTM's (num_layers=1, B, H) layout
        if self._per_core == 2:
            out, (h, c) = core(x, (hx[0:1], hx[1:2]))
            return out, torch.stack((h[0], c[0]), 1)
        out, h = core(x, hx[0:1])
        return out, h[0].unsqueeze(1)

    def _cores(self, x: Tensor, state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Actor and critic core outputs ``[L, B, H]`` (the same tensor when shared) and the next state."""
        k = self._per_core
        out_a, next_a = self._core(self.actor_core, x, state[:, :k])
        if self.critic_core is None:
            return out_a, out_a, next_a
        out_c, next_c = self._core(self.critic_core, x, state[:, k:])
        return out_a, out_c, torch.cat((next_a, next_c), 1)

    # ------------------------------------------------------------------ acting (one step of every env)
    def act(self, obs: Any, state: Tensor, episode_start: Any, action_mask: Tensor | None = None,
            deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One step of every env: ``(actions, logp [B], values [B], next state)``, the state zeroed first where
        ``episode_start`` is True; call under ``torch.inference_mode``."""
        state = reset_state(state, episode_start)
        feats = self.trunk(obs).unsqueeze(0)  # [1, B, F]
        out_a, out_c, state = self._cores(feats, state)
        head = self.apply_mask(self.actor_head(out_a[0]), action_mask)
        actions = self.sample(head, deterministic)
        logp, _ = self.log_prob_entropy(head, actions)
        return actions, logp, self.critic_head(out_c[0]).squeeze(-1), state

    def value(self, obs: Any, state: Tensor | None = None, episode_start: Any = None) -> Tensor:
        """V ``[B]`` of ``obs`` stepped from ``state`` (reset where ``episode_start``); None: from a fresh state
        (the first observation of an episode)."""
        n = _rows(obs)
        state = self.initial_state(n) if state is None else state
        if episode_start is not None:
            state = reset_state(state, episode_start)
        feats = self.trunk(obs).unsqueeze(0)
        if self.critic_core is None:
            out, _ = self._core(self.actor_core, feats, state[:, :self._per_core])
        else:
            out, _ = self._core(self.critic_core, feats, state[:, self._per_core:])
        return self.critic_head(out[0]).squeeze(-1)

    def actor(self, obs: Any) -> Tensor:
        """The actor's output from a fresh state (the first step of an episode); acting carries the state
        through ``act``."""
        feats = self.trunk(obs).unsqueeze(0)
        out, _ = self._core(self.actor_core, feats, self.initial_state(_rows(obs))[:, :self._per_core])
        return self.actor_head(out[0])

    # ------------------------------------------------------------------ training (chunks of env sequences)
    def evaluate_sequence(self, obs: Any, actions: Tensor, state0: Tensor, episode_start: Tensor,
                          action_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(logp [L, M], entropy [L, M], values [L, M])`` of ``actions`` over ``M`` chunks of ``L`` steps
        (``obs [L, M, ...]``, ``actions [L, M, ...]``, ``action_mask [L, M, n_logits]``), replayed in order from
        ``state0`` ``[M, k, H]`` (each chunk's state before its first step), the state zeroed at every step where
        ``episode_start`` ``[L, M]`` is True: the numbers ``act`` computed on the same steps."""
        L, M = episode_start.shape
        flat = obs_map(lambda x: x.reshape(L * M, *x.shape[2:]), obs)
        feats = self.trunk(flat).reshape(L, M, -1)
        starts = episode_start.bool()
        replay = _segments if _padded_rows(starts) <= L * (STEP_CALL_ROWS + M) else _stepped
        out_a, out_c = replay(self, feats, state0, starts)
        mask = None if action_mask is None else action_mask.reshape(L * M, -1)
        head = self.apply_mask(self.actor_head(out_a.reshape(L * M, -1)), mask)
        logp, entropy = self.log_prob_entropy(head, actions.reshape(L * M, *actions.shape[2:]))
        values = self.critic_head(out_c.reshape(L * M, -1)).squeeze(-1)
        return logp.reshape(L, M), entropy.reshape(L, M), values.reshape(L, M)

    def evaluate(self, obs: Any, actions: Tensor, action_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Refused: a recurrent policy's log-probs depend on the steps before, so the update replays whole
        sequences (``evaluate_sequence``), never shuffled steps."""
        raise ValueError("a recurrent policy is evaluated on whole env sequences (evaluate_sequence), not on "
                         "shuffled steps")

    def spec(self) -> dict:
        """Constructor arguments, to rebuild the module from a checkpoint."""
        return {"type": RECURRENT_TYPE, "obs_dim": self.obs_dim, "kind": self.kind, "action_dims": self.action_dims,
                "hidden_sizes": self.hidden_sizes, "activation": self.activation, "obs_encoding": self.obs_encoding,
                "cell": self.cell, "recurrent_hidden": self.recurrent_hidden, "critic": self.critic}


def _rows(obs: Any) -> int:
    return len(next(iter(obs.values()))) if isinstance(obs, dict) else obs.shape[0]


def _stretch_starts(starts: Tensor) -> Tensor:
    """Env-major ``[M * L]`` bool: True where a stretch begins (an episode start, or a chunk's first step)."""
    begins = starts.clone()
    begins[0] = True  # every chunk's first step begins a stretch (from state0 unless it is an episode start)
    return begins.t().reshape(-1)  # env m's steps are m*L .. m*L + L - 1


def _padded_rows(starts: Tensor) -> int:
    """``S * L_max``: the rows of ``_segments``' padded input for episode starts ``starts`` ``[L, M]``."""
    L, M = starts.shape
    first = _stretch_starts(starts).nonzero().squeeze(-1)
    ends = torch.cat((first[1:], first.new_full((1,), M * L)))
    return int(first.numel()) * int((ends - first).max())


def _segments(policy: RecurrentActorCritic, feats: Tensor, state0: Tensor,
              starts: Tensor) -> tuple[Tensor, Tensor]:
    """The cores' outputs ``[L, M, H]`` over ``feats`` ``[L, M, F]``, each env's chunk cut at its episode starts.

    Every stretch between two resets is its own sequence: stretch ``s`` of env ``m`` starting at step ``t0`` is
    column ``s`` of a zero-padded ``[L_max, S, F]`` input, starting from ``state0[m]`` (the chunk's first
    stretch, unless an episode starts at step 0) or from zeros. One core call runs them all; padded steps come
    after a stretch's end, so they never feed a kept output."""
    L, M, F = feats.shape
    flat_begin = _stretch_starts(starts)
    seg = torch.cumsum(flat_begin.long(), 0) - 1  # [M * L] the stretch of each step
    first_step = flat_begin.nonzero().squeeze(-1)  # [S] flat index of each stretch's first step
    pos = torch.arange(M * L, device=feats.device) - first_step[seg]  # step within its stretch
    S, L_max = int(first_step.numel()), int(pos.max()) + 1
    x = feats.new_zeros(L_max, S, F)
    x[pos, seg] = feats.transpose(0, 1).reshape(M * L, F)
    h0 = state0.new_zeros(S, *state0.shape[1:])
    chunk_first = seg[torch.arange(M, device=feats.device) * L]  # [M] the first stretch of each env's chunk
    h0[chunk_first] = reset_state(state0, starts[0])
    out_a, out_c, _ = policy._cores(x, h0)

    def back(out: Tensor) -> Tensor:  # [L_max, S, H] -> [L, M, H]
        return out[pos, seg].reshape(M, L, -1).transpose(0, 1)

    a = back(out_a)
    return a, (a if out_c is out_a else back(out_c))


def _stepped(policy: RecurrentActorCritic, feats: Tensor, state0: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
    """``_segments``' outputs by stepping the cores one step at a time with the resets masked in (sb3-contrib's
    way): cheaper when long, wide chunks hold many resets (see the module docstring)."""
    outs_a, outs_c, state = [], [], state0
    for t in range(feats.shape[0]):
        state = torch.where(starts[t].view(-1, 1, 1), torch.zeros((), dtype=state.dtype, device=state.device), state)
        out_a, out_c, state = policy._cores(feats[t:t + 1], state)
        outs_a.append(out_a)
        outs_c.append(out_c)
    a = torch.cat(outs_a)
    return a, (a if policy.critic_core is None else torch.cat(outs_c))


register_policy(RECURRENT_TYPE, RecurrentActorCritic)
