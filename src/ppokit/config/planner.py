"""The "ppo-trainer" planner: given an environment and a step budget, a PPO config with a reason per value.

``make_plan(env_id, budget)`` probes the environment (action space, observation shape, typical episode length
from a few random-action episodes), then picks values: known environments get known-good published settings
(the shipped presets, RL-Zoo's or CleanRL's defaults, each cited; with rl_zoo3 installed, RL-Zoo's own YAML
entry for an id without a preset, or for any id with ``zoo=True``: ``config/zoo.py``), anything else follows the
documented rules in ``_rule_based``. The result is a validated ``PPOConfig`` (so the trust-region guard rails apply) plus a
diagnostics plan whose thresholds are the live monitor's, rendered as Markdown, TOML (``PPOConfig.to_toml()``
with the reasons as comments, runnable with ``ppokit train --config``) or JSON.
"""

from __future__ import annotations

import fnmatch
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from ppokit.config.ppo_config import ConfigError, PPOConfig, load_preset, register_planner
from ppokit.config.zoo import ZOO_FILES, ZooSettings, zoo_dir, zoo_settings
from ppokit.core import schema as S
from ppokit.core.schema import THRESHOLDS
from ppokit.envs.backends import backend_names, get_backend

__all__ = ["EnvProbe", "Plan", "probe_env", "make_plan", "zoo_entry", "planned_config", "diagnostics_plan",
           "memory_reason", "MIN_UPDATES", "NON_MARKOV"]

# Fewer updates than this and PPO has too few policy-improvement steps to get anywhere on most tasks.
MIN_UPDATES = 50

# Published settings; each entry: (id patterns, source, field values, base preset or None).
_MUJOCO_NAMES = ("HalfCheetah", "Hopper", "Walker2d", "Ant", "Humanoid", "HumanoidStandup", "Swimmer", "Reacher",
                 "InvertedPendulum", "InvertedDoublePendulum", "Pusher")

KNOWN: list[tuple[tuple[str, ...], str, dict[str, Any], str | None]] = [
    (("CartPole-v1",), "the cartpole preset = RL-Zoo's tuned PPO hyperparameters for CartPole-v1", {}, "cartpole"),
    (("ppokit/CartPoleNoVel-v1",), "the cartpole-novel preset = RL-Zoo's tuned recurrent PPO hyperparameters for "
     "CartPoleNoVel-v1", {}, "cartpole-novel"),
    (("Acrobot-v1",), "the acrobot preset = RL-Zoo's tuned PPO hyperparameters for Acrobot-v1", {}, "acrobot"),
    (("Pendulum-v1",), "ppokit's pendulum preset (RL-Zoo's gamma 0.9, lr 1e-3, 10 epochs, no entropy bonus; 512-step rollouts "
     "and reward scaling in place of RL-Zoo's gSDE exploration)", {}, "pendulum"),
    (("LunarLander-v3", "LunarLander-v2"), "the lunarlander preset = RL-Zoo's tuned PPO hyperparameters for "
     "LunarLander", {}, "lunarlander"),
    (tuple(f"{n}-v*" for n in _MUJOCO_NAMES), "the mujoco preset = CleanRL ppo_continuous_action.py defaults "
     "(MuJoCo benchmark)", {}, "mujoco"),
    (("ALE/*", "*NoFrameskip-v4"), "the atari preset = CleanRL ppo_atari.py defaults (Atari benchmark)", {}, "atari"),
]


# Observations that do not show the state (not Markov), so the policy needs memory: ids that say so by name (the
# conventions of RL-Zoo's CartPoleNoVel, POMDP benchmark suites and MiniGrid's Memory tasks), and ppokit's own
# CartPole without velocities. A probe cannot tell hidden state from a stochastic env, so the id decides.
NON_MARKOV: list[tuple[str, str]] = [
    ("ppokit/CartPoleNoVel-v1", "its observation [x, theta] hides the cart's and the pole's velocities"),
    ("*NoVel*", "its id says the velocities are left out of the observation"),
    ("*NoVelocity*", "its id says the velocities are left out of the observation"),
    ("*POMDP*", "its id says it is partially observed"),
    ("*Memory*", "its id says it is a memory task"),
]


