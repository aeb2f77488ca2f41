"""Live alerts on PPO's health, checked after every update against the schema's thresholds.

Each rule looks at the update's metrics (and a short history) and returns alerts with the action to take.
Alerts are rate-limited per rule: once a rule fires it stays quiet for ``cooldown`` updates, so a persistent
condition reports once per ``cooldown`` updates instead of on every update.

Rules (thresholds in ``schema.THRESHOLDS``). The verdict of each problem the doctor also reports is one function
below (``reward_signal``, ``kl_level``, ``entropy_collapse``, ``critic_never_learned``, ``nonfinite_counts``,
``longest_run``, ``clip_idle``): the monitor applies it to the updates seen so far, ``ppokit doctor`` to the whole
run.

- ``nonfinite_loss`` / ``nonfinite_env`` / ``nonfinite_advantages``: NaN/Inf anywhere in the update (alert).
- ``rewards_all_zero``: every reward zero and every finished episode returned 0, on every update so far (at least
  ``reward_patience``).
- ``zero_reward_variance``: rewards constant within every rollout so far AND every finished episode with the same
  return and length, that length not the env's time limit. A constant per-step reward alone is fine (CartPole's
  +1, Acrobot's -1): episode lengths, hence returns, carry the signal; episodes that all ran to the time limit
  have not reached a terminal state yet, which is exploration, not the reward function.
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

- ``policy_lag_growing`` (decoupled actors, ``--actors``): the mean ``diag/policy_lag`` of the second half of the
  last ``lag_window`` updates exceeds the first half's by more than ``lag_growth`` versions: the learner falls
  behind its actors (warn).

``monitor_kl=False`` / ``monitor_clipfrac=False`` switch the KL rules / the two clip-fraction rules off.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Sequence

from ppokit.core import schema as S
from ppokit.core.schema import CLIPFRAC_NEVER_FIRES, KL_NEGLIGIBLE, THRESHOLDS

__all__ = ["Monitor", "Alert", "RunSummary", "THRESHOLDS", "CLIPFRAC_NEVER_FIRES", "KL_NEGLIGIBLE", "kl_level",
           "reward_signal", "entropy_collapse", "critic_never_learned", "nonfinite_counts", "longest_run", "clip_idle",
           "episode_time_limit"]

# clip_never_fires, calibrated on short runs (KL after each update; the lowest maximum over 5 consecutive updates
# outside the annealed tail): presets cartpole 2.6e-4, acrobot 2.5e-3, pendulum 1.4e-2; the library defaults on
# CartPole 1.1e-5 (clip fraction 0 on every update while the return climbs) and Pendulum 7.5e-6; lr = 0 exactly 0,
# lr = 1e-7 8e-12. Below the line: the defaults on Acrobot stuck at -500 (2.3e-7), and the gridworld preset at its
# optimum (7e-8, exempt: its entropy has collapsed). Both conditions must hold for clipfrac_patience updates.
# (CLIPFRAC_NEVER_FIRES and KL_NEGLIGIBLE live in schema.py with the other thresholds.)


# ---------------------------------------------------------------- verdicts shared with ``ppokit doctor``
# Each takes plain numbers or a RunSummary (the monitor's of the updates seen so far, the doctor's of the whole run)
# and returns the verdict, so the live alert and the doctor's finding for one problem are one decision with one set
# of thresholds.
def kl_level(kl: float, t: dict = THRESHOLDS) -> str | None:
    """``"alert"`` above ``kl_alert`` (trust region blown), ``"warn"`` above ``kl_warn``, else None."""
    if kl > t["kl_alert"]:
        return "alert"
    return "warn" if kl > t["kl_warn"] else None


@dataclass
class RunSummary:
    """What the whole-run verdicts need of the updates so far, kept in O(1) per update: the monitor adds each
    update as it comes, the doctor every row of ``metrics.csv``, and both ask the same verdict functions."""

    updates: int = 0
    reward_stds: int = 0  # updates with a finite reward std
    reward_varied: bool = False  # some rollout's rewards were not all equal
    finished: int = 0  # updates in which an episode finished (a finite mean return)
    ret_min: float = math.inf
    ret_max: float = -math.inf
    last_return: float = math.nan
    lengths: int = 0
    len_min: float = math.inf
    len_max: float = -math.inf
    ev_max: float = math.nan  # the best explained variance so far (NaN: none measured)
    ev_last: float = math.nan

    def add(self, m: dict) -> RunSummary:
        """Count one update's metrics ``m``; returns self."""
        self.updates += 1
        std, ret, length, ev = (_num(m, k) for k in (S.REWARD_STD, S.EPISODIC_RETURN, S.EPISODIC_LENGTH,
                                                      S.EXPLAINED_VARIANCE))
        if _finite(std):
            self.reward_stds += 1
            self.reward_varied |= std != 0.0
        if _finite(ret):
            self.finished += 1
            self.ret_min, self.ret_max, self.last_return = min(self.ret_min, ret), max(self.ret_max, ret), ret
        if _finite(length):
            self.lengths += 1
            self.len_min, self.len_max = min(self.len_min, length), max(self.len_max, length)
        if _finite(ev):
            self.ev_max = ev if not _finite(self.ev_max) else max(self.ev_max, ev)
            self.ev_last = ev
        return self


