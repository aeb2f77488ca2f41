"""Live alerts a language-model run adds to the Gymnasium monitor's (approx KL, clip fraction, entropy, ...).

Checked after every iteration, rate-limited like ``monitor.Monitor`` (a rule that fired stays quiet for
``cooldown`` iterations); their thresholds are ``ppokit doctor``'s for LM runs (``doctor_lm``), so a live alert
and the doctor's verdict on the finished run read the same numbers.

- ``kl_ref_runaway`` (warn): KL(pi || pi_ref) per sequence above ``KL_REF_RUNAWAY`` nats: the policy is far from
  the reference model; with a rising score, the classic sign of reward hacking (Ziegler et al. 2019).
- ``zero_reward_variance`` (warn): for ``reward_patience`` iterations in a row at least ``ZERO_STD_FRAC`` of the
  prompt groups scored all their completions the same: their advantages, hence their loss, are exactly 0
  (trl#3857).
"""

from __future__ import annotations

import math

from ppokit.core import schema as S
from ppokit.core.schema import KL_REF_RUNAWAY, ZERO_STD_FRAC
from ppokit.diagnostics.monitor import Alert

__all__ = ["LMAlerts"]


class LMAlerts:
    """``check(iteration, metrics) -> [Alert]``; ``kl_knob`` names the coefficient to raise (kl_coef or beta)."""

    def __init__(self, kl_knob: str, cooldown: int = 10):
        self.kl_knob = kl_knob
        self.cooldown = cooldown
        self._last: dict[str, int] = {}
        self._zero_std_run = 0

    def state_dict(self) -> dict:
        """The cooldowns and the zero-variance streak, for the run's checkpoint (a resume alerts as if unbroken)."""
        return {"last": dict(self._last), "zero_std_run": self._zero_std_run}

    def load_state_dict(self, state: dict) -> None:
        last, run = {str(k): int(v) for k, v in state["last"].items()}, int(state["zero_std_run"])
        self._last, self._zero_std_run = last, run

    def _fire(self, out: list[Alert], update: int, alert: Alert) -> None:
        last = self._last.get(alert.name)
        if last is None or update - last >= self.cooldown:
            self._last[alert.name] = update
            alert.data.setdefault("update", update)
            out.append(alert)

    def check(self, update: int, m: dict[str, float]) -> list[Alert]:
        out: list[Alert] = []
        kl = m.get(S.KL_REF, math.nan)
        if math.isfinite(kl) and kl > KL_REF_RUNAWAY:
            self._fire(out, update, Alert(
                "warn", "kl_ref_runaway",
                f"KL to pi_ref {kl:.3g} nats per sequence > {KL_REF_RUNAWAY:g}: the policy is leaving the reference "
                f"model; if the score keeps rising, check samples for reward hacking and raise {self.kl_knob}",
                {"kl_ref": kl}))
        frac = m.get(S.FRAC_REWARD_ZERO_STD, math.nan)
        self._zero_std_run = self._zero_std_run + 1 if math.isfinite(frac) and frac >= ZERO_STD_FRAC else 0
        if self._zero_std_run >= int(S.THRESHOLDS["reward_patience"]):
            self._fire(out, update, Alert(
                "warn", "zero_reward_variance",
                f"{frac:.0%} of the prompt groups scored all their completions the same for {self._zero_std_run} "
                "iterations: their advantages and loss are 0 (expected, not a bug); raise group_size or temperature "
                "or give partial credit, unless the score has already reached its top",
                {"frac_reward_zero_std": frac}))
        return out
