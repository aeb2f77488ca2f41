"""The policy protocol, the flat-MLP actor-critic and the action distributions all policies share.

``Policy`` is what the trainer, the collector, checkpoints and ``Agent`` ask of a policy. ``ActorCritic`` is the
MLP over a flat observation (a Box vector, a one-hot Discrete); the fused update and acting kernels apply to it.
It is registered as the ``"actor_critic"`` type (``registry``).

The three policies of PPO are kept apart by construction: ``ActorCritic`` is pi_theta (the module being
optimized); pi_old is never a module but the ``logp_old`` tensor frozen into the rollout buffer at acting time
(the ratio's denominator); pi_ref (a frozen reference for a KL penalty) is a separate, frozen copy made with
``frozen_copy`` and only ever enters a penalty term.

Distributions are written with plain tensor ops rather than ``torch.distributions``: the hot path samples and
scores thousands of actions per update, and argument validation and object construction dominate there.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ppokit.core.objectives import categorical_entropy, gaussian_entropy
from ppokit.policies.registry import DEFAULT_POLICY_TYPE, register_policy

__all__ = ["ActorCritic", "Policy", "PolicyBase", "StatefulPolicy", "action_spec", "frozen_copy", "layer_init", "mask_logits",
           "ACTIVATIONS", "MASKED_LOGIT"]

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)

# The logit a masked action gets. Finite on purpose: with -inf (or float32's min, which the log-softmax's
# subtraction turns into -inf) the entropy's p * log p is 0 * -inf = NaN. After the log-softmax a masked action's
# log-prob is about -1e8, so exp() gives exactly 0.0 in float32/float64 and p * log p is exactly 0.
MASKED_LOGIT = -1e8


def mask_logits(head: Tensor, action_mask: Tensor | None) -> Tensor:
    """``head`` with the logits where ``action_mask`` is False replaced by ``MASKED_LOGIT``; ``head`` itself when
    there is no mask. ``torch.where`` routes no gradient to the replaced entries, so masked actions get exactly 0
    gradient. ``action_mask`` is bool ``[B, n_logits]`` (one column per logit: for MultiDiscrete the sub-action
    masks side by side, as SB3-contrib lays them out)."""
    if action_mask is None:
        return head
    return torch.where(action_mask, head, torch.full((), MASKED_LOGIT, dtype=head.dtype, device=head.device))


def layer_init(layer: nn.Linear, gain: float, bias: float = 0.0) -> nn.Linear:
    """Orthogonal weight init with ``gain`` and a constant bias (the PPO implementation-details default)."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, bias)
    return layer


def mlp(in_dim: int, hidden: list[int], out_dim: int, activation: str, out_gain: float) -> nn.Sequential:
    """Linear-activation stack ``in_dim -> hidden... -> out_dim``; hidden gain sqrt(2), head gain ``out_gain``."""
    act = ACTIVATIONS[activation]
    layers: list[nn.Module] = []
    last = in_dim
    for width in hidden:
        layers += [layer_init(nn.Linear(last, width), math.sqrt(2.0)), act()]
        last = width
    layers.append(layer_init(nn.Linear(last, out_dim), out_gain))
    return nn.Sequential(*layers)