def reward_signal(s: RunSummary, time_limit: int | None = None, t: dict = THRESHOLDS) -> tuple[str, str] | None:
    """``(cause, evidence)`` when the rewards carry no learning signal (yet), else None (also while undecided).

    Judges every update of ``s`` (reward std of each rollout, mean return and length of the episodes finished in
    it). A constant per-step reward (std 0 on every update) is a valid signal while the returns vary, i.e. while
    episode lengths do (CartPole's +1, Acrobot's -1); it is a problem when
    - every finished episode returned 0: ``rewards_all_zero``;
    - every finished episode returned the same and lasted the same, in at least two updates: ``zero_reward_variance``
      (the reward cannot rank actions) -- unless every episode ran to the env's time limit: then the length is
      the time limit's, not the policy's, and a terminal state (which would change the return) has just not
      been reached yet (Acrobot before its first swing-up): an exploration problem, not the reward function,
      returned as ``returns_at_time_limit`` (no alert; a note in the doctor).
    Needs ``reward_patience`` updates, all with reward std 0. Without a finished episode nothing is decided: a
    reward std of 0 says nothing about the reward's value.
    """
    if s.reward_stds < int(t["reward_patience"]) or s.reward_varied or not s.finished:
        return None
    if s.ret_min == s.ret_max == 0.0:
        return "rewards_all_zero", (f"reward std = 0 on all {s.reward_stds} updates and every finished episode "
                                    "returned 0")
    if s.finished >= 2 and s.ret_min == s.ret_max and (not s.lengths or s.len_min == s.len_max):
        if time_limit and s.lengths and s.len_min >= time_limit:
            return "returns_at_time_limit", (f"reward std = 0 on all {s.reward_stds} updates and every episode ran "
                                             f"to the time limit ({time_limit} steps) with return {s.ret_min:.4g}")
        return "zero_reward_variance", (f"reward std = 0 on all {s.reward_stds} updates and every episode returned "
                                        f"{s.ret_min:.4g}" + (f" in {s.len_min:g} steps" if s.lengths else ""))
    return None


def entropy_collapse(h0: float, h: float, kind: str, action_dim: int = 1, t: dict = THRESHOLDS) -> str | None:
    """The collapse rule entropy ``h`` breaks against its start ``h0`` (for the message), or None.

    Discrete: below ``entropy_collapse_frac`` of the start (a categorical entropy is >= 0, so this is
    near-deterministic). Continuous (no floor, can be negative): more than ``entropy_collapse_nats_per_dim`` nats
    per action dimension below the start, i.e. the std shrank by e^2.5 ~ 12 in every dimension.
    """
    if not (_finite(h0) and _finite(h)):
        return None
    if kind == "continuous":
        drop = t["entropy_collapse_nats_per_dim"] * max(1, int(action_dim))
        return f"more than {drop:g} nats below its start {h0:.4g}" if h0 - h > drop else None
    frac = t["entropy_collapse_frac"]
    return f"below {frac:.0%} of its start {h0:.4g}" if h0 > 0 and h < frac * h0 else None


def critic_never_learned(s: RunSummary, t: dict = THRESHOLDS) -> bool:
    """Explained variance never above ``ev_min`` over at least ``ev_patience`` updates (some of them measured)."""
    return s.updates >= int(t["ev_patience"]) and _finite(s.ev_max) and s.ev_max <= t["ev_min"]


