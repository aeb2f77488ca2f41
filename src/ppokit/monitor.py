"""Live alerts on PPO's health, checked after every update against the lessons' thresholds.

Each rule looks at the update's metrics (and a short history) and returns alerts with the action to take.
Alerts are rate-limited per rule: once a rule fires it stays quiet for ``cooldown`` updates, so a persistent
condition reports once per ``cooldown`` updates instead of on every update.

Rules (thresholds in ``THRESHOLDS``):

- ``nonfinite_loss`` / ``nonfinite_env`` / ``nonfinite_advantages``: NaN/Inf anywhere in the update (alert).
- ``rewards_all_zero``: every reward zero and every finished episode returned 0 for ``reward_patience`` updates.
- ``zero_reward_variance``: rewards constant within each rollout AND the episode returns (and lengths) constant
  across ``reward_patience`` updates and unchanged since the start. A constant per-step reward alone is fine
  (CartPole's +1): episode lengths, hence returns, still carry the signal.
- ``kl_high`` (warn, KL > 0.02) / ``kl_blowup`` (alert, KL > 0.1).
- ``clip_never_fires``: the policy does not move: for ``clipfrac_patience`` updates the clip fraction is below
  ``CLIPFRAC_NEVER_FIRES`` (1e-3) AND approx KL is below ``KL_NEGLIGIBLE`` (1e-6), except in the tail of an
  annealed learning-rate schedule (LR below 10% of its start) and once the entropy has collapsed (a converged,
  near-deterministic policy: the GridWorld preset at its optimum), where a vanishing step is expected. A clip
  fraction of exactly 0 alone is common in healthy runs (CartPole with the library defaults: clip fraction 0 on
  every update while the return climbs, KL 1e-5 to 4e-4), so the clip fraction alone cannot tell "small steps"
  from "no steps"; a KL under 1e-6 (log-ratios of ~0.1%) can. With a learning rate of 0 it is an alert.
- ``clipfrac_high``: clip fraction > 0.4 for ``clipfrac_patience`` consecutive updates (drift).
- ``critic_not_learning``: explained variance never above ``ev_min`` in the first ``ev_patience`` updates (or
  any later window of that length, if it has never risen yet).
- ``entropy_collapse``: discrete policies: entropy below ``entropy_collapse_frac`` of its first value (a
  categorical entropy is >= 0, so this means near-deterministic). Continuous (Gaussian) policies, whose entropy
  has no floor and can be negative: entropy more than ``entropy_collapse_nats_per_dim`` nats per action
  dimension below its first value, i.e. the std shrank by a factor e^2.5 ~ 12 in every dimension. Without
  ``action_kind`` the kind is guessed: continuous once a negative entropy is seen, discrete otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Monitor", "Alert", "THRESHOLDS", "CLIPFRAC_NEVER_FIRES", "KL_NEGLIGIBLE"]

# clip_never_fires, calibrated on short runs (KL after each update; the lowest maximum over 5 consecutive updates
# outside the annealed tail): presets cartpole 2.6e-4, acrobot 2.5e-3, pendulum 1.4e-2; the library defaults on
# CartPole 1.1e-5 (clip fraction 0 on every update while the return climbs) and Pendulum 7.5e-6; lr = 0 exactly 0,
# lr = 1e-7 8e-12. Below the line: the defaults on Acrobot stuck at -500 (2.3e-7), and the gridworld preset at its
# optimum (7e-8, exempt: its entropy has collapsed). Both conditions must hold for clipfrac_patience updates.
CLIPFRAC_NEVER_FIRES = 1e-3  # clip fraction below this: the clip never fires
KL_NEGLIGIBLE = 1e-6  # approx KL below this: pi_theta is pi_old to ~0.1% per action, the policy does not move

THRESHOLDS = {
    "kl_warn": 0.02,  # mean approx KL above this: the update is moving pi_theta far from pi_old
    "kl_alert": 0.1,  # above this: the trust region is blown
    "clipfrac_low": CLIPFRAC_NEVER_FIRES,  # clip never fires (with kl_negligible)
    "kl_negligible": KL_NEGLIGIBLE,  # ... and the policy does not move
    "clipfrac_high": 0.4,  # sustained: over-fitting the rollout (drift)
    "clipfrac_patience": 5,  # updates a clip-fraction condition must persist
    "lr_tail_frac": 0.1,  # an annealed LR below this fraction of its start: a ~0 clip fraction is expected
    "ev_patience": 20,  # updates after which explained variance must have risen above ev_min
    "ev_min": 0.0,
    "entropy_collapse_frac": 0.05,  # discrete: entropy below this fraction of its first value
    "entropy_collapse_nats_per_dim": 2.5,  # continuous: drop from the first value, per action dimension
    "reward_patience": 5,  # updates a zero-reward condition must persist
}


@dataclass
class Alert:
    """One alert: severity, rule name, message with the recommended action, and the evidence."""

    level: str  # "warn" | "alert"
    name: str
    message: str
    data: dict = field(default_factory=dict)


def _num(m: dict, key: str) -> float:
    """A metric as float; missing or unparsable -> NaN."""
    try:
        return float(m.get(key, math.nan))
    except (TypeError, ValueError):
        return math.nan


def _finite(x: float) -> bool:
    return not math.isnan(x) and not math.isinf(x)


class Monitor:
    """Stateful checker of the per-update metrics; ``check`` returns the alerts due this update."""

    def __init__(self, cooldown: int = 10, thresholds: dict | None = None, action_kind: str | None = None,
                 action_dim: int = 1):
        self.cooldown = cooldown
        unknown = set(thresholds or {}) - set(THRESHOLDS)
        if unknown:
            raise ValueError(f"unknown monitor threshold(s): {', '.join(sorted(unknown))}")
        self.t = dict(THRESHOLDS, **(thresholds or {}))
        self.action_kind = action_kind
        self.action_dim = max(1, int(action_dim))
        self.history: list[dict[str, float]] = []
        self._last_fired: dict[str, int] = {}
        self._first_entropy: float | None = None
        self._first_return: float | None = None
        self._first_lr: float | None = None
        self._ev_ever_rose = False
        self._saw_negative_entropy = False

    def _fire(self, out: list[Alert], update: int, alert: Alert) -> None:
        last = self._last_fired.get(alert.name)
        if last is not None and update - last < self.cooldown:
            return
        self._last_fired[alert.name] = update
        alert.data.setdefault("update", update)
        out.append(alert)

    def _recent(self, key: str, n: int) -> list[float] | None:
        """The last ``n`` values of ``key``, or None if fewer than ``n`` updates were seen."""
        if len(self.history) < n:
            return None
        return [_num(h, key) for h in self.history[-n:]]

    def check(self, update: int, m: dict[str, float]) -> list[Alert]:
        """Alerts for update number ``update`` with metrics ``m`` (keys as logged by the trainer)."""
        self.history.append(m)
        out: list[Alert] = []
        for rule in (self._nonfinite, self._reward_signal, self._kl, self._clipfrac, self._critic, self._entropy):
            rule(out, update, m)
        return out

    # ---------------------------------------------------------------- rules
    def _nonfinite(self, out: list[Alert], update: int, m: dict) -> None:
        skipped = _num(m, "diag/skipped_minibatches")
        bad_losses = {k: _num(m, k) for k in ("losses/policy_loss", "losses/value_loss", "diag/approx_kl")
                      if k in m and not _finite(_num(m, k))}
        # A fully skipped update leaves its loss stats NaN; report that once, as skipped minibatches.
        if (_finite(skipped) and skipped > 0) or bad_losses:
            self._fire(out, update, Alert(
                "alert", "nonfinite_loss",
                (f"{int(skipped)} minibatch(es) had a non-finite loss or gradient and were skipped; "
                 if _finite(skipped) and skipped > 0 else "")
                + (f"non-finite {', '.join(bad_losses)}; " if bad_losses else "")
                + "check rewards/observations for NaN/Inf, lower learning_rate",
                {"skipped": skipped if _finite(skipped) else None, **{k: str(v) for k, v in bad_losses.items()}}))
        env_bad = _num(m, "diag/nonfinite_env")
        if _finite(env_bad) and env_bad > 0:
            self._fire(out, update, Alert("alert", "nonfinite_env",
                                          f"{int(env_bad)} environment step(s) returned NaN/Inf observations or "
                                          "rewards; they were dropped from training", {"steps": env_bad}))
        adv_bad = _num(m, "diag/advantages_nonfinite")
        if _finite(adv_bad) and adv_bad > 0:
            self._fire(out, update, Alert("alert", "nonfinite_advantages",
                                          f"{int(adv_bad)} advantage(s) are NaN/Inf: check the value head and the "
                                          "reward scale (normalize_reward)", {"count": adv_bad}))

    def _reward_signal(self, out: list[Alert], update: int, m: dict) -> None:
        ret = _num(m, "charts/episodic_return")
        if self._first_return is None and _finite(ret):
            self._first_return = ret
        p = int(self.t["reward_patience"])
        stds = self._recent("diag/reward_std", p)
        if stds is None or not all(s == 0.0 for s in stds):
            return
        rets = [r for r in self._recent("charts/episodic_return", p) if _finite(r)]
        lens = [x for x in self._recent("charts/episodic_length", p) if _finite(x)]
        if rets and all(r == 0.0 for r in rets):
            self._fire(out, update, Alert(
                "alert", "rewards_all_zero",
                f"every reward was 0 for {p} updates (episodes finished with return 0): there is no learning "
                "signal; check the reward function, or shape the reward / explore more on a sparse task",
                {"reward_std": 0.0, "episodic_return": 0.0}))
            return
        # Constant reward: fine while episode lengths (hence returns) vary, or once the return has moved.
        if (len(rets) >= 2 and max(rets) == min(rets) and (not lens or max(lens) == min(lens))
                and self._first_return is not None and rets[-1] == self._first_return):
            self._fire(out, update, Alert(
                "warn", "zero_reward_variance",
                f"rewards and episode returns ({rets[-1]:g}) were identical for {p} updates and have not changed "
                "since the start: no learning signal; check the reward function",
                {"reward_std": 0.0, "episodic_return": rets[-1]}))

    def _kl(self, out: list[Alert], update: int, m: dict) -> None:
        kl = _num(m, "diag/approx_kl")
        t = self.t
        if kl > t["kl_alert"]:
            self._fire(out, update, Alert("alert", "kl_blowup",
                                          f"approx KL {kl:.3g} > {t['kl_alert']}: the policy left the trust region; "
                                          "lower update_epochs or learning_rate, or set target_kl", {"approx_kl": kl}))
        elif kl > t["kl_warn"]:
            self._fire(out, update, Alert("warn", "kl_high",
                                          f"approx KL {kl:.3g} > {t['kl_warn']}: updates are large; consider a "
                                          "lower learning_rate or target_kl", {"approx_kl": kl}))

    def _clipfrac(self, out: list[Alert], update: int, m: dict) -> None:
        t = self.t
        p = int(t["clipfrac_patience"])
        recent = self._recent("diag/clipfrac", p)
        lr = _num(m, "charts/learning_rate")
        if self._first_lr is None and _finite(lr):
            self._first_lr = lr
        if recent is None:
            return
        clipfrac = recent[-1]
        if all(c < t["clipfrac_low"] for c in recent):
            kls = self._recent_kl(p)
            if _finite(lr) and lr == 0.0:
                self._fire(out, update, Alert("alert", "clip_never_fires",
                                              f"clip fraction < {t['clipfrac_low']} for {p} updates and the learning "
                                              "rate is 0: the policy cannot change; set learning_rate > 0",
                                              {"clipfrac": clipfrac, "approx_kl": kls[-1], "learning_rate": lr}))
            elif (all(_finite(k) and k < t["kl_negligible"] for k in kls)
                  and not (self._first_lr and _finite(lr) and lr < t["lr_tail_frac"] * self._first_lr)
                  # A near-deterministic policy barely moves by nature (saturated probabilities, and on a solved
                  # task constant advantages normalize to 0); entropy_collapse reports that state.
                  and not self._collapse_rule(_num(m, "diag/entropy"))):
                self._fire(out, update, Alert("warn", "clip_never_fires",
                                              f"clip fraction < {t['clipfrac_low']} and approx KL < "
                                              f"{t['kl_negligible']:g} for {p} updates: the policy does not move; "
                                              "if the return is flat, check rewards/advantages and grad norm, "
                                              "then raise learning_rate or update_epochs",
                                              {"clipfrac": clipfrac, "approx_kl": kls[-1], "learning_rate": lr}))
        if all(c > t["clipfrac_high"] for c in recent):
            self._fire(out, update, Alert("alert", "clipfrac_high",
                                          f"clip fraction > {t['clipfrac_high']} for {p} updates: over-fitting the "
                                          "rollout (drift); lower learning_rate or update_epochs",
                                          {"clipfrac": clipfrac}))

    def _recent_kl(self, n: int) -> list[float]:
        """The last ``n`` updates' KL of pi_theta after the update against pi_old when logged (A2C's in-update KL is
        taken before its only step, hence always 0), else the in-update approx KL."""
        return [_num(h, "diag/approx_kl_after") if _finite(_num(h, "diag/approx_kl_after"))
                else _num(h, "diag/approx_kl") for h in self.history[-n:]]

    def _critic(self, out: list[Alert], update: int, m: dict) -> None:
        t = self.t
        ev = _num(m, "diag/explained_variance")
        if _finite(ev) and ev > t["ev_min"]:
            self._ev_ever_rose = True
        n = int(t["ev_patience"])
        if self._ev_ever_rose or len(self.history) < n:
            return
        evs = [e for e in self._recent("diag/explained_variance", n) if _finite(e)]
        if evs:
            self._fire(out, update, Alert("warn", "critic_not_learning",
                                          f"explained variance has never exceeded {t['ev_min']} in {len(self.history)} "
                                          f"updates (latest {evs[-1]:.3g}): the critic is not learning; check "
                                          "learning_rate, vf_coef and the reward scale (normalize_reward)",
                                          {"explained_variance": evs[-1]}))

    def _entropy(self, out: list[Alert], update: int, m: dict) -> None:
        ent = _num(m, "diag/entropy")
        if not _finite(ent):
            return
        if ent < 0:
            self._saw_negative_entropy = True
        if self._first_entropy is None:
            self._first_entropy = ent
            return
        rule = self._collapse_rule(ent)
        if rule:
            h0 = self._first_entropy
            self._fire(out, update, Alert("warn", "entropy_collapse",
                                          f"entropy {ent:.4g} fell {rule} ({h0:.4g}): the policy became "
                                          "near-deterministic; if the return is not at its optimum, raise ent_coef "
                                          "or lower learning_rate", {"entropy": ent, "entropy_start": h0}))

    def _collapse_rule(self, ent: float) -> str | None:
        """The collapse rule ``ent`` breaks (for the message), or None while the entropy has not collapsed."""
        if self._first_entropy is None or not _finite(ent):
            return None
        kind = self.action_kind or ("continuous" if self._saw_negative_entropy else "discrete")
        h0, t = self._first_entropy, self.t
        if kind == "continuous":
            drop = t["entropy_collapse_nats_per_dim"] * self.action_dim
            return f"more than {drop:g} nats below its start" if h0 - ent > drop else None
        frac = t["entropy_collapse_frac"]
        return f"below {frac:.0%} of its start" if h0 > 0 and ent < frac * h0 else None