@runtime_checkable
class Policy(Protocol):
    """What ppokit asks of a policy (pi_theta). ``obs`` is what the observation encoder makes of a batch: a
    ``[B, obs_dim]`` float tensor, a ``[B, C, H, W]`` uint8 image tensor, or a dict of such parts.

    Attributes: ``kind`` (``discrete`` | ``multidiscrete`` | ``continuous``), ``action_dims``, ``obs_dim`` (the
    encoded observation's element count), ``obs_encoding`` (the encoder's spec, None for a flat Box). ``actor(obs)``
    (the head: logits or Gaussian mean) and ``sample(head, deterministic)`` serve the critic-free evaluation gate.

    Acting carries a state, in the shape of Stable-Baselines3's ``predict(obs, state, episode_start)`` (SB3-contrib's
    ``RecurrentPPO``): whoever steps envs starts from ``state = initial_state(num_envs)``, passes back the state
    each ``act`` returned, and passes ``episode_start``, a bool numpy array ``[B]`` that is True where ``obs`` is
    the first observation of an episode (after a reset, in either autoreset mode), where a recurrent policy starts
    that env's state afresh. A stateless (feed-forward) policy's state is None: ``initial_state`` and ``act``
    return None and ``episode_start`` is ignored (None will do).
    """

    kind: str
    action_dims: list[int]
    obs_dim: int

    def initial_state(self, num_envs: int) -> Any:
        """The state ``act`` starts ``num_envs`` envs from; None for a stateless policy."""

    def act(self, obs: Any, state: Any, episode_start: Any, action_mask: Tensor | None = None,
            deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor, Any]:
        """``(actions, logp [B], values [B], next state)``; masked actions (bool ``[B, n_logits]``, False) never
        sampled."""

    def evaluate(self, obs: Any, actions: Tensor,
                 action_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(logp_new [B], entropy [B], values [B])`` of stored ``actions`` (under the stored mask)."""

    def value(self, obs: Any, state: Any = None, episode_start: Any = None) -> Tensor:
        """State values ``[B]``; a stateful policy's from ``state`` (rows as in ``act``, reset where
        ``episode_start``; None: a fresh state). A stateless one ignores both."""

    def spec(self) -> dict:
        """Constructor arguments plus ``"type"`` (the registered name): ``policy_from_spec`` rebuilds it."""


@runtime_checkable
class StatefulPolicy(Policy, Protocol):
    """A policy whose ``initial_state(num_envs)`` is not None (a recurrent one): it trains on sequence minibatches
    (``update.epochs.SequenceBatch``), whole env chunks replayed in order, never on shuffled rows.

    A state is a tensor or a tuple / dict of tensors, each with the env axis FIRST (``[N, ...]``; an ``nn.LSTM``'s
    ``[layers, N, H]`` is transposed by the policy), so that the rollout stores it per step as ``[T, N, ...]``.
    """

    def evaluate_sequence(self, obs: Any, actions: Tensor, state0: Any, episode_start: Tensor,
                          action_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Update: ``(logp_new, entropy, values)``, each ``[L, M]``, of ``M`` chunks of ``L`` steps (``obs``,
        ``actions``, ``episode_start`` and ``action_mask`` time-major ``[L, M, ...]``).

        The chunk is replayed in order from ``state0`` (each tensor ``[M, ...]``: the state that was passed into
        ``act`` at the chunk's first step during the rollout); wherever ``episode_start[t, m]`` is True the state
        of chunk ``m`` is reset to the initial one before step ``t``, exactly as ``act`` did, so that with
        unchanged weights the log-probs equal the rollout's (the first ratio is exactly 1). Padded steps (past
        the rollout's end) hold zeros; their outputs are ignored (masked out of the loss)."""


