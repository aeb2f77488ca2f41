"""``PPOConfig``: the single source of truth for a run.

The CLI flags, TOML files, presets, the planner and checkpoints all read and write this one dataclass. Field
names follow CleanRL's ``ppo.py``; each field's ``help`` becomes its ``--help`` line. Validation lives here and
runs before any environment is created: an invalid value raises ``ConfigError`` naming the field and the reason.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["PPOConfig", "ConfigError", "PRESETS_DIR", "list_presets", "load_preset", "SAFE_LIMITS"]

PRESETS_DIR = Path(__file__).parent / "presets"

ALGOS = ("ppo", "ppo-kl", "a2c")
ACTIVATIONS = ("tanh", "relu")
VECTOR_MODES = ("sync", "async", "native", "envpool")

# The trust-region guard rails from the PPO lessons: beyond these a run is refused unless marked unsafe.
SAFE_LIMITS = {"update_epochs": 30, "clip_coef": 0.3}


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and says what to do."""

    def __init__(self, field_name: str, reason: str):
        self.field = field_name
        self.reason = reason
        super().__init__(f"config field '{field_name}': {reason}")


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: list(d) if isinstance(d, list) else dict(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class PPOConfig:
    """Every knob of a PPO run. Derived sizes are properties and never stored."""

    # --- environment ---
    env_id: str = _f("CartPole-v1", "Gymnasium environment id (any registered id, e.g. CartPole-v1, ppokit/GridWorld-v0)")
    num_envs: int = _f(4, "number of parallel environments N")
    vector_mode: str = _f("sync", "vectorization: sync (one process), async (subprocesses), native (the env's "
                          "batched version) or envpool (the optional envpool package)")
    normalize_obs: bool = _f(False, "normalize observations by a running mean/std (clipped to +-10)")
    normalize_reward: bool = _f(False, "scale rewards by the running std of the discounted return (clipped to +-10)")
    # --- rollout and schedule ---
    num_steps: int = _f(128, "steps T per environment per rollout (batch = num_envs * num_steps)")
    total_timesteps: int = _f(500_000, "total environment steps of the run")
    learning_rate: float = _f(2.5e-4, "Adam learning rate")
    anneal_lr: bool = _f(True, "decay the learning rate linearly to 0 over the run")
    anneal_clip: bool = _f(False, "decay clip_coef linearly to 0 over the run (RL-Zoo's 'lin_' clip)")
    # --- advantages ---
    gamma: float = _f(0.99, "discount factor, in (0, 1]")
    gae_lambda: float = _f(0.95, "GAE lambda, in [0, 1]")
    norm_adv: bool = _f(True, "normalize advantages per minibatch (zero mean, unit std)")
    # --- update ---
    algo: str = _f("ppo", "objective: ppo (clipped surrogate), ppo-kl (adaptive KL penalty) or a2c (one step per rollout)")
    num_minibatches: int = _f(4, "minibatches per epoch (must divide num_envs * num_steps)")
    update_epochs: int = _f(4, "epochs K over each rollout")
    clip_coef: float = _f(0.2, "clip range eps of the surrogate objective")
    clip_vloss: bool = _f(True, "clip the value change to +-clip_coef as in PPO2")
    ent_coef: float = _f(0.01, "entropy bonus coefficient c_e")
    vf_coef: float = _f(0.5, "value loss coefficient c_v")
    max_grad_norm: float = _f(0.5, "global gradient-norm clip")
    target_kl: float | None = _f(None, "stop the update's epochs when approx KL > 1.5 * target_kl (none: never)")
    init_kl_beta: float = _f(1.0, "ppo-kl: initial KL penalty coefficient beta")
    kl_target: float = _f(0.01, "ppo-kl: target KL of the adaptive penalty (beta x2 above 2x, /2 below 1/2x)")
    # --- network ---
    hidden_sizes: list[int] = _f([64, 64], "hidden layer widths of the actor and critic MLPs, e.g. 64,64")
    activation: str = _f("tanh", "hidden activation: tanh or relu")
    # --- monitoring (guard rails require both) ---
    monitor_kl: bool = _f(True, "monitor approx KL every update (required unless --unsafe)")
    monitor_clipfrac: bool = _f(True, "monitor the clip fraction every update (required unless --unsafe)")
    unsafe: bool = _f(False, "allow configs outside the safe trust region; the run is stamped unsafe")
    # --- system ---
    seed: int = _f(1, "random seed")
    device: str = _f("cpu", "torch device: cpu, cuda, cuda:0, ...")
    torch_threads: int = _f(1, "torch intra-op threads (1 is fastest for small networks)")
    fused_update: bool = _f(True, "use the fused MLP update path where it applies (autograd otherwise)")
    run_dir: str | None = _f(None, "run directory (default: runs/<env>__<seed>__<time>)")
    log_every: int = _f(10, "print a metrics table every this many updates")
    save_every: int = _f(50, "write a checkpoint every this many updates (and at the end)")
    tensorboard: bool = _f(True, "write TensorBoard event files")
    # --- evaluation gate (optional early stop once solved) ---
    eval_every: int = _f(0, "every this many updates, evaluate the deterministic policy on a separate env and stop "
                            "once its mean return reaches eval_threshold (0: never evaluate)")
    eval_threshold: float | None = _f(None, "mean deterministic evaluation return that ends the run (needs eval_every)")
    eval_episodes: int = _f(16, "episodes per evaluation, run in parallel (one per env of a vectorized env)")

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
        """Raise ``ConfigError`` for the first invalid field; return self when valid."""
        def need(ok: bool, name: str, reason: str) -> None:
            if not ok:
                raise ConfigError(name, reason)

        for name in ("num_envs", "num_steps", "total_timesteps", "num_minibatches", "update_epochs",
                     "torch_threads", "log_every", "save_every"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                 f"must be a positive integer, got {value!r}")
        for name in ("learning_rate", "clip_coef", "ent_coef", "vf_coef", "max_grad_norm", "gamma", "gae_lambda",
                     "init_kl_beta", "kl_target"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), name,
                 f"must be a finite number, got {value!r}")
        need(self.learning_rate >= 0, "learning_rate", f"must be >= 0, got {self.learning_rate}")
        need(0 < self.gamma <= 1, "gamma", f"must be in (0, 1], got {self.gamma}")
        need(0 <= self.gae_lambda <= 1, "gae_lambda", f"must be in [0, 1], got {self.gae_lambda}")
        need(self.clip_coef > 0, "clip_coef", f"must be > 0, got {self.clip_coef}")
        need(self.ent_coef >= 0, "ent_coef", f"must be >= 0, got {self.ent_coef}")
        need(self.vf_coef >= 0, "vf_coef", f"must be >= 0, got {self.vf_coef}")
        need(self.max_grad_norm > 0, "max_grad_norm", f"must be > 0, got {self.max_grad_norm}")
        need(self.init_kl_beta > 0, "init_kl_beta", f"must be > 0, got {self.init_kl_beta}")
        need(self.kl_target > 0, "kl_target", f"must be > 0, got {self.kl_target}")
        need(isinstance(self.eval_every, int) and not isinstance(self.eval_every, bool) and self.eval_every >= 0,
             "eval_every", f"must be an integer >= 0 (0 turns the evaluation gate off), got {self.eval_every!r}")
        need(isinstance(self.eval_episodes, int) and not isinstance(self.eval_episodes, bool)
             and self.eval_episodes >= 1, "eval_episodes", f"must be a positive integer, got {self.eval_episodes!r}")
        if self.eval_threshold is not None:
            need(isinstance(self.eval_threshold, (int, float)) and not isinstance(self.eval_threshold, bool)
                 and math.isfinite(self.eval_threshold), "eval_threshold",
                 f"must be a finite number or none, got {self.eval_threshold!r}")
        need(self.eval_every == 0 or self.eval_threshold is not None, "eval_threshold",
             "must be set when eval_every > 0 (the return at which the evaluation gate stops training)")
        if self.target_kl is not None:
            need(isinstance(self.target_kl, (int, float)) and self.target_kl > 0, "target_kl",
                 f"must be > 0 or none, got {self.target_kl!r}")
        need(self.batch_size % self.num_minibatches == 0, "num_minibatches",
             f"{self.num_minibatches} does not divide the batch num_envs * num_steps = {self.batch_size}; "
             f"choose a divisor of {self.batch_size}")
        need(self.algo in ALGOS, "algo", f"must be one of {', '.join(ALGOS)}, got {self.algo!r}")
        need(self.activation in ACTIVATIONS, "activation", f"must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        need(self.vector_mode in VECTOR_MODES, "vector_mode",
             f"must be one of {', '.join(VECTOR_MODES)}, got {self.vector_mode!r}")
        need(isinstance(self.hidden_sizes, list) and len(self.hidden_sizes) >= 1
             and all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in self.hidden_sizes),
             "hidden_sizes", f"must be a non-empty list of positive integers, got {self.hidden_sizes!r}")
        need(isinstance(self.env_id, str) and self.env_id != "", "env_id", "must be a non-empty environment id")
        need(isinstance(self.device, str) and (self.device == "cpu" or self.device.startswith("cuda")
                                              or self.device == "mps"),
             "device", f"must be cpu, cuda[:N] or mps, got {self.device!r}")
        if not self.unsafe:
            self._check_guard_rails()
        return self

    def guard_rail_violations(self) -> list[tuple[str, str]]:
        """The (field, reason) pairs of every trust-region guard rail this config breaks."""
        out = []
        if self.update_epochs > SAFE_LIMITS["update_epochs"]:
            out.append(("update_epochs", f"{self.update_epochs} epochs is an unsafe trust region: K must be <= "
                        f"{SAFE_LIMITS['update_epochs']} (the policy drifts too far from pi_old); safe range 1-30, "
                        "typical 3-10"))
        if self.algo == "ppo" and self.clip_coef > SAFE_LIMITS["clip_coef"]:
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
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), list) else v) for f in dataclasses.fields(self)}

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of every config field, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: dict[str, Any], base: "PPOConfig | None" = None) -> "PPOConfig":
        """A config from ``data`` over ``base`` (or the defaults); unknown keys raise ``ConfigError``."""
        values = (base or cls()).to_dict()
        known = set(values)
        for key, value in data.items():
            name = key.replace("-", "_")
            if name == "env":
                name = "env_id"
            if name not in known:
                import difflib

                close = difflib.get_close_matches(name, sorted(known), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ConfigError(name, f"unknown config field{hint}")
            values[name] = _coerce(name, value)
        return cls(**values)

    @classmethod
    def from_toml(cls, path: str | Path, base: "PPOConfig | None" = None) -> "PPOConfig":
        """Load a TOML file (flat keys, or under a ``[ppo]`` table) over ``base``."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError("config", f"no TOML file at {path}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{path} is not valid TOML: {exc}") from exc
        if "ppo" in data and isinstance(data["ppo"], dict):
            data = data["ppo"]
        return cls.from_dict(data, base)

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
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


_FIELD_TYPES: dict[str, str] = {}


def _field_kind(name: str) -> str:
    if not _FIELD_TYPES:
        for f in dataclasses.fields(PPOConfig):
            t = str(f.type)
            kind = ("bool" if t == "bool" else "int" if t == "int" else "float" if t == "float"
                    else "optfloat" if t.startswith("float |") else "intlist" if t.startswith("list")
                    else "optstr" if t.startswith("str |") else "str")
            _FIELD_TYPES[f.name] = kind
    return _FIELD_TYPES[name]


def _coerce(name: str, value: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise ConfigError."""
    kind = _field_kind(name)
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            raise ValueError
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind == "optfloat":
            if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
                return None
            return float(value)
        if kind == "optstr":
            if value is None or (isinstance(value, str) and value.lower() in ("none", "")):
                return None
            return str(value)
        if kind == "intlist":
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            return [int(v) for v in value]
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(name, f"expected {kind.replace('opt', 'optional ').replace('intlist', 'list of ints')}, "
                                f"got {value!r}") from None


def list_presets() -> list[str]:
    """Names of the presets shipped with ppokit."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def load_preset(name: str, base: PPOConfig | None = None) -> PPOConfig:
    """The preset ``name`` (a TOML file inside the package) over ``base``."""
    path = PRESETS_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError("preset", f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    return PPOConfig.from_toml(path, base)
