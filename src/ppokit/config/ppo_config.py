"""``PPOConfig``: the single source of truth for a run.

The CLI flags, TOML files, presets, the planner and checkpoints all read and write this one dataclass. Field
names follow CleanRL's ``ppo.py``; each field's ``help`` becomes its ``--help`` line. Validation lives here and
runs before any environment is created: an invalid value raises ``ConfigError`` naming the field and the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppokit.core.algos import (  # the registry itself (live: an algo registered later validates too)
    ALGOS,
    describe_algos,
)
from ppokit.core.errors import ConfigError  # noqa: F401  (raised here, and importable from here)
from ppokit.core.schema import KL_STOP_FACTOR
from ppokit.envs.backends import get_backend  # the registry itself: a backend registered later validates too

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["PPOConfig", "ConfigError", "PRESETS_DIR", "list_presets", "load_preset", "SAFE_LIMITS"]

PRESETS_DIR = Path(__file__).parent / "presets"

ACTIVATIONS = ("tanh", "relu")
RECURRENT = ("none", "lstm", "gru")
RECURRENT_CRITICS = ("separate", "shared")
ACTOR_CLIPS = ("behaviour", "proximal")  # with actors: the ratio's denominator (rollout/actors.py)

# The trust-region guard rails (docs/diagnostics.md, "Guard rails"): beyond these a run is refused unless marked
# unsafe.
SAFE_LIMITS = {"update_epochs": 30, "clip_coef": 0.3}

# Integers must fit torch's and numpy's int64; numpy seeds must fit 32 bits.
INT_MAX = 2**63 - 1
SEED_MAX = 2**32 - 1
# More rollout worker processes than this on one machine is a typo (each is a whole Python process with its envs).
MAX_ACTORS = 256


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: list(d) if isinstance(d, list) else dict(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


# What ``PPOConfig.for_env`` asks for a planned config: ``config.planner`` registers its ``planned_config`` here when
# it is imported, and ``ppokit.config`` imports it, so it is always set. (The planner builds PPOConfigs; this module
# knows only the function, so the two do not import each other.)
_PLANNER: list = []


def register_planner(planned_config) -> None:
    """Make ``planned_config(overrides) -> (config, source)`` what ``PPOConfig.for_env`` calls."""
    _PLANNER[:] = [planned_config]


@dataclass
class PPOConfig:
    """Every knob of a PPO run. Derived sizes are properties and never stored."""

    # --- environment ---
    env_id: str = _f("CartPole-v1", "Gymnasium environment id (any registered id, e.g. CartPole-v1, ppokit/GridWorld-v0)")
    num_envs: int = _f(4, "number of parallel environments N")
    vector_mode: str = _f("sync", "vectorization: sync (one process), async (subprocesses), native (the env's "
                          "batched version) or envpool (the optional envpool package)")
    env_kwargs: dict[str, Any] = _f({}, "keyword arguments for the env's constructor (gym.make / make_vec), as a "
                                    "JSON object on the command line, e.g. '{\"map_name\": \"8x8\"}', or a TOML table")
    normalize_obs: bool = _f(False, "normalize observations by a running mean/std (clipped to +-10)")
    normalize_reward: bool = _f(False, "scale rewards by the running std of the discounted return (clipped to +-10)")
    env_timeout: float | None = _f(120.0, "seconds an env's reset(), step() or close() may take before the run ends "
                                   "naming the env, after saving the learner state (none or 0: no limit)", max=1e6)
    # --- rollout and schedule ---
    num_steps: int = _f(128, "steps T per environment per rollout (batch = num_envs * num_steps)")
    total_timesteps: int = _f(500_000, "total environment steps of the run")
    learning_rate: float = _f(2.5e-4, "Adam learning rate, in [0, 1]", max=1.0)
    anneal_lr: bool = _f(True, "decay the learning rate linearly to 0 over the run")
    anneal_clip: bool = _f(False, "decay clip_coef linearly to 0 over the run (RL-Zoo's 'lin_' clip)")
    # --- advantages ---
    gamma: float = _f(0.99, "discount factor, in (0, 1]")
    gae_lambda: float = _f(0.95, "GAE lambda, in [0, 1]")
    norm_adv: bool = _f(True, "normalize advantages per minibatch (zero mean, unit std)")
    # --- update ---
    algo: str = _f("ppo", f"objective: {describe_algos()}")
    num_minibatches: int = _f(4, "minibatches per epoch (must divide num_envs * num_steps)")
    update_epochs: int = _f(4, "epochs K over each rollout")
    recurrent_seq_len: int = _f(0, "a stateful (recurrent) policy trains on whole env sequences cut into chunks of "
                                "this many steps (truncated backpropagation through time); 0: the whole rollout, "
                                "num_steps")
    clip_coef: float = _f(0.2, "clip range eps of the surrogate objective, in (0, 10]", max=10.0)
    clip_vloss: bool = _f(True, "clip the value change to +-clip_coef as in PPO2")
    # Upper bounds ("max") are far beyond any useful value: they catch typos such as 1e308, not tuning choices.
    ent_coef: float = _f(0.01, "entropy bonus coefficient c_e, in [0, 1000]", max=1e3)
    vf_coef: float = _f(0.5, "value loss coefficient c_v, in [0, 1000]", max=1e3)
    max_grad_norm: float = _f(0.5, "global gradient-norm clip, in (0, 1e9]", max=1e9)
    target_kl: float | None = _f(None, f"stop the update's epochs when approx KL > {KL_STOP_FACTOR} * target_kl, in (0, 100] "
                                 "(none: never)", max=100.0)
    init_kl_beta: float = _f(1.0, "ppo-kl: initial KL penalty coefficient beta, in (0, 1e6]", max=1e6)
    kl_target: float = _f(0.01, "ppo-kl: target KL of the adaptive penalty (beta x2 above 2x, /2 below 1/2x), "
                          "in (0, 100]", max=100.0)
    # --- network ---
    hidden_sizes: list[int] = _f([64, 64], "hidden layer widths of the actor and critic MLPs, e.g. 64,64")
    activation: str = _f("tanh", "hidden activation: tanh or relu")
    ortho_init: bool = _f(True, "orthogonal init of the layers (PPO's implementation details); off: PyTorch's default "
                          "init (SB3's ortho_init=False)")
    # CleanRL's ppo_atari_lstm width: the default serves images (512 CNN features) and vectors alike; small vector
    # tasks tune it down (RL-Zoo's CartPoleNoVel-v1: 64, the cartpole-novel preset).
    recurrent: str = _f("none", "recurrent core after the observation encoder: none, lstm or gru (for observations "
                        "that do not show the state, e.g. hidden velocities; hidden_sizes are then the heads')")
    recurrent_hidden: int = _f(128, "units of the recurrent core (with recurrent lstm or gru)")
    recurrent_critic: str = _f("separate", "the critic's recurrent core: separate (its own, sb3-contrib's "
                               "enable_critic_lstm) or shared (the actor's, CleanRL's)")
    # --- monitoring (guard rails require both) ---
    monitor_kl: bool = _f(True, "monitor approx KL every update (required unless --unsafe)")
    monitor_clipfrac: bool = _f(True, "monitor the clip fraction every update (required unless --unsafe)")
    unsafe: bool = _f(False, "allow configs outside the safe trust region; the run is stamped unsafe")
    # --- system ---
    seed: int = _f(1, f"random seed, in [0, {SEED_MAX}]")
    device: str = _f("cpu", "torch device: cpu, cuda, cuda:N or mps (refused when not available here)")
    torch_threads: int = _f(1, "torch intra-op threads (1 is fastest for small networks; more than the machine's "
                            "CPU cores are capped at the core count with a warning)")
    dist_timeout: float = _f(60.0, "data-parallel runs (torchrun): seconds a rank waits for the others in a "
                             "collective before the job fails, naming the lost rank", max=86400.0)
    actors: int = _f(0, "decoupled rollout workers (IMPALA-style, rollout/actors.py): K processes, each stepping "
                     "num_envs envs with a copy of the policy, feed a learner that trains on V-trace targets; 0: "
                     "the synchronous loop")
    max_policy_lag: int = _f(8, "with actors: a chunk acted by weights more than this many updates behind the "
                             "learner is dropped (and counted in diag/dropped_chunks_frac)")
    actor_clip: str = _f("behaviour", "with actors: what the surrogate's ratio is clipped against: behaviour (the "
                         "weights that acted: APPO's form) or proximal (the learner's at the update's start, rho "
                         "weighing the advantage: Hilton et al. 2021; the mujoco preset's, where it learned twice as "
                         "fast: benchmarks/RESULTS.md)")
    actor_timeout: float | None = _f(600.0, "with actors: seconds a worker may take to send one chunk (60 s more for "
                                     "its first) before it is named, killed and replaced (none or 0: no limit)",
                                     max=1e6)
    ray_address: str | None = _f(None, "with actors: run them as Ray actors (extra ray, rollout/ray_actors.py) on the "
                                 "Ray cluster at this address: auto (the one `ray start --head` started), HOST:PORT, "
                                 "ray://HOST:PORT, or local (a one-machine Ray for the run); none: worker processes")
    fused_update: bool = _f(True, "use the fused MLP update path where it applies (autograd otherwise), and the "
                            "acting kernels (a recurrent policy's cell kernel included; off: the eager modules act)")
    run_dir: str | None = _f(None, "run directory (default: runs/<env>__<algo>__s<seed>__<YYYYmmdd-HHMMSS>)")
    log_every: int = _f(10, "print a metrics table every this many updates")
    save_every: int = _f(50, "write a checkpoint every this many updates (and at the end)")
    tensorboard: bool = _f(True, "write TensorBoard event files")
    track: bool = _f(False, "log the metrics to Weights & Biases (needs pip install 'ppokit[wandb]'; "
                     "WANDB_MODE=offline writes the W&B run into RUN_DIR/wandb without a network)")
    wandb_project: str = _f("ppokit", "Weights & Biases project of --track")
    wandb_entity: str | None = _f(None, "Weights & Biases entity (user or team) of --track (none: your default)")
    capture_video: bool = _f(False, "record env 0's episodes as mp4 files in RUN_DIR/videos, every video_every-th "
                             "episode (Gymnasium's RecordVideo; vector_mode sync; needs pip install 'ppokit[video]')")
    video_every: int = _f(100, "with capture_video: record episodes 0, N, 2N, ... of env 0")
    # --- evaluation gate (optional early stop once solved) ---
    eval_every: int = _f(0, "every this many updates, evaluate the deterministic policy on a separate env and stop "
                            "once its mean return reaches eval_threshold (0: never evaluate)")
    eval_threshold: float | None = _f(None, "mean deterministic evaluation return that ends the run (needs "
                                             "eval_every > 0)")
    eval_episodes: int = _f(16, "episodes per evaluation, run in parallel (one per env of a vectorized env)")
    eval_deterministic: bool = _f(True, "the evaluation gate (and ppokit eval of this run) acts on the most likely "
                                        "action / the mean; false samples from the policy, as CleanRL's published "
                                        "Atari scores do")

    # ---------------------------------------------------------------- derived sizes
    @property
    def batch_size(self) -> int:
        """Samples per rollout, ``num_envs * num_steps``."""
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        """Samples per minibatch."""
        return self.batch_size // self.num_minibatches

    @property
    def num_updates(self) -> int:
        """Rollout/update iterations in the run (at least 1)."""
        return max(1, self.total_timesteps // self.batch_size)

    # ---------------------------------------------------------------- validation
    def validate(self) -> "PPOConfig":
        """Raise one ``ConfigError`` naming every invalid field (the first reason of each); return self when valid."""
        problems: dict[str, str] = {}

        def need(ok: bool, name: str, reason: str) -> None:
            if not ok:
                problems.setdefault(name, reason)

        def gate() -> None:  # the checks after this one assume the fields checked before it are valid
            if problems:
                raise ConfigError.of(problems)

        # Types first, strictly (a bool is not an int, a string is not a number), so the range checks below
        # compare numbers with numbers.
        for f in dataclasses.fields(self):
            try:
                _coerce(f.name, getattr(self, f.name), strict=True)
            except ConfigError as exc:
                need(False, exc.field, exc.reason)
        gate()
        for name in ("num_envs", "num_steps", "total_timesteps", "num_minibatches", "update_epochs",
                     "torch_threads", "log_every", "save_every", "video_every"):
            value = getattr(self, name)
            need(isinstance(value, int) and 1 <= value <= INT_MAX, name,
                 f"must be a positive integer (at most {INT_MAX}), got {value!r}")
        need(isinstance(self.seed, int) and 0 <= self.seed <= SEED_MAX, "seed",
             f"must be an integer in [0, {SEED_MAX}] (numpy's seed range), got {self.seed!r}")
        for name in ("learning_rate", "clip_coef", "ent_coef", "vf_coef", "max_grad_norm", "gamma", "gae_lambda",
                     "init_kl_beta", "kl_target"):
            value = getattr(self, name)
            need(math.isfinite(value), name, f"must be a finite number, got {_show(value)}")
        need(self.env_timeout is None or (math.isfinite(self.env_timeout) and self.env_timeout >= 0), "env_timeout",
             f"must be a positive number of seconds, or none or 0 for no limit, got {_show(self.env_timeout)}")
        need(self.actor_timeout is None or (math.isfinite(self.actor_timeout) and self.actor_timeout >= 0),
             "actor_timeout", "must be a positive number of seconds, or none or 0 for no limit, got "
             f"{_show(self.actor_timeout)}")
        for f in dataclasses.fields(self):
            value, top = getattr(self, f.name), f.metadata.get("max")
            if top is not None and value is not None:
                need(value <= top, f.name, f"must be <= {top:g} (larger values are a typo, not a setting), "
                                           f"got {_show(value)}")
        need(math.isfinite(self.dist_timeout) and self.dist_timeout > 0, "dist_timeout",
             f"must be a positive number of seconds, got {_show(self.dist_timeout)}")
        need(self.learning_rate >= 0, "learning_rate", f"must be >= 0, got {self.learning_rate}")
        need(0 < self.gamma <= 1, "gamma", f"must be in (0, 1], got {self.gamma}")
        need(0 <= self.gae_lambda <= 1, "gae_lambda", f"must be in [0, 1], got {self.gae_lambda}")
        need(self.clip_coef > 0, "clip_coef", f"must be > 0, got {self.clip_coef}")
        need(self.ent_coef >= 0, "ent_coef", f"must be >= 0, got {self.ent_coef}")
        need(self.vf_coef >= 0, "vf_coef", f"must be >= 0, got {self.vf_coef}")
        need(self.max_grad_norm > 0, "max_grad_norm", f"must be > 0, got {self.max_grad_norm}")
        need(self.init_kl_beta > 0, "init_kl_beta", f"must be > 0, got {self.init_kl_beta}")
        need(self.kl_target > 0, "kl_target", f"must be > 0, got {self.kl_target}")
        need(isinstance(self.eval_every, int) and 0 <= self.eval_every <= INT_MAX,
             "eval_every", f"must be an integer >= 0 (0 turns the evaluation gate off), got {self.eval_every!r}")
        need(isinstance(self.eval_episodes, int) and 1 <= self.eval_episodes <= INT_MAX, "eval_episodes",
             f"must be a positive integer, got {self.eval_episodes!r}")
        if self.eval_threshold is not None:
            need(math.isfinite(self.eval_threshold), "eval_threshold",
                 f"must be a finite number or none, got {self.eval_threshold!r}")
        need(self.eval_every == 0 or self.eval_threshold is not None, "eval_threshold",
             "must be set when eval_every > 0 (the return at which the evaluation gate stops training)")
        # A threshold without an evaluation never stops anything; refusing beats silently ignoring it.
        if self.eval_threshold is not None:
            need(self.eval_every > 0, "eval_threshold", f"is set ({self.eval_threshold:g}) but eval_every is 0, "
                 "so no evaluation ever runs; set eval_every (e.g. 10) or remove eval_threshold")
        if self.target_kl is not None:
            need(math.isfinite(self.target_kl) and self.target_kl > 0, "target_kl",
                 f"must be > 0 or none, got {self.target_kl!r}")
        gate()  # num_envs, num_steps and num_minibatches are positive integers from here on
        need(self.batch_size % self.num_minibatches == 0, "num_minibatches",
             f"{self.num_minibatches} does not divide the batch num_envs * num_steps = {self.batch_size}; "
             f"choose a divisor of {self.batch_size}")
        need(isinstance(self.recurrent_seq_len, int) and 0 <= self.recurrent_seq_len <= self.num_steps,
             "recurrent_seq_len", f"must be an integer in [0, num_steps = {self.num_steps}] (0: the whole rollout), "
             f"got {self.recurrent_seq_len!r}")
        need(self.algo in ALGOS, "algo", f"must be one of {', '.join(ALGOS)}, got {self.algo!r}")
        need(self.activation in ACTIVATIONS, "activation", f"must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        need(self.recurrent in RECURRENT, "recurrent", f"must be one of {', '.join(RECURRENT)}, got {self.recurrent!r}")
        need(self.actor_clip in ACTOR_CLIPS, "actor_clip",
             f"must be one of {', '.join(ACTOR_CLIPS)}, got {self.actor_clip!r}")
        need(self.recurrent_critic in RECURRENT_CRITICS, "recurrent_critic",
             f"must be one of {', '.join(RECURRENT_CRITICS)}, got {self.recurrent_critic!r}")
        need(isinstance(self.recurrent_hidden, int) and 1 <= self.recurrent_hidden <= 1 << 16, "recurrent_hidden",
             f"must be an integer in [1, {1 << 16}], got {self.recurrent_hidden!r}")
        try:
            get_backend(self.vector_mode)
        except ConfigError as exc:  # its reason names the registered modes
            need(False, exc.field, exc.reason)
        need(len(self.hidden_sizes) >= 1 and all(isinstance(h, int) and 1 <= h <= 1 << 20 for h in self.hidden_sizes),
             "hidden_sizes", f"must be a non-empty list of integers in [1, {1 << 20}], got {self.hidden_sizes!r}")
        need(self.env_id != "", "env_id", "must be a non-empty environment id")
        from ppokit.config.wandb_names import project_name_problem

        project_problem = project_name_problem(self.wandb_project)
        need(project_problem is None, "wandb_project", project_problem or "")
        need(not self.capture_video or self.vector_mode == "sync", "capture_video",
             f"records env 0 of a sync vector env; vector_mode {self.vector_mode!r} runs the envs elsewhere: set "
             "vector_mode = sync")
        need(isinstance(self.actors, int) and 0 <= self.actors <= MAX_ACTORS, "actors",
             f"must be an integer in [0, {MAX_ACTORS}] (0: the synchronous loop), got {self.actors!r}")
        need(isinstance(self.max_policy_lag, int) and 0 <= self.max_policy_lag <= INT_MAX, "max_policy_lag",
             f"must be an integer >= 0 (updates a chunk's weights may lag the learner's), got {self.max_policy_lag!r}")
        need(self.ray_address is None or (isinstance(self.ray_address, str) and self.ray_address.strip() != ""),
             "ray_address", f"must be auto, local, HOST:PORT or ray://HOST:PORT, got {self.ray_address!r}")
        need(self.ray_address is None or self.actors != 0, "ray_address", "places the rollout actors on Ray, and "
             "actors = 0 runs none (the synchronous loop): set actors >= 1, or leave ray_address unset")
        if isinstance(self.actors, int) and self.actors > 0:
            # What the decoupled learner does not do yet, refused rather than run wrong (rollout/actors.py).
            need(not self.capture_video, "actors", "is not supported with capture_video (the learner's env 0, which "
                 "records, does not step): set actors = 0 or capture_video = false")
            need(self.device == "cpu", "actors", f"runs its learner on the CPU only for now, got device "
                 f"{self.device!r}: set actors = 0 or device = cpu")
        gate()
        from ppokit.config.resources import check_device, check_memory, check_run_dir

        check_device(self.device)
        if self.run_dir is not None:
            check_run_dir(self.run_dir)
        # A lower bound (one float per observation) before any environment exists: num_envs = 1e9 must be
        # refused before a billion environments are built. The trainer repeats it with the real obs size.
        check_memory(self, obs_dim=1)
        if not self.unsafe:
            self._check_guard_rails()
        return self

    def warnings(self, world_size: int = 1) -> list[str]:
        """Valid but probably unintended settings, one sentence each (the CLI prints them on stderr).

        ``world_size``: data-parallel ranks, each collecting a batch per update (total_timesteps counts them all)."""
        out = []
        batch, what = self._batch(world_size)
        if self.total_timesteps < batch:
            out.append(f"total_timesteps={self.total_timesteps:,} is less than one batch ({what} = "
                       f"{batch:,}): the run trains one batch of {batch:,} steps")
        return out

    def rounding_note(self, world_size: int = 1) -> str | None:
        """The sentence saying that ``total_timesteps`` is cut to whole batches (the trainer runs
        ``total_timesteps // batch`` updates), or None when it is a multiple of the batch or below one batch (which
        ``warnings`` names). Said where the user chose the length: a preset's round 100k is not their choice."""
        batch, what = self._batch(world_size)
        n = self.total_timesteps // batch
        if n < 1 or self.total_timesteps % batch == 0:
            return None
        return (f"total_timesteps={self.total_timesteps:,} is not a multiple of the batch ({what} = {batch:,}): "
                f"the run trains {n * batch:,} steps ({n:,} update{'s' * (n != 1)}); {(n + 1) * batch:,} would be "
                f"{n + 1:,} updates")

    def _batch(self, world_size: int) -> tuple[int, str]:
        """Env steps per update over ``world_size`` ranks, and how that number is made."""
        what = "num_envs * num_steps" + (f" * {world_size} ranks" if world_size > 1 else "")
        return self.batch_size * world_size, what

    def guard_rail_violations(self) -> list[tuple[str, str]]:
        """The (field, reason) pairs of every trust-region guard rail this config breaks."""
        out = []
        if self.update_epochs > SAFE_LIMITS["update_epochs"]:
            out.append(("update_epochs", f"{self.update_epochs} epochs is an unsafe trust region: K must be <= "
                        f"{SAFE_LIMITS['update_epochs']} (the policy drifts too far from pi_old); safe range 1-30, "
                        "typical 3-10"))
        algo = ALGOS.get(self.algo)  # None for an unknown algo, which validate() refuses by name
        if algo is not None and algo.clip_guard_rail and self.clip_coef > SAFE_LIMITS["clip_coef"]:
            out.append(("clip_coef", f"eps={self.clip_coef} is an unsafe trust region: eps must be <= "
                        f"{SAFE_LIMITS['clip_coef']}; safe range 0.1-0.3, typical 0.2"))
        if not self.norm_adv:
            out.append(("norm_adv", "advantage normalization is off: PPO without it fails on most benchmarks; "
                        "set norm_adv = true"))
        if not self.monitor_kl:
            out.append(("monitor_kl", "KL monitoring is off: every PPO run must watch approx KL; set monitor_kl = true"))
        if not self.monitor_clipfrac:
            out.append(("monitor_clipfrac", "clip-fraction monitoring is off: every PPO run must watch it; "
                        "set monitor_clipfrac = true"))
        return out

    def _check_guard_rails(self) -> None:
        violations = self.guard_rail_violations()
        if violations:
            name, reason = violations[0]
            raise ConfigError(name, reason + " (pass --unsafe / unsafe = true to run it anyway as an ablation)")

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (lists copied)."""
        return {f.name: (copy.deepcopy(v) if isinstance(v := getattr(self, f.name), (list, dict)) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of every config field, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def for_env(cls, env_id: str, **overrides: Any) -> "PPOConfig":
        """The config ``ppokit train --env ENV_ID`` trains: the planner's (published settings where known, e.g.
        the cartpole preset for CartPole-v1, its rules otherwise; see ``ppokit plan``), with ``overrides`` (config
        fields) applied as flags are. ``PPOConfig(env_id=...)`` is the library defaults instead. Validated."""
        return _PLANNER[0]({**overrides, "env_id": env_id})[0]

    @classmethod
    def from_dict(cls, data: dict[str, Any], base: "PPOConfig | None" = None, strict: bool = False) -> "PPOConfig":
        """A config from ``data`` over ``base`` (or the defaults); unknown keys and values of the wrong type raise
        one ``ConfigError`` naming every such key.

        Strings are parsed as command-line text (``"1e5"``, ``"64,64"``, ``"true"``) unless ``strict``, where
        every value must already have its field's type (TOML files: ``num_envs = "12"`` is refused).
        """
        config, problems = cls._apply(data, base, strict)
        if problems:
            raise ConfigError.of(problems)
        return config

    @classmethod
    def _apply(cls, data: dict[str, Any], base: "PPOConfig | None", strict: bool) -> tuple["PPOConfig", dict[str, str]]:
        """``(config, problems)``: ``base`` with the keys of ``data`` that are valid, and field -> reason for the
        others (an unknown key, a value that does not fit its field's type)."""
        values = (base or cls()).to_dict()
        known = set(values)
        problems: dict[str, str] = {}
        for key, value in data.items():
            name = key.replace("-", "_")
            if name == "env":
                name = "env_id"
            if name not in known:
                import difflib

                close = difflib.get_close_matches(name, sorted(known), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                problems.setdefault(name, f"unknown config field{hint}")
                continue
            try:
                values[name] = _coerce(name, value, strict=strict)
            except ConfigError as exc:
                problems.setdefault(name, exc.reason)
        return cls(**values), problems

    @classmethod
    def from_toml(cls, path: str | Path, base: "PPOConfig | None" = None) -> "PPOConfig":
        """Load a TOML file (flat keys, or under a ``[ppo]`` table) over ``base``."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError("config", f"no TOML file at {path}")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError("config", f"{path} is not a UTF-8 TOML file (a binary file? checkpoints are "
                                        "loaded with --resume or ppokit eval)") from None
        except OSError as exc:
            raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{path} is not valid TOML: {exc}") from exc
        tables = [k for k, v in data.items() if isinstance(v, dict) and k not in ("ppo", *cls.field_names())]
        if tables:
            raise ConfigError(tables[0], f"unknown table [{tables[0]}] in {path}; ppokit reads flat keys or one "
                                         "[ppo] table")
        if isinstance(data.get("ppo"), dict):
            # One place per key: a top-level key beside [ppo] would otherwise be silently ignored.
            others = [k for k in data if k != "ppo"]
            if others:
                raise ConfigError(others[0], f"{path} has a [ppo] table, so top-level keys are not read; move "
                                             f"{', '.join(others)} into [ppo]")
            data = data["ppo"]
        config, problems = cls._apply(data, base, strict=True)
        if problems:
            # Every mistake of the file at once: the values the valid keys set are range-checked too, and those of
            # its keys that fail join the list (validate() reports the rest when the types are right).
            try:
                config.validate()
            except ConfigError as exc:
                keys = {k.replace("-", "_") for k in data}
                problems.update({k: r for k, r in exc.problems.items() if k in keys and k not in problems})
            raise ConfigError.of(problems, where=f"{path} has {len(problems)} invalid keys"
                                 if len(problems) > 1 else "")
        return config

    def to_toml(self) -> str:
        """The config as TOML text (``target_kl``/``run_dir`` of none are written as comments)."""
        lines = []
        for name, value in self.to_dict().items():
            if value is None:
                lines.append(f"# {name} = none")
            else:
                lines.append(f"{name} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    def save_toml(self, path: str | Path) -> None:
        """Write the resolved config as TOML."""
        Path(path).write_text(self.to_toml())


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table on one line, so a planner comment above the key stays above it
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(key)


_FIELD_TYPES: dict[str, str] = {}


def _field_kind(name: str) -> str:
    if not _FIELD_TYPES:
        for f in dataclasses.fields(PPOConfig):
            t = str(f.type)
            kind = ("bool" if t == "bool" else "int" if t == "int" else "float" if t == "float"
                    else "optfloat" if t.startswith("float |") else "intlist" if t.startswith("list")
                    else "kwargs" if t.startswith("dict")
                    else "optstr" if t.startswith("str |") else "str")
            _FIELD_TYPES[f.name] = kind
    return _FIELD_TYPES[name]


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_EXPECTED = {"bool": "true or false", "int": "an integer", "float": "a number", "optfloat": "a number or none",
             "intlist": "a list of integers (on the command line: comma-separated, e.g. 64,64)",
             "str": "a string", "optstr": "a string or none",
             "kwargs": "a table of keyword arguments (on the command line: a JSON object, e.g. "
                       "'{\"map_name\": \"8x8\"}')"}


class _BadValue(Exception):
    """Raised inside ``_coerce`` when a value does not fit its field's type; carries an optional hint."""


def _int(value: Any, text: bool) -> int:
    """An integer from an int, an integral float (TOML writes 1e6 as a float) or, as text, "12" / "1e5"."""
    if isinstance(value, bool):
        raise _BadValue("a bool is not an integer")
    if isinstance(value, str) and text:
        try:
            return int(value)
        except ValueError:
            value = float(value)  # "1e5"; ValueError for anything else
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise _BadValue("not a whole finite number")
        value = int(value)
    if not isinstance(value, int):
        raise _BadValue
    return value


def _float(value: Any, text: bool) -> float:
    if isinstance(value, bool):
        raise _BadValue("a bool is not a number")
    if isinstance(value, (int, float)) or (isinstance(value, str) and text):
        return float(value)  # OverflowError for an int beyond float range, ValueError for bad text
    raise _BadValue


def _coerce(name: str, value: Any, strict: bool = False) -> Any:
    """Convert a value to field ``name``'s type, or raise ConfigError naming the field.

    Types are strict: a bool is never a number, a float is an int only when whole (``1e5``), and strings are
    parsed only as command-line text (``strict=False``); ``strict=True`` (TOML, validation) refuses ``"12"``
    for an int and ``"yes"`` for a bool. Optional fields take none (``"none"`` or ``""`` as text or in TOML).
    """
    kind = _field_kind(name)
    text = isinstance(value, str) and not strict
    raw = value
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if text and value.strip().lower() in _TRUE + _FALSE:
                return value.strip().lower() in _TRUE
            raise _BadValue
        if kind == "int":
            return _int(value, text)
        if kind == "float":
            return _float(value, text)
        if kind in ("optfloat", "optstr"):
            if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
                return None
            if kind == "optfloat":
                return _float(value, text)
            if isinstance(value, str):
                return value
            raise _BadValue
        if kind == "intlist":
            if text:
                parts = [v.strip() for v in value.split(",")]
                if any(" " in p for p in parts):
                    raise _BadValue("separate the widths with commas, e.g. 64,64")
                value = [p for p in parts if p]
            if not isinstance(value, (list, tuple)):
                raise _BadValue
            return [_int(v, isinstance(v, str) and text) for v in value]
        if kind == "kwargs":
            return _kwargs(value, text)
        if isinstance(value, str):
            return value
        raise _BadValue
    except (_BadValue, TypeError, ValueError, OverflowError) as exc:
        hint = f" ({exc})" if isinstance(exc, _BadValue) and str(exc) else ""
        raise ConfigError(name, f"expected {_EXPECTED[kind]}, got {_show(raw)}{hint}") from None


def _refuse_constant(name: str) -> Any:
    raise _BadValue(f"{name} is not a finite number")


def _kwargs(value: Any, text: bool) -> dict[str, Any]:
    """Env constructor keyword arguments: a dict (as text, a JSON object) of identifier keys and plain values.

    Plain means what both TOML (config.toml, the checkpoint) and JSON can hold and what a checkpoint loads
    without unpickling code: numbers, strings, bools and lists of them. No null (TOML has none: leave the key
    out), no nested tables, no NaN/Infinity (json.loads would otherwise accept them).
    """
    if text:
        try:
            value = json.loads(value, parse_constant=_refuse_constant)
        except json.JSONDecodeError as exc:
            raise _BadValue(f"not valid JSON: {exc.msg} at character {exc.pos}") from None
        except RecursionError:
            raise _BadValue("the JSON is nested too deeply") from None
        if not isinstance(value, dict):
            raise _BadValue(f"the JSON must be an object {{...}}, not a {type(value).__name__}")
    if not isinstance(value, dict):
        raise _BadValue
    out = {}
    for key, item in value.items():
        if not (isinstance(key, str) and key.isidentifier()):
            raise _BadValue(f"key {_show(key)} is not a Python identifier, so it cannot be a keyword argument")
        out[key] = _plain_value(key, item)
    return out


def _plain_value(key: str, value: Any) -> Any:
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if abs(value) > INT_MAX:
            raise _BadValue(f"{key}={_show(value)} does not fit a 64-bit integer (TOML's range)")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _BadValue(f"{key}={_show(value)} is not a finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [_plain_value(key, v) for v in value]
    what = "null has no TOML form; leave the key out" if value is None else f"a {type(value).__name__}"
    raise _BadValue(f"{key} must be a number, string, bool or list, got {_show(value)} ({what})")


def _show(value: Any) -> str:
    """``repr(value)``, shortened: a fuzzed 400-digit number need not fill the terminal."""
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


def list_presets() -> list[str]:
    """Names of the presets shipped with ppokit."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def load_preset(name: str, base: PPOConfig | None = None) -> PPOConfig:
    """The preset ``name`` (a TOML file inside the package) over ``base``."""
    path = PRESETS_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError("preset", f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    return PPOConfig.from_toml(path, base)