def memory_reason(env_id: str) -> str | None:
    """Why ``env_id``'s policy needs a recurrent core (``NON_MARKOV``), or None."""
    for pattern, why in NON_MARKOV:
        if fnmatch.fnmatchcase(env_id, pattern):
            return (f"{why}: one observation is not the state (not Markov), so the policy must remember the ones "
                    "before; an LSTM core does (PPO-LSTM, as RL-Zoo's ppo_lstm)")
    return None


@dataclass
class EnvProbe:
    """What a short look at the environment found out."""

    env_id: str
    probed: bool = False
    action_kind: str | None = None  # discrete | multidiscrete | continuous
    action_shape: str = "?"
    obs_shape: tuple[int, ...] | None = None
    image: bool = False
    episode_lengths: list[int] = field(default_factory=list)
    probe_steps: int = 0
    max_episode_steps: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def typical_episode_length(self) -> int | None:
        """Median length of the probe's finished episodes (or the time limit / steps seen when none finished)."""
        if self.episode_lengths:
            s = sorted(self.episode_lengths)
            return int(s[len(s) // 2])
        if self.max_episode_steps:
            return int(self.max_episode_steps)
        return self.probe_steps or None


def known_settings(env_id: str) -> tuple[str, dict[str, Any], str | None] | None:
    """``(source, values, preset)`` of the published settings for ``env_id``, or None for an unknown id."""
    for patterns, source, values, preset in KNOWN:
        if any(fnmatch.fnmatchcase(env_id, p) for p in patterns):
            return source, dict(values), preset
    return None


def _image_note(shape: tuple[int, ...]) -> str:
    """What training will do with a 3-D observation (encoders.observation_encoder decides; uint8 assumed)."""
    from ppokit.envs.encoders import CHANNEL_SIZES, MIN_IMAGE_SIZE

    if shape[0] in CHANNEL_SIZES or shape[-1] in CHANNEL_SIZES:
        h, w = shape[1:] if shape[0] in CHANNEL_SIZES else shape[:2]
        if min(h, w) < MIN_IMAGE_SIZE:
            return (f"image observations of shape {shape} are too small for the Nature CNN (>= {MIN_IMAGE_SIZE}x"
                    f"{MIN_IMAGE_SIZE}): training refuses them; resize them, or flatten them for an MLP with "
                    "gymnasium.wrappers.FlattenObservation")
    return ("image observations: a uint8 image is stored as bytes and read by the Nature CNN (pixels scaled by 1/255 "
            "inside the model); frame stacking and resizing are the env's")


def probe_env(env_id: str, episodes: int = 5, max_steps: int = 5000, max_seconds: float = 5.0,
              seed: int = 0, env_kwargs: dict[str, Any] | None = None,
              env_timeout: float | None = PPOConfig.env_timeout) -> EnvProbe:
    """Spaces and typical episode length from a few random-action episodes, bounded in steps and seconds.

    Each env call (the constructor, ``reset()``, ``step()``, ``close()``) is bounded by ``env_timeout`` seconds, as
    in training (``envs.watchdog``): an env that hangs ends the probe with an ``EnvError`` naming the phase.
    Raises ``ValueError`` for an unknown id; an installed-but-unbuildable env (missing extra) also raises.
    """
    from ppokit.envs import check_env_id
    from ppokit.envs.watchdog import EnvWatchdog

    check_env_id(env_id)
    watchdog = EnvWatchdog(env_timeout)
    with watchdog.running():
        return _probe(env_id, episodes, max_steps, max_seconds, seed, env_kwargs, watchdog)


def _probe(env_id: str, episodes: int, max_steps: int, max_seconds: float, seed: int,
           env_kwargs: dict[str, Any] | None, watchdog: Any) -> EnvProbe:
    import numpy as np

    from ppokit.envs import check_spaces, make_eval_env
    from ppokit.envs.errors import env_failure
    from ppokit.envs.watchdog import EnvTimeout

    probe = EnvProbe(env_id)
    try:
        with watchdog.guard("make()"):
            env = make_eval_env(env_id, env_kwargs=env_kwargs)  # the env the run will train on, kwargs and all
    except ConfigError:
        raise  # the constructor refused env_kwargs: a config error naming the field
    except (Exception, EnvTimeout) as exc:  # noqa: BLE001 - an env that cannot be built: one line, not its traceback
        raise env_failure(env_id, "make() (planner probe)", 0, exc) from exc
    try:
        probe.action_kind = check_spaces(env)
        act = env.action_space
        probe.action_shape = (f"Discrete({act.n})" if probe.action_kind == "discrete"
                              else f"MultiDiscrete({list(map(int, act.nvec))})" if probe.action_kind == "multidiscrete"
                              else f"Box({act.shape[0]}) in [{float(np.min(act.low)):g}, {float(np.max(act.high)):g}]")
        shape = env.observation_space.shape  # None for a Dict/Tuple observation (encoded per entry)
        probe.obs_shape = tuple(int(d) for d in shape) if shape is not None else None
        probe.image = probe.obs_shape is not None and len(probe.obs_shape) == 3
        spec = getattr(env, "spec", None)
        probe.max_episode_steps = getattr(spec, "max_episode_steps", None)
        env.action_space.seed(seed)
        phase = "reset()"
        try:
            with watchdog.guard(phase):
                env.reset(seed=seed)
            length, start = 0, time.perf_counter()
            while (len(probe.episode_lengths) < episodes and probe.probe_steps < max_steps
                   and time.perf_counter() - start < max_seconds):
                phase = "step()"
                with watchdog.guard(phase):
                    _, _, terminated, truncated, _ = env.step(env.action_space.sample())
                probe.probe_steps += 1
                length += 1
                if bool(terminated) or bool(truncated):
                    probe.episode_lengths.append(length)
                    length = 0
                    phase = "reset()"
                    with watchdog.guard(phase):
                        env.reset()
        except (Exception, EnvTimeout) as exc:  # noqa: BLE001 - the env raised (or hung) while the planner probed it
            raise env_failure(env_id, f"{phase} (planner probe)", probe.probe_steps, exc) from exc
        probe.probed = True
        if not probe.episode_lengths:
            probe.notes.append(f"no episode finished in the {probe.probe_steps}-step random probe; episode length "
                               f"taken as {probe.typical_episode_length}")
    finally:
        if not watchdog.fired:  # a hung env is not called again: its close() would hang too
            try:
                with watchdog.guard("close()"):
                    env.close()
            except EnvTimeout:
                pass  # the probe's result (or its error) stands; the env is abandoned
    return probe


def _pow2_at_least(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1.0, x))))