def nonfinite_counts(m: dict) -> dict[str, Any]:
    """One update's non-finite evidence: skipped minibatches, non-finite losses, env steps, advantages (0 / {})."""
    skipped = _num(m, S.SKIPPED_MINIBATCHES)
    env_bad, adv_bad = _num(m, S.NONFINITE_ENV), _num(m, S.ADVANTAGES_NONFINITE)
    return {"skipped": skipped if _finite(skipped) and skipped > 0 else 0.0,
            "losses": {k: _num(m, k) for k in (S.POLICY_LOSS, S.VALUE_LOSS, S.APPROX_KL)
                       if k in m and not _finite(_num(m, k))},
            "env": env_bad if _finite(env_bad) and env_bad > 0 else 0.0,
            "advantages": adv_bad if _finite(adv_bad) and adv_bad > 0 else 0.0}


def clip_idle(clipfrac: float, lr: float, lr_start: float | None, t: dict = THRESHOLDS) -> bool:
    """The clip never fired on this update (clip fraction below ``clipfrac_low``) outside the tail of an annealed
    learning rate (below ``lr_tail_frac`` of ``lr_start``), where tiny steps are expected."""
    in_tail = bool(lr_start) and _finite(lr) and lr < t["lr_tail_frac"] * lr_start
    return _finite(clipfrac) and clipfrac < t["clipfrac_low"] and not in_tail


def longest_run(values: Sequence[float], pred) -> tuple[int, int]:
    """``(length, end index)`` of the longest run of consecutive values where ``pred`` holds (``(0, -1)``: none)."""
    run_len, best, best_end = 0, 0, -1
    for i, v in enumerate(values):
        run_len = run_len + 1 if pred(v) else 0
        if run_len > best:
            best, best_end = run_len, i
    return best, best_end