class PolicyBase(nn.Module):
    """The action distribution every policy shares: categorical (``discrete``), independent categoricals
    (``multidiscrete``) or a diagonal Gaussian with a state-independent learned ``log_std`` (``continuous``,
    created by the subclass so that its parameter order is its own), plus masking of categorical heads."""

    def __init__(self, kind: str, action_dims: list[int]):
        super().__init__()
        if kind not in ("discrete", "multidiscrete", "continuous"):
            raise ValueError(f"unsupported action kind {kind!r}")
        self.kind = kind
        self.action_dims = list(action_dims)
        self.n_out = sum(self.action_dims) if kind != "continuous" else self.action_dims[0]

    def initial_state(self, num_envs: int) -> None:
        """None: these policies are stateless (a recurrent subclass returns its zero state here)."""
        return None

    def apply_mask(self, head: Tensor, action_mask: Tensor | None) -> Tensor:
        """``head`` with ``action_mask`` applied (categorical heads only); ``head`` itself without a mask."""
        if action_mask is None:
            return head
        if self.kind == "continuous":
            raise ValueError("action masks apply to Discrete and MultiDiscrete actions, not to continuous ones")
        return mask_logits(head, action_mask)

    def log_prob_entropy(self, head: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
        """Log-probability of ``actions`` and entropy from the actor's output ``head``; both ``[B]``."""
        if self.kind == "continuous":
            log_std = self.log_std.expand_as(head)
            z = (actions - head) * torch.exp(-log_std)
            logp = (-0.5 * z * z - log_std - _LOG_SQRT_2PI).sum(-1)
            return logp, gaussian_entropy(log_std)
        if self.kind == "discrete":
            logits = head - head.logsumexp(-1, keepdim=True)
            logp = logits.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
            return logp, categorical_entropy(logits)
        logp = torch.zeros(head.shape[0], device=head.device, dtype=head.dtype)
        ent = torch.zeros_like(logp)
        for i, chunk in enumerate(torch.split(head, self.action_dims, dim=-1)):
            chunk = chunk - chunk.logsumexp(-1, keepdim=True)
            logp = logp + chunk.gather(-1, actions[:, i].long().unsqueeze(-1)).squeeze(-1)
            ent = ent + categorical_entropy(chunk)
        return logp, ent

    def sample(self, head: Tensor, deterministic: bool = False) -> Tensor:
        """Actions from the actor's output ``head``: ``[B]`` ints (discrete), ``[B, k]`` (multi), ``[B, D]`` floats."""
        if self.kind == "continuous":
            if deterministic:
                return head
            return head + torch.exp(self.log_std) * torch.randn_like(head)
        chunks = [head] if self.kind == "discrete" else torch.split(head, self.action_dims, dim=-1)
        picks = []
        for chunk in chunks:
            if deterministic:
                picks.append(chunk.argmax(-1))
            else:
                # Gumbel-max: one fused op per batch instead of a multinomial draw per row.
                u = torch.rand_like(chunk).clamp_(min=1e-20)
                picks.append((chunk - torch.log(-torch.log(u))).argmax(-1))
        return picks[0] if self.kind == "discrete" else torch.stack(picks, -1)



class ActorCritic(PolicyBase):
    """Separate actor and critic MLPs over a flat observation (registered as ``"actor_critic"``).

    ``kind`` is ``discrete`` (categorical over ``action_dims[0]`` actions), ``multidiscrete`` (independent
    categoricals, one per entry of ``action_dims``) or ``continuous`` (diagonal Gaussian with a state-independent
    learned log-std over ``action_dims[0]`` dims).
    """

    def __init__(self, obs_dim: int, kind: str, action_dims: list[int], hidden_sizes: list[int], activation: str = "tanh",
                 obs_encoding: dict | None = None):
        super().__init__(kind, action_dims)
        self.obs_dim = obs_dim
        # How env observations become the obs_dim inputs (encoders.encoder_from_spec); None: a flattened Box.
        self.obs_encoding = obs_encoding
        self.activation = activation
        self.hidden_sizes = list(hidden_sizes)
        # Created in this order (actor, critic, log_std): the parameter order FlatAdam and checkpoints rely on.
        self.actor = mlp(obs_dim, hidden_sizes, self.n_out, activation, out_gain=0.01)
        self.critic = mlp(obs_dim, hidden_sizes, 1, activation, out_gain=1.0)
        if kind == "continuous":
            self.log_std = nn.Parameter(torch.zeros(action_dims[0]))

    def value(self, obs: Tensor, state: None = None, episode_start: Any = None) -> Tensor:
        """State values ``[B, obs_dim] -> [B]`` (stateless: ``state`` and ``episode_start`` are ignored)."""
        return self.critic(obs).squeeze(-1)

    # ------------------------------------------------------------------ the two calls PPO makes
    def masked_head(self, obs: Tensor, action_mask: Tensor | None = None) -> Tensor:
        """The actor's output for ``obs`` with ``action_mask`` applied (categorical heads only)."""
        return self.apply_mask(self.actor(obs), action_mask)

    def act(self, obs: Tensor, state: None, episode_start: Any, action_mask: Tensor | None = None,
            deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor, None]:
        """Acting: ``obs [B, obs_dim] -> (actions, logp [B], values [B], None)``; call under
        ``torch.inference_mode``. Stateless: ``state`` (None) and ``episode_start`` are ignored (``Policy``). With
        ``action_mask`` (bool ``[B, n_logits]``) masked actions are never sampled and ``logp`` is the masked
        distribution's, as ``evaluate`` recomputes it."""
        head = self.masked_head(obs, action_mask)
        actions = self.sample(head, deterministic)
        logp, _ = self.log_prob_entropy(head, actions)
        return actions, logp, self.value(obs), None

    def evaluate(self, obs: Tensor, actions: Tensor,
                 action_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Update: ``(logp_new [B], entropy [B], values [B])`` of stored ``actions`` under pi_theta (under the
        stored ``action_mask``, if any: masked actions carry no probability and no entropy)."""
        logp, ent = self.log_prob_entropy(self.masked_head(obs, action_mask), actions)
        return logp, ent, self.value(obs)

    def spec(self) -> dict:
        """Constructor arguments, to rebuild the module from a checkpoint."""
        spec = {"type": DEFAULT_POLICY_TYPE, "obs_dim": self.obs_dim, "kind": self.kind,
                "action_dims": self.action_dims, "hidden_sizes": self.hidden_sizes, "activation": self.activation}
        if self.obs_encoding is not None:  # a Box policy's spec stays what it always was
            spec["obs_encoding"] = dict(self.obs_encoding)
        return spec


def action_spec(action_space) -> tuple[str, list[int]]:
    """``(kind, action_dims)`` for a Gymnasium action space; ValueError for unsupported spaces."""
    from gymnasium import spaces

    if isinstance(action_space, spaces.Discrete):
        return "discrete", [int(action_space.n)]
    if isinstance(action_space, spaces.MultiDiscrete):
        if action_space.nvec.ndim != 1:
            raise ValueError("MultiDiscrete action spaces must be one-dimensional")
        return "multidiscrete", [int(n) for n in action_space.nvec]
    if isinstance(action_space, spaces.Box):
        if len(action_space.shape) != 1:
            raise ValueError(f"Box action spaces must be one-dimensional, got shape {action_space.shape}")
        return "continuous", [int(action_space.shape[0])]
    raise ValueError(
        f"unsupported action space {type(action_space).__name__}: ppokit supports Discrete, MultiDiscrete and "
        "one-dimensional Box actions")


register_policy(DEFAULT_POLICY_TYPE, ActorCritic)


def frozen_copy(module: nn.Module) -> nn.Module:
    """A deep copy with gradients off and eval mode: a frozen pi_ref that optimization cannot touch."""
    ref = copy.deepcopy(module)
    ref.requires_grad_(False)
    return ref.eval()
