"""The algorithm variants by name: one registry, ``ALGOS``, and each variant described once.

An ``Algo`` says everything that makes ``ppo``, ``ppo-kl`` and ``a2c`` differ: its policy term (a function of the
per-sample log-probabilities and advantages, reduced through the objectives' ``mask``/``mode`` arguments, so a
token-level trainer reuses it with a ``[B, T]`` mask), whether the value loss is clipped, its schedule overrides
(a2c: one epoch of one minibatch, no KL early stop), the rule it applies after each update (ppo-kl: the adaptive
penalty ``adapt_kl_beta``), whether the clip-range guard rail applies and whether the fused kernel implements it.
The update, the trainer, the config and the fused kernel read these fields instead of comparing ``algo`` to
strings, so a new variant is one ``register(Algo(...))`` and touches no other module.

This module stays importable without torch (``PPOConfig`` validates ``algo`` against ``ALGOS`` and the CLI's start-up
must not load torch): the loss functions import the objectives when they are called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["UpdateSettings", "Algo", "ALGOS", "register", "get_algo", "describe_algos", "loss_terms", "adapt_kl_beta", "TERM_NAMES"]

# The signed loss terms every algo returns, in the order they are summed (``loss = policy + vf*value + ent*entropy``).
TERM_NAMES = ("policy", "value", "entropy")

# (logp_new, logp_old, ratio, advantages, settings, mask, mode) -> the scalar policy loss to minimize.
PolicyTerm = Callable[..., "Tensor"]


def adapt_kl_beta(beta: float, kl: float, target: float) -> float:
    """PPO-KL's adaptive penalty (Schulman et al. 2017, sec. 4): x2 if KL > 2*target, /2 if KL < target/2."""
    if kl > 2.0 * target:
        return beta * 2.0
    if kl < target / 2.0:
        return beta / 2.0
    return beta


@dataclass
class UpdateSettings:
    """The knobs of one update (already annealed for this iteration)."""

    algo: str  # a name in ALGOS
    update_epochs: int
    num_minibatches: int
    clip_coef: float
    clip_vloss: bool
    norm_adv: bool
    ent_coef: float
    vf_coef: float
    max_grad_norm: float
    target_kl: float | None
    kl_beta: float = 1.0


@dataclass(frozen=True)
class Algo:
    """One algorithm variant, described once.

    ``policy_term(logp_new, logp_old, ratio, advantages, settings, mask=None, mode="mean")`` is the scalar policy
    loss to minimize (``ratio = exp(logp_new - logp_old)``, already formed for the diagnostics). ``clip_value``:
    the value loss is clipped around the old values when the config's ``clip_vloss`` is on. ``update_epochs`` /
    ``num_minibatches`` (``None`` = the config's) and ``kl_stop`` (``False`` = no ``target_kl`` early stop) override
    the schedule. ``after_update(beta, kl_after, config) -> beta`` carries the penalty coefficient to the next
    update (``None``: beta is left alone). ``clip_guard_rail``: ``clip_coef`` is a trust region here, so the
    ``clip_coef <= 0.3`` guard rail applies. ``fused``: ``mlp_backward``'s hand-derived backward implements it.
    """

    name: str
    summary: str
    policy_term: PolicyTerm
    clip_value: bool = False
    update_epochs: Optional[int] = None
    num_minibatches: Optional[int] = None
    kl_stop: bool = True
    after_update: Optional[Callable[[float, float, Any], float]] = None
    clip_guard_rail: bool = False
    fused: bool = False

    @property
    def adapts_kl_beta(self) -> bool:
        """True when the run's ``kl_beta`` changes from update to update (its plots and reports show it)."""
        return self.after_update is not None


def _ppo_policy(logp_new, logp_old, ratio, advantages, s, mask=None, mode="mean"):
    from ppokit.core.objectives import policy_loss

    return policy_loss(logp_new, logp_old, advantages, s.clip_coef, mask, mode)


def _ppo_kl_policy(logp_new, logp_old, ratio, advantages, s, mask=None, mode="mean"):
    from ppokit.core.objectives import kl_penalty_loss

    return kl_penalty_loss(logp_new, logp_old, advantages, s.kl_beta, mask, mode)


def _a2c_policy(logp_new, logp_old, ratio, advantages, s, mask=None, mode="mean"):
    from ppokit.core.reductions import reduce

    # One step at ratio == 1, where the gradient of r*A equals that of logp*A (the policy gradient theorem).
    return -reduce(ratio * advantages.detach(), mask, mode)


def _ppo_kl_beta(beta: float, kl_after: float, config: Any) -> float:
    return adapt_kl_beta(beta, kl_after, config.kl_target)


ALGOS: dict[str, Algo] = {}


def register(algo: Algo) -> Algo:
    """Add ``algo`` to ``ALGOS`` under ``algo.name`` (a config with ``algo = <name>`` then validates and trains)."""
    if algo.name in ALGOS:
        raise ValueError(f"algo {algo.name!r} is already registered")
    ALGOS[algo.name] = algo
    return algo


register(Algo("ppo", "clipped surrogate", _ppo_policy, clip_value=True, clip_guard_rail=True, fused=True))
register(Algo("ppo-kl", "adaptive KL penalty", _ppo_kl_policy, after_update=_ppo_kl_beta))
register(Algo("a2c", "one step per rollout", _a2c_policy, update_epochs=1, num_minibatches=1, kl_stop=False))


def describe_algos() -> str:
    """The registered algos with their summaries, for ``--help``: "ppo (clipped surrogate), ... or a2c (...)"."""
    parts = [f"{a.name} ({a.summary})" for a in ALGOS.values()]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"


def get_algo(name: str) -> Algo:
    """The registered ``Algo`` called ``name``; a ``ValueError`` naming the registered ones otherwise."""
    algo = ALGOS.get(name)
    if algo is None:
        raise ValueError(f"unknown algo {name!r}; registered: {', '.join(ALGOS)}")
    return algo


def loss_terms(algo: Algo, logp_new: "Tensor", logp_old: "Tensor", ratio: "Tensor", advantages: "Tensor",
               entropy: "Tensor", values: "Tensor", returns: "Tensor", values_old: "Tensor",
               s: "UpdateSettings", mask: "Tensor | None" = None, mode: str = "mean") -> dict[str, "Tensor"]:
    """The signed scalar loss terms of ``algo`` by name (``TERM_NAMES``), each reduced by ``reduce(., mask, mode)``
    over the per-sample (``[B]``) or per-token (``[B, T]``) inputs; the loss is ``policy + vf*value + ent*entropy``."""
    from ppokit.core.objectives import entropy_loss, value_loss

    clipped = s.clip_vloss and algo.clip_value
    return {
        "policy": algo.policy_term(logp_new, logp_old, ratio, advantages, s, mask, mode),
        "value": value_loss(values, returns, values_old if clipped else None, s.clip_coef if clipped else None,
                            mask, mode),
        "entropy": entropy_loss(entropy, mask, mode),
    }