def episode_time_limit(env_id: str | None, env_kwargs: dict | None = None) -> int | None:
    """The env's time limit (``max_episode_steps``) from Gymnasium's registry, or None when unknown.

    Read from the registry only, never by importing a ``module:Env`` id's module, so the doctor can ask it about
    any run directory without running user code.
    """
    if not env_id:
        return None
    if env_kwargs and env_kwargs.get("max_episode_steps") is not None:
        try:
            return int(env_kwargs["max_episode_steps"])
        except (TypeError, ValueError):
            return None
    try:
        import gymnasium as gym

        from ppokit import envs  # noqa: F401 - registers ppokit's own envs
    except Exception:  # noqa: BLE001 - no registry: the time limit is simply unknown
        return None
    spec = gym.registry.get(env_id.split(":", 1)[-1])
    steps = getattr(spec, "max_episode_steps", None)
    return int(steps) if steps else None


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
    """Stateful checker of the per-update metrics; ``check`` returns the alerts due this update.

    ``time_limit``: the env's ``max_episode_steps`` (see ``reward_signal``). ``monitor_kl`` / ``monitor_clipfrac``
    False (``PPOConfig``'s fields of those names, allowed only with ``--unsafe``) turn the KL alerts
    (``kl_high``, ``kl_blowup``) and the clip-fraction alerts (``clip_never_fires``, ``clipfrac_high``) off.
    """

    def __init__(self, cooldown: int = 10, thresholds: dict | None = None, action_kind: str | None = None,
                 action_dim: int = 1, time_limit: int | None = None, monitor_kl: bool = True,
                 monitor_clipfrac: bool = True):
        self.cooldown = cooldown
        unknown = set(thresholds or {}) - set(THRESHOLDS)
        if unknown:
            raise ValueError(f"unknown monitor threshold(s): {', '.join(sorted(unknown))}")
        self.t = dict(THRESHOLDS, **(thresholds or {}))
        self.action_kind = action_kind
        self.action_dim = max(1, int(action_dim))
        self.time_limit = time_limit
        self.monitor_kl = monitor_kl
        self.monitor_clipfrac = monitor_clipfrac
        self.history: list[dict[str, float]] = []
        self.summary = RunSummary()  # the whole-run view the doctor's verdicts take too
        self._last_fired: dict[str, int] = {}
        self._first_entropy: float | None = None
        self._first_lr: float | None = None
        self._saw_negative_entropy = False

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What the rules carry from one update to the next, in checkpoint-safe types (a run's checkpoint holds
        it), so that a resumed run raises the alerts an uninterrupted one would: the cooldowns, the last updates
        the patience windows look at, the whole-run summary, the first entropy and learning rate."""
        window = max(1, int(self.t["clipfrac_patience"]))  # the longest look back of any rule (``_recent``)
        return {"history": [dict(row) for row in self.history[-window:]], "summary": asdict(self.summary),
                "last_fired": dict(self._last_fired), "first_entropy": self._first_entropy,
                "first_lr": self._first_lr, "saw_negative_entropy": self._saw_negative_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a malformed one raises TypeError/ValueError/KeyError and changes nothing."""
        history = [{str(k): float(v) for k, v in row.items()} for row in state["history"]]
        saved = state["summary"]
        summary = RunSummary(**{f.name: type(getattr(RunSummary, f.name))(saved[f.name]) for f in fields(RunSummary)})
        last_fired = {str(k): int(v) for k, v in state["last_fired"].items()}
        first_entropy, first_lr = (None if state[k] is None else float(state[k]) for k in ("first_entropy", "first_lr"))
        self.history, self.summary, self._last_fired = history, summary, last_fired
        self._first_entropy, self._first_lr = first_entropy, first_lr
        self._saw_negative_entropy = bool(state["saw_negative_entropy"])

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
        self.summary.add(m)
        out: list[Alert] = []
        rules = [self._nonfinite, self._reward_signal]
        rules += [self._kl] if self.monitor_kl else []
        rules += [self._clipfrac] if self.monitor_clipfrac else []
        for rule in rules + [self._critic, self._entropy, self._policy_lag]:
            rule(out, update, m)
        return out

    # ---------------------------------------------------------------- rules
    def _nonfinite(self, out: list[Alert], update: int, m: dict) -> None:
        bad = nonfinite_counts(m)
        skipped, bad_losses = bad["skipped"], bad["losses"]
        # A fully skipped update leaves its loss stats NaN; report that once, as skipped minibatches.
        if skipped or bad_losses:
            self._fire(out, update, Alert(
                "alert", "nonfinite_loss",
                (f"{int(skipped)} minibatch(es) had a non-finite loss or gradient and were skipped; "
                 if skipped else "")
                + (f"non-finite {', '.join(bad_losses)}; " if bad_losses else "")
                + "check rewards/observations for NaN/Inf, lower learning_rate",
                {"skipped": skipped or None, **{k: str(v) for k, v in bad_losses.items()}}))
        if bad["env"]:
            self._fire(out, update, Alert("alert", "nonfinite_env",
                                          f"{int(bad['env'])} environment step(s) returned NaN/Inf observations or "
                                          "rewards; they were dropped from training", {"steps": bad["env"]}))
        if bad["advantages"]:
            self._fire(out, update, Alert("alert", "nonfinite_advantages",
                                          f"{int(bad['advantages'])} advantage(s) are NaN/Inf: check the value head "
                                          "and the reward scale (normalize_reward)", {"count": bad["advantages"]}))

    def _reward_signal(self, out: list[Alert], update: int, m: dict) -> None:
        # Judged on every update so far, as the doctor judges the whole run: once the returns have varied, the
        # constant per-step reward has shown it carries a signal, and no later window can say otherwise.
        verdict = reward_signal(self.summary, self.time_limit, self.t)
        if verdict is None:
            return
        cause, evidence = verdict
        n = self.summary.updates
        if cause == "returns_at_time_limit":
            return  # not the reward function's fault: the policy has not reached a terminal state yet
        if cause == "rewards_all_zero":
            self._fire(out, update, Alert(
                "alert", "rewards_all_zero",
                f"every reward was 0 for {n} updates (episodes finished with return 0): there is no learning "
                "signal; check the reward function, or shape the reward / explore more on a sparse task",
                {"reward_std": 0.0, "episodic_return": 0.0}))
            return
        ret = self.summary.last_return
        self._fire(out, update, Alert(
            "warn", "zero_reward_variance",
            f"rewards and episode returns ({ret:g}) were identical for {n} updates, every episode the same length "
            "(not the time limit): no learning signal; check the reward function", {"reward_std": 0.0,
                                                                                     "episodic_return": ret}))

    def _kl(self, out: list[Alert], update: int, m: dict) -> None:
        kl = _num(m, S.APPROX_KL)
        t = self.t
        level = kl_level(kl, t)
        if level == "alert":
            self._fire(out, update, Alert("alert", "kl_blowup",
                                          f"approx KL {kl:.3g} > {t['kl_alert']}: the policy left the trust region; "
                                          "lower update_epochs or learning_rate, or set target_kl", {"approx_kl": kl}))
        elif level == "warn":
            self._fire(out, update, Alert("warn", "kl_high",
                                          f"approx KL {kl:.3g} > {t['kl_warn']}: updates are large; consider a "
                                          "lower learning_rate or target_kl", {"approx_kl": kl}))

    def _clipfrac(self, out: list[Alert], update: int, m: dict) -> None:
        t = self.t
        p = int(t["clipfrac_patience"])
        recent = self._recent(S.CLIPFRAC, p)
        lr = _num(m, S.LEARNING_RATE)
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
                  and clip_idle(clipfrac, lr, self._first_lr, t)  # the annealed tail expects tiny steps
                  # A near-deterministic policy barely moves by nature (saturated probabilities, and on a solved
                  # task constant advantages normalize to 0); entropy_collapse reports that state.
                  and not self._collapse_rule(_num(m, S.ENTROPY))):
                self._fire(out, update, Alert("warn", "clip_never_fires",
                                              f"clip fraction < {t['clipfrac_low']} and approx KL < "
                                              f"{t['kl_negligible']:g} for {p} updates: the policy does not move; "
                                              "if the return is flat, check rewards/advantages and grad norm, "
                                              "then raise learning_rate or update_epochs",
                                              {"clipfrac": clipfrac, "approx_kl": kls[-1], "learning_rate": lr}))
        # The doctor's clipfrac_high is the same test over the whole run: a run of p updates above the line.
        if longest_run(recent, lambda c: c > t["clipfrac_high"])[0] >= p:
            self._fire(out, update, Alert("alert", "clipfrac_high",
                                          f"clip fraction > {t['clipfrac_high']} for {p} updates: over-fitting the "
                                          "rollout (drift); lower learning_rate or update_epochs",
                                          {"clipfrac": clipfrac}))

    def _recent_kl(self, n: int) -> list[float]:
        """The last ``n`` updates' KL of pi_theta after the update against pi_old when logged (A2C's in-update KL is
        taken before its only step, hence always 0), else the in-update approx KL."""
        return [_num(h, S.APPROX_KL_AFTER) if _finite(_num(h, S.APPROX_KL_AFTER))
                else _num(h, S.APPROX_KL) for h in self.history[-n:]]

    def _critic(self, out: list[Alert], update: int, m: dict) -> None:
        t = self.t
        if critic_never_learned(self.summary, t):
            last = self.summary.ev_last
            self._fire(out, update, Alert("warn", "critic_not_learning",
                                          f"explained variance has never exceeded {t['ev_min']} in {self.summary.updates} "
                                          f"updates (latest {last:.3g}): the critic is not learning; check "
                                          "learning_rate, vf_coef and the reward scale (normalize_reward)",
                                          {"explained_variance": last}))

    def _entropy(self, out: list[Alert], update: int, m: dict) -> None:
        ent = _num(m, S.ENTROPY)
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
                                          f"entropy {ent:.4g} fell {rule}: the policy became near-deterministic; if "
                                          "the return is not at its optimum, raise ent_coef or lower learning_rate",
                                          {"entropy": ent, "entropy_start": h0}))

    def _policy_lag(self, out: list[Alert], update: int, m: dict) -> None:
        n = int(self.t["lag_window"])
        lags = self._recent(S.POLICY_LAG, n)
        if lags is None or not all(_finite(x) for x in lags):  # a synchronous run logs no lag
            return
        # Half-window means: a trend, not one stale chunk (a single lag spike moves a half's mean by 1/(n/2) of it).
        half = n // 2
        before, after = sum(lags[:half]) / half, sum(lags[half:]) / (n - half)
        if after - before > self.t["lag_growth"]:
            self._fire(out, update, Alert("warn", "policy_lag_growing",
                                          f"policy lag grew from {before:.3g} to {after:.3g} versions (means of "
                                          f"the two halves of the last {n} updates): the learner falls behind its "
                                          "actors; use fewer actors, or fewer update_epochs",
                                          {"policy_lag": lags[-1], "lag_before": before, "lag_after": after}))

    def _collapse_rule(self, ent: float) -> str | None:
        """The collapse rule ``ent`` breaks (for the message), or None while the entropy has not collapsed."""
        if self._first_entropy is None:
            return None
        kind = self.action_kind or ("continuous" if self._saw_negative_entropy else "discrete")
        return entropy_collapse(self._first_entropy, ent, kind, self.action_dim, self.t)
