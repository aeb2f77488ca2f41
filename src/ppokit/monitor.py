"""Live alerts on PPO's health, checked after every update against the lessons' thresholds.

Each rule looks at the update's metrics (and a short history) and returns alerts with the action to take.
Alerts are rate-limited per rule so a persistent condition reports once per ``cooldown`` updates, not every
update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Monitor", "Alert", "THRESHOLDS"]

THRESHOLDS = {
    "kl_warn": 0.02,  # mean approx KL above this: the update is moving pi_theta far from pi_old
    "kl_alert": 0.1,  # above this: the trust region is blown
    "clipfrac_low": 0.01,  # clip never fires
    "clipfrac_high": 0.4,  # sustained: over-fitting the rollout (drift)
    "clipfrac_patience": 5,  # updates a clip-fraction condition must persist
    "ev_patience": 20,  # updates after which explained variance must have risen above ev_min
    "ev_min": 0.0,
    "entropy_collapse_frac": 0.05,  # entropy below this fraction of its first value
}


@dataclass
class Alert:
    """One alert: severity, rule name, message with the recommended action, and the evidence."""

    level: str  # "warn" | "alert"
    name: str
    message: str
    data: dict = field(default_factory=dict)


class Monitor:
    """Stateful checker of the per-update metrics; ``check`` returns the alerts due this update."""

    def __init__(self, cooldown: int = 10, thresholds: dict | None = None):
        self.cooldown = cooldown
        self.t = dict(THRESHOLDS, **(thresholds or {}))
        self.history: list[dict[str, float]] = []
        self._last_fired: dict[str, int] = {}
        self._first_entropy: float | None = None

    def _fire(self, out: list[Alert], update: int, alert: Alert) -> None:
        last = self._last_fired.get(alert.name)
        if last is not None and update - last < self.cooldown:
            return
        self._last_fired[alert.name] = update
        alert.data.setdefault("update", update)
        out.append(alert)

    def check(self, update: int, m: dict[str, float]) -> list[Alert]:
        """Alerts for update number ``update`` with metrics ``m`` (keys as logged by the trainer)."""
        self.history.append(m)
        out: list[Alert] = []
        t = self.t
        kl = m.get("diag/approx_kl", math.nan)
        clipfrac = m.get("diag/clipfrac", math.nan)
        ent = m.get("diag/entropy", math.nan)

        if m.get("diag/skipped_minibatches", 0) > 0:
            self._fire(out, update, Alert("alert", "nonfinite_loss",
                                          f"{int(m['diag/skipped_minibatches'])} minibatch(es) had a non-finite loss "
                                          "or gradient and were skipped: check rewards/observations for NaN/Inf, "
                                          "lower learning_rate", {"skipped": m["diag/skipped_minibatches"]}))
        if m.get("diag/nonfinite_env", 0) > 0:
            self._fire(out, update, Alert("alert", "nonfinite_env",
                                          f"{int(m['diag/nonfinite_env'])} environment step(s) returned NaN/Inf "
                                          "observations or rewards; they were dropped from training",
                                          {"steps": m["diag/nonfinite_env"]}))
        if not math.isnan(m.get("diag/advantages_nonfinite", math.nan)) and m["diag/advantages_nonfinite"] > 0:
            self._fire(out, update, Alert("alert", "nonfinite_advantages",
                                          "advantages contain NaN/Inf: check the value head and reward scale", {}))
        if m.get("diag/reward_std", 1.0) == 0.0:
            self._fire(out, update, Alert("warn", "zero_reward_variance",
                                          "every reward in this rollout was identical: there is no learning signal "
                                          "(check the reward function or explore more)",
                                          {"reward_std": 0.0}))
        if kl > t["kl_alert"]:
            self._fire(out, update, Alert("alert", "kl_blowup",
                                          f"approx KL {kl:.3f} > {t['kl_alert']}: the policy left the trust region; "
                                          "lower update_epochs or learning_rate, or set target_kl", {"approx_kl": kl}))
        elif kl > t["kl_warn"]:
            self._fire(out, update, Alert("warn", "kl_high",
                                          f"approx KL {kl:.3f} > {t['kl_warn']}: updates are large; consider a "
                                          "lower learning_rate or target_kl", {"approx_kl": kl}))
        p = int(t["clipfrac_patience"])
        recent = [h.get("diag/clipfrac", math.nan) for h in self.history[-p:]]
        if len(recent) == p and all(c < t["clipfrac_low"] for c in recent):
            self._fire(out, update, Alert("warn", "clip_never_fires",
                                          f"clip fraction < {t['clipfrac_low']} for {p} updates: the clip never "
                                          "fires; raise learning_rate or update_epochs", {"clipfrac": clipfrac}))
        if len(recent) == p and all(c > t["clipfrac_high"] for c in recent):
            self._fire(out, update, Alert("alert", "clipfrac_high",
                                          f"clip fraction > {t['clipfrac_high']} for {p} updates: over-fitting the "
                                          "rollout (drift); lower learning_rate or update_epochs",
                                          {"clipfrac": clipfrac}))
        evp = int(t["ev_patience"])
        if len(self.history) >= evp:
            evs = [h.get("diag/explained_variance", math.nan) for h in self.history[-evp:]]
            finite = [e for e in evs if not math.isnan(e)]
            if finite and max(finite) <= t["ev_min"]:
                self._fire(out, update, Alert("warn", "critic_not_learning",
                                              f"explained variance <= {t['ev_min']} for {evp} updates: the critic "
                                              "is not learning; check vf_coef, reward scale (normalize_reward)",
                                              {"explained_variance": finite[-1]}))
        if not math.isnan(ent):
            if self._first_entropy is None and ent > 0:
                self._first_entropy = ent
            elif self._first_entropy and ent < t["entropy_collapse_frac"] * self._first_entropy:
                self._fire(out, update, Alert("warn", "entropy_collapse",
                                              f"entropy {ent:.4f} fell below {t['entropy_collapse_frac']:.0%} of its "
                                              f"start ({self._first_entropy:.4f}): the policy became deterministic; "
                                              "raise ent_coef if return is not at its optimum", {"entropy": ent}))
        return out