def _divisor_at_most(n: int, k: int) -> int:
    """Largest divisor of ``n`` that is <= ``k`` (at least 1)."""
    k = max(1, min(k, n))
    while n % k:
        k -= 1
    return k


def _rule_based(probe: EnvProbe, budget: int, reasons: dict[str, str]) -> dict[str, Any]:
    """Values from the documented rules for an environment with no published settings."""
    continuous = probe.action_kind == "continuous"
    v: dict[str, Any] = {}
    L = probe.typical_episode_length or 200
    src = ("probe median of random-action episodes" if probe.episode_lengths else "time limit (no probe episode ended)")

    # Rollout: N envs for decorrelated samples; T so one rollout holds several (>= 4) typical episodes.
    n_envs = 4 if continuous else 8
    steps = min(2048, max(16, _pow2_at_least(4 * L / n_envs)))
    max_batch = max(16, budget // MIN_UPDATES)
    cut = False
    while n_envs * steps > max_batch and steps > 16:
        steps //= 2
        cut = True
    while n_envs * steps > max_batch and n_envs > 1:
        n_envs //= 2
        cut = True
    v["num_envs"] = n_envs
    reasons["num_envs"] = (f"{'continuous' if continuous else 'discrete'} default of {4 if continuous else 8} parallel "
                           "envs (decorrelated samples, cheap on CPU)" + ("; reduced to fit the budget" if n_envs < (4 if continuous else 8) else ""))
    v["num_steps"] = steps
    episodes = n_envs * steps / L
    reasons["num_steps"] = (f"N*T = {n_envs * steps} steps covers ~{episodes:.1f} typical episodes (length {L}, {src})"
                            + (f"; capped so the budget gives >= {MIN_UPDATES} updates" if cut else ""))
    if episodes < 1:
        probe.notes.append(f"the budget only allows batches of {n_envs * steps} steps, shorter than one typical "
                           f"episode ({L} steps): GAE relies on bootstrapping; consider a larger budget")
    batch = n_envs * steps
    if continuous:
        # Continuous control: many small minibatches and 10 epochs (the MuJoCo-style recipe: minibatch ~64).
        nmb = _divisor_at_most(batch, max(1, batch // 64))
        v.update(num_minibatches=nmb, update_epochs=10, learning_rate=3e-4, ent_coef=0.0, normalize_obs=True,
                 normalize_reward=True)
        reasons["num_minibatches"] = f"minibatches of ~{batch // nmb} samples (continuous-control recipe: ~64)"
        reasons["update_epochs"] = "K = 10 epochs, the continuous-control default (well inside the K <= 30 rail)"
        reasons["learning_rate"] = "3e-4, the Adam default of continuous-control PPO"
        reasons["ent_coef"] = "0: a Gaussian policy explores through its learned std; a bonus can blow the std up"
        reasons["normalize_obs"] = "unscaled continuous observations: running mean/std normalization"
        reasons["normalize_reward"] = "reward scale unknown: scale by the running return std to keep eps meaningful"
    else:
        nmb = _divisor_at_most(batch, 4 if batch // 4 >= 32 else max(1, batch // 32))
        v.update(num_minibatches=nmb, update_epochs=4, learning_rate=2.5e-4, ent_coef=0.01)
        reasons["num_minibatches"] = f"{nmb} minibatch(es) of {batch // nmb} samples (discrete default 4, minibatch >= 32)"
        reasons["update_epochs"] = "K = 4 epochs, the discrete-action default (well inside the K <= 30 rail)"
        reasons["learning_rate"] = "2.5e-4, the Adam default of discrete-action PPO"
        reasons["ent_coef"] = "0.01: a small bonus keeps the categorical policy exploring early on"
    v["anneal_lr"] = True
    reasons["anneal_lr"] = ("linear decay to 0: PPO benefits from a decaying step size "
                            "(Schulman et al. 2017 anneal it in their Atari runs)")
    v["clip_coef"] = 0.2
    reasons["clip_coef"] = "eps = 0.2, the de-facto standard (0.1 too timid, > 0.3 unstable)"
    v["vf_coef"] = 0.5
    reasons["vf_coef"] = "c_v = 0.5, the standard weight of the value MSE"
    v["norm_adv"] = True
    reasons["norm_adv"] = "per-minibatch advantage normalization: required (PPO without it fails on most benchmarks)"
    # Discount: long episodes want a longer horizon 1/(1-gamma).
    v["gamma"] = 0.99 if L <= 1000 else 0.995
    reasons["gamma"] = (f"gamma = {v['gamma']}: effective horizon ~{1 / (1 - v['gamma']):.0f} steps for episodes of "
                        f"~{L} steps")
    v["gae_lambda"] = 0.95
    reasons["gae_lambda"] = "GAE lambda = 0.95: the usual bias/variance trade-off"
    return v


def diagnostics_plan() -> list[dict[str, str]]:
    """What to watch every update, with the healthy range, the alert thresholds and the action for each."""
    t = THRESHOLDS
    return [
        {"metric": S.APPROX_KL, "healthy": f"0 - {t['kl_warn']}",
         "alert": f"warn > {t['kl_warn']}, alert > {t['kl_alert']}",
         "action": f"above {t['kl_alert']}: lower update_epochs (K) or learning_rate, or set target_kl"},
        {"metric": S.CLIPFRAC, "healthy": f"{S.CLIPFRAC_HEALTHY[0]} - {S.CLIPFRAC_HEALTHY[1]}",
         "alert": f"~0 (< {t['clipfrac_low']}) for {t['clipfrac_patience']} updates; > {t['clipfrac_high']} sustained "
                  f"for {t['clipfrac_patience']} updates (drift)",
         "action": f"~0: the clip never fires, raise learning_rate or K; > {t['clipfrac_high']} sustained: "
                   "over-fitting the rollout, lower learning_rate or K"},
        {"metric": S.EXPLAINED_VARIANCE, "healthy": "climbs towards 1 as the critic learns",
         "alert": f"never above {t['ev_min']} after {t['ev_patience']} updates",
         "action": "critic not learning: check vf_coef, reward scale (normalize_reward), gamma"},
        {"metric": S.ENTROPY, "healthy": "decreases slowly while return rises",
         "alert": f"discrete: below {t['entropy_collapse_frac']:.0%} of its start; continuous: more than "
                  f"{t['entropy_collapse_nats_per_dim']} nats per action dim below its start",
         "action": "collapse before the return plateaus: raise ent_coef or lower learning_rate"},
        {"metric": "losses/*, advantages", "healthy": "finite",
         "alert": "any NaN/Inf, skipped minibatches",
         "action": "check rewards/observations for NaN/Inf, lower learning_rate, normalize rewards"},
    ]


@dataclass
class Plan:
    """A planned run: the validated config, a reason per chosen value, the probe, notes and the watch list."""

    config: PPOConfig
    reasons: dict[str, str]
    probe: EnvProbe
    source: str
    notes: list[str]
    diagnostics: list[dict[str, str]]

    def summary_rows(self) -> list[tuple[str, str, str]]:
        """``(item, value, reason)`` rows in the skill's order: rollout, schedule, surrogate, advantage."""
        c, r = self.config, self.reasons
        rows = [
            ("1. rollout N envs", str(c.num_envs), r.get("num_envs", "")),
            ("1. rollout T steps", str(c.num_steps), r.get("num_steps", "")),
            ("1. batch N*T", str(c.batch_size), f"{c.num_updates} updates over the budget of {c.total_timesteps:,} steps"),
            ("2. K epochs", str(c.update_epochs), r.get("update_epochs", "")),
            ("2. minibatch size", f"{c.minibatch_size} ({c.num_minibatches} minibatches)", r.get("num_minibatches", "")),
            ("2. learning rate", f"{c.learning_rate:g}" + (" -> 0 linear" if c.anneal_lr else " constant"),
"; ".join(dict.fromkeys(x for x in (r.get("learning_rate"), r.get("anneal_lr")) if x))),
            ("3. eps (clip_coef)", f"{c.clip_coef:g}" + (" -> 0 linear" if c.anneal_clip else ""), r.get("clip_coef", "")),
            ("3. c_v (vf_coef)", f"{c.vf_coef:g}", r.get("vf_coef", "")),
            ("3. c_e (ent_coef)", f"{c.ent_coef:g}", r.get("ent_coef", "")),
            ("3. advantage normalization", "on" if c.norm_adv else "OFF", r.get("norm_adv", "")),
            ("4. gamma", f"{c.gamma:g}", r.get("gamma", "")),
            ("4. GAE lambda", f"{c.gae_lambda:g}", r.get("gae_lambda", "")),
        ]
        if c.recurrent != "none":
            rows.append(("network: recurrent core", f"--recurrent {c.recurrent} ({c.recurrent_hidden} units, "
                         f"{c.recurrent_critic} critic core)", r.get("recurrent", "")))
        for name in ("normalize_obs", "normalize_reward", "max_grad_norm", "target_kl"):
            if name in r:
                rows.append((name, str(getattr(c, name)), r[name]))
        return rows

    def to_markdown(self) -> str:
        """The plan as a Markdown document (the default output of ``ppokit plan``)."""
        p, c = self.probe, self.config
        out = [f"# PPO plan for {c.env_id} ({c.total_timesteps:,} steps)", ""]
        if p.probed:
            ep = (f"median {p.typical_episode_length} steps over {len(p.episode_lengths)} random-action episodes"
                  if p.episode_lengths else f"no episode ended in {p.probe_steps} random steps")
            out.append(f"Environment: actions {p.action_shape} ({p.action_kind}), observations {p.obs_shape}"
                       f"{' (image)' if p.image else ''}, episode length {ep}.")
        else:
            out.append("Environment: not probed (see notes).")
        out += [f"Values from: {self.source}.", "", "| item | value | reason |", "|---|---|---|"]
        out += [f"| {a} | {b} | {r} |" for a, b, r in self.summary_rows()]
        out += ["", "## 5. Diagnostics plan", "", "| metric | healthy | alert | action |", "|---|---|---|---|"]
        out += [f"| {d['metric']} | {d['healthy']} | {d['alert']} | {d['action']} |" for d in self.diagnostics]
        if self.notes:
            out += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        out += ["", "Run it: `ppokit plan ... --out plan.toml && ppokit train --config plan.toml`", ""]
        return "\n".join(out)

    def to_toml(self) -> str:
        """``PPOConfig.to_toml()`` with each reason as a comment above its key; runs with ``ppokit train --config``."""
        head = [f"# PPO plan for {self.config.env_id}; values from {self.source}.",
                "# Diagnostics plan (checked live by ppokit's monitor, after the run by `ppokit doctor`):"]
        head += [f"#   {d['metric']}: healthy {d['healthy']}; alert {d['alert']}; {d['action']}" for d in self.diagnostics]
        head += [f"# note: {n}" for n in self.notes]
        body = []
        for line in self.config.to_toml().splitlines():
            key = line.lstrip("# ").split(" = ")[0]
            if key in self.reasons:
                body.append(f"# {self.reasons[key]}")
            body.append(line)
        return "\n".join(head + [""] + body) + "\n"

    def to_json(self) -> str:
        """The plan as JSON: config, reasons, probe, notes, diagnostics."""
        p = self.probe
        return json.dumps({
            "env_id": self.config.env_id, "source": self.source, "config": self.config.to_dict(),
            "reasons": self.reasons, "batch_size": self.config.batch_size,
            "minibatch_size": self.config.minibatch_size, "num_updates": self.config.num_updates,
            "probe": {"probed": p.probed, "action_kind": p.action_kind, "action_space": p.action_shape,
                      "obs_shape": list(p.obs_shape) if p.obs_shape else None, "image": p.image,
                      "episode_lengths": p.episode_lengths, "typical_episode_length": p.typical_episode_length},
            "notes": self.notes, "diagnostics": self.diagnostics}, indent=2)


def _short_budget_note(config: PPOConfig, budget: int) -> list[str]:
    """A note when published settings get fewer than MIN_UPDATES updates from ``budget``."""
    if config.batch_size * MIN_UPDATES <= budget:
        return []
    return [f"the budget of {budget:,} steps gives only {max(1, budget // config.batch_size)} updates of "
            f"{config.batch_size} steps with the published rollout size; they were tuned for longer runs"]


def zoo_entry(env_id: str, zoo: bool | None) -> ZooSettings | None:
    """RL-Zoo's translated entry the planner uses for ``env_id``: with ``zoo=True`` the entry or a
    ``ConfigError`` (rl_zoo3 missing, no entry); ``None`` (the default) the entry when rl_zoo3 is installed and
    ppokit has no preset for the id (the presets are RL-Zoo's own values, kept exact); ``False`` never."""
    if zoo is False or (zoo is None and (known_settings(env_id) is not None or zoo_dir() is None)):
        return None
    settings = zoo_settings(env_id)
    if settings is None and zoo:
        raise ConfigError("zoo", f"RL-Zoo has no PPO entry for {env_id!r} in {' or '.join(ZOO_FILES)} "
                                 f"({zoo_dir()})")
    return settings


def make_plan(env_id: str, budget: int | None, overrides: dict[str, Any] | None = None, probe: bool = True,
              zoo: bool | None = None) -> Plan:
    """Plan a PPO run on ``env_id`` for ``budget`` environment steps; ``overrides`` (field -> value) win.

    ``zoo`` picks RL-Zoo's published settings as the source (``zoo_entry``); with them ``budget=None`` means
    RL-Zoo's ``n_timesteps``. Raises ``ConfigError`` (naming the field) if the budget is invalid or the result
    breaks a guard rail without ``unsafe``; ``ValueError`` for an unknown environment id.
    """
    zs = zoo_entry(env_id, zoo)
    if budget is None and zs is not None and "total_timesteps" in zs.values:
        budget = zs.values["total_timesteps"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError("total_timesteps", f"the budget must be a positive integer number of steps, got {budget!r}")
    known = known_settings(env_id) if zs is None else None
    notes: list[str] = []
    listed = known_settings(env_id)  # the id's preset, even when RL-Zoo's entry is the source
    atari = listed is not None and listed[2] == "atari"
    pr = EnvProbe(env_id)
    # The probe builds the env the run will train on: with the env_kwargs given (a required one has no default).
    given = {k.replace("-", "_"): v for k, v in (overrides or {}).items()}
    env_kwargs = PPOConfig.from_dict({"env_kwargs": given.get("env_kwargs", {})}).env_kwargs
    env_timeout = PPOConfig.from_dict({"env_timeout": given.get("env_timeout", PPOConfig.env_timeout)}).env_timeout
    if probe:
        try:
            pr = probe_env(env_id, env_kwargs=env_kwargs, env_timeout=env_timeout)
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - a known env whose extra is not installed still gets its values
            if listed is None:
                raise
            package = "ale-py" if atari else "gymnasium[mujoco]" if "MuJoCo" in listed[0] else "gymnasium[box2d]"
            pr.notes.append(f"{env_id} could not be created here ({package} is probably not installed), so it was "
                            f"not probed; the known values are used. Install {package} to train it")
    notes += pr.notes
    if atari:
        notes.append("Atari: ppokit's Atari wrappers (atari.py: no-op reset, max-and-skip 4, episodic life, fire "
                     "reset, 84x84 grayscale, reward sign, 4 stacked frames) feed the Nature CNN shared by actor and "
                     "critic; evaluation reports whole-game, unclipped scores")
    elif pr.image:
        notes.append(_image_note(pr.obs_shape))

    reasons: dict[str, str] = {}
    base = PPOConfig()
    if zs is not None:
        source = zs.source
        values = {k: v for k, v in zs.values.items() if k != "total_timesteps"}
        reasons.update({k: f"{why}, as in RL-Zoo" for k, why in zs.reasons.items() if k in values})
        notes += [f"not translated from RL-Zoo: {name}: {why}" for name, why in zs.untranslated.items()]
        tuned = zs.values.get("total_timesteps")
        if tuned and tuned != budget:
            notes.append(f"RL-Zoo tuned these settings for {tuned:,} steps; this plan runs {budget:,}")
        config = PPOConfig.from_dict(values, base)
        notes += _short_budget_note(config, budget)
    elif known is not None:
        source, values, preset = known
        if preset:
            base = load_preset(preset)
            values = {k: getattr(base, k) for k in ("num_envs", "num_steps", "learning_rate", "anneal_lr",
                                                     "anneal_clip", "gamma", "gae_lambda", "num_minibatches",
                                                     "update_epochs", "clip_coef", "ent_coef", "vf_coef",
                                                     "norm_adv", "normalize_obs", "normalize_reward", "clip_vloss")}
        cite = source.split(" = ")[-1].replace(" hyperparameters", "").replace("defaults", "default")
        roles = {"num_envs": "parallel envs", "num_steps": "steps per env per rollout",
                 "update_epochs": "epochs per rollout", "num_minibatches": "minibatches per epoch",
                 "learning_rate": "Adam step size", "anneal_lr": "LR schedule", "clip_coef": "clip range",
                 "vf_coef": "value-loss weight", "ent_coef": "entropy bonus", "gamma": "discount",
                 "gae_lambda": "GAE bias/variance trade-off", "normalize_obs": "observation normalization",
                 "normalize_reward": "reward scaling"}
        for k, role in roles.items():
            if k in values:
                reasons[k] = f"{role}: {values[k]!r} as in {cite}"
        reasons["norm_adv"] = f"on as in {cite}; required by the guard rails"
        if base.recurrent != "none":
            why = memory_reason(env_id)
            reasons["recurrent"] = (f"{base.recurrent}, {base.recurrent_hidden} units, {base.recurrent_critic} critic "
                                    f"core as in {cite}" + (f"; {why}" if why else ""))
        config = PPOConfig.from_dict(values, base)
        notes += _short_budget_note(config, budget)
    else:
        source = "ppokit's rules for an environment with no published settings"
        if not pr.probed:
            raise ValueError(f"cannot plan {env_id!r}: it is not a known environment and could not be probed")
        values = _rule_based(pr, budget, reasons)
        why = memory_reason(env_id)
        if why is not None:
            values["recurrent"] = "lstm"
            reasons["recurrent"] = f"lstm: {why}"
        notes = pr.notes + [n for n in notes if n not in pr.notes]
        config = PPOConfig.from_dict(values, base)
    config = PPOConfig.from_dict({"env_id": env_id, "total_timesteps": budget, "monitor_kl": True,
                                  "monitor_clipfrac": True}, config)
    reasons.setdefault("max_grad_norm", "global gradient clip 0.5: the standard PPO safety net")
    for k, v in (overrides or {}).items():
        config = PPOConfig.from_dict({k: v}, config)
        reasons[k.replace("-", "_")] = "set on the command line"
    config.validate()
    notes += [n for n in (config.rounding_note(),) if n]  # the budget was the user's choice
    if config.unsafe:
        notes.append("UNSAFE: " + "; ".join(f"{n}: {r}" for n, r in config.guard_rail_violations()))
    return Plan(config, reasons, pr, source, notes, diagnostics_plan())


def planned_config(overrides: dict[str, Any], zoo: bool | None = None) -> tuple[PPOConfig, str]:
    """``(config, source)``: what ``ppokit train --env X`` and ``PPOConfig.for_env(X)`` train, for ``overrides``
    (config fields, ``env_id`` among them; as typed values or command-line text): the planner's config for X with
    the other fields applied, and one sentence saying where its values came from.

    The budget is ``total_timesteps`` when given, else the preset's own length for a known id (100k for CartPole),
    else the library default. Known ids need no probe (their values are published); unknown ones are probed.
    """
    # Type errors in the overrides first: they need no environment.
    flagged = PPOConfig.from_dict(overrides)
    env_id = flagged.env_id
    zs = zoo_entry(env_id, zoo)
    known = known_settings(env_id) if zs is None else None
    if "total_timesteps" in overrides:
        budget = flagged.total_timesteps
    elif zs is not None:
        budget = zs.values.get("total_timesteps", PPOConfig().total_timesteps)
    elif known is not None and known[2]:
        budget = load_preset(known[2]).total_timesteps
    else:
        budget = PPOConfig().total_timesteps
    rest = {k: v for k, v in overrides.items() if k not in ("env_id", "total_timesteps")}
    if known is None and zs is None and flagged.vector_mode in backend_names() and get_backend(flagged.vector_mode).own_task_ids:
        # A backend's own task ids (envpool's) are not Gymnasium ids, so the planner cannot probe them: the
        # defaults it is.
        return (flagged.validate(), f"config: library defaults for {env_id} (the planner cannot probe an "
                                    f"{flagged.vector_mode} task; pass --preset or --config to tune it)")
    plan = make_plan(env_id, budget, rest, probe=known is None, zoo=zoo)
    source = (f"config: planner settings for {env_id} ({plan.source}); see ppokit plan --env {env_id} "
              f"--budget {budget}")
    return plan.config, source


register_planner(planned_config)
