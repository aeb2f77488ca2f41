"""RL-Zoo's published PPO settings (``rl_zoo3/hyperparams/ppo.yml``, ``ppo_lstm.yml``) as ``PPOConfig`` fields.

The YAML files are found through ``importlib.util.find_spec("rl_zoo3")``, which reads the package's location
without importing it (rl_zoo3's ``__init__`` pulls in Stable-Baselines3 and torch wrappers), and parsed with
``yaml.safe_load``; the ``policy_kwargs`` and ``normalize`` strings (``"dict(ortho_init=False, ...)"``) are read
with ``ast`` as literals only (``nn.ReLU`` is taken as the name ``ReLU``), so nothing from the files is executed.

An entry lists only what differs from Stable-Baselines3's ``PPO`` defaults, so the translation starts from those
defaults (``SB3_DEFAULTS``; they differ from ppokit's: 10 epochs, minibatches of 64, a constant learning rate, no
value clipping, no entropy bonus). Each SB3 name maps to ppokit's in ``translate``; what has no counterpart in
ppokit is returned by name in ``ZooSettings.untranslated``, never silently dropped.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppokit.core.errors import ConfigError

__all__ = ["ZooSettings", "zoo_dir", "zoo_settings", "translate", "entry_name", "SB3_DEFAULTS", "ZOO_FILES"]

ZOO_FILES = ("ppo.yml", "ppo_lstm.yml")

# stable_baselines3.PPO.__init__'s defaults for the keys an RL-Zoo entry may leave out (RL-Zoo's n_envs default is
# 1: rl_zoo3/exp_manager.py).
SB3_DEFAULTS: dict[str, Any] = {
    "n_envs": 1, "learning_rate": 3e-4, "n_steps": 2048, "batch_size": 64, "n_epochs": 10, "gamma": 0.99,
    "gae_lambda": 0.95, "clip_range": 0.2, "clip_range_vf": None, "normalize_advantage": True, "ent_coef": 0.0,
    "vf_coef": 0.5, "max_grad_norm": 0.5, "target_kl": None, "normalize": False, "use_sde": False,
}

# SB3 policy names ppokit trains: the observation encoder is picked from the space (policies/build.py).
_POLICIES = ("MlpPolicy", "CnnPolicy", "MultiInputPolicy")
# torch.nn activation classes ppokit's MLPs have (PPOConfig.activation).
_ACTIVATIONS = {"Tanh": "tanh", "ReLU": "relu"}
# One-to-one renames: SB3 name -> PPOConfig field.
_RENAMES = {"n_envs": "num_envs", "n_steps": "num_steps", "n_epochs": "update_epochs", "gamma": "gamma",
            "gae_lambda": "gae_lambda", "ent_coef": "ent_coef", "vf_coef": "vf_coef",
            "max_grad_norm": "max_grad_norm", "target_kl": "target_kl", "normalize_advantage": "norm_adv"}


@dataclass
class ZooSettings:
    """One RL-Zoo entry translated: the config fields, where it came from, and what could not be carried over."""

    file: Path
    entry: str  # the YAML key used: the env id, or "atari" for an Atari id
    raw: dict[str, Any]
    values: dict[str, Any]  # PPOConfig field -> value
    reasons: dict[str, str]  # PPOConfig field -> the SB3 setting it came from
    untranslated: dict[str, str] = field(default_factory=dict)  # SB3 name -> why it has no ppokit counterpart

    @property
    def source(self) -> str:
        """The one-line citation the planner prints: file and entry."""
        return f"RL-Zoo's published PPO settings ({self.file.parent.parent.name}/{self.file.parent.name}/" \
               f"{self.file.name}, entry {self.entry})"


def zoo_dir() -> Path | None:
    """rl_zoo3's ``hyperparams`` folder, found without importing rl_zoo3; None when it is not installed."""
    try:
        spec = importlib.util.find_spec("rl_zoo3")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        folder = Path(location) / "hyperparams"
        if (folder / ZOO_FILES[0]).is_file():
            return folder
    return None


def _load(path: Path) -> dict[str, Any]:
    try:
        import yaml
    except ImportError as exc:  # rl_zoo3 installed with --no-deps and no PyYAML
        raise ConfigError("zoo", "reading RL-Zoo's YAML files needs PyYAML: pip install 'ppokit[zoo]'") from exc
    # safe_load builds plain data only (no tags that construct objects); RL-Zoo's files use only !!float.
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        reason = " ".join(str(exc).split())[:160]
        raise ConfigError("zoo", f"{path} is not plain YAML ({reason})") from exc
    return data if isinstance(data, dict) else {}


def entry_name(env_id: str, entries: dict[str, Any]) -> str | None:
    """The entry RL-Zoo uses for ``env_id``: its own, else ``atari`` for an Atari id (rl_zoo3/exp_manager.py)."""
    if env_id in entries and env_id not in ("default", "atari"):
        return env_id
    if "atari" in entries and any(fnmatch.fnmatchcase(env_id, p) for p in ("ALE/*", "*NoFrameskip-v4")):
        return "atari"
    return None


def zoo_settings(env_id: str, folder: Path | None = None) -> ZooSettings | None:
    """RL-Zoo's PPO entry for ``env_id`` translated (ppo.yml first, then ppo_lstm.yml); None when neither file
    has one. ``folder`` defaults to the installed rl_zoo3's; ``ConfigError`` when it is not installed."""
    folder = folder if folder is not None else zoo_dir()
    if folder is None:
        raise ConfigError("zoo", "--zoo needs RL-Zoo's settings files: pip install 'ppokit[zoo]' (rl_zoo3)")
    for name in ZOO_FILES:
        path = folder / name
        if not path.is_file():
            continue
        entries = _load(path)
        entry = entry_name(env_id, entries)
        if entry is not None:
            raw = entries[entry]
            if not isinstance(raw, dict):
                raise ConfigError("zoo", f"{path} entry {entry!r} is not a mapping of settings")
            return translate(raw, path, entry)
    return None


def _literal(text: str, what: str) -> Any:
    """A ``dict(...)``/``{...}`` string of the YAML as data: literals, and attribute names (``nn.ReLU``) as their
    last part; anything else (a call other than dict, an operator on names) raises ``ValueError``."""

    def conv(node: ast.AST) -> Any:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
            return {kw.arg: conv(kw.value) for kw in node.keywords}
        if isinstance(node, ast.Dict):
            return {conv(k): conv(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, (ast.List, ast.Tuple)):
            return [conv(e) for e in node.elts]
        if isinstance(node, ast.Attribute):
            return node.attr
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -conv(node.operand)
        if isinstance(node, ast.Constant):
            return node.value
        raise ValueError(f"{what}: {ast.dump(node)[:60]} is not a literal")

    return conv(ast.parse(text.strip(), mode="eval").body)


def _schedule(value: Any) -> tuple[float, bool]:
    """``(start, linear)`` of an SB3/RL-Zoo schedule: a number (constant) or ``lin_<start>`` (linear to 0)."""
    if isinstance(value, str) and value.startswith("lin_"):
        return float(value[4:]), True
    return float(value), False


def translate(raw: dict[str, Any], file: Path, entry: str) -> ZooSettings:
    """One RL-Zoo entry (SB3's names) as ``PPOConfig`` fields over SB3's defaults; see the module docstring."""
    s = {**SB3_DEFAULTS, **raw}
    values: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    untranslated: dict[str, str] = {}

    def put(name: str, value: Any, why: str) -> None:
        values[name] = value
        reasons[name] = why

    for sb3, ours in _RENAMES.items():
        put(ours, s[sb3], f"{sb3} = {s[sb3]!r}" + ("" if sb3 in raw else " (SB3's default)"))
    if "n_timesteps" in s:
        put("total_timesteps", int(float(s["n_timesteps"])), f"n_timesteps = {s['n_timesteps']!r}")
    for sb3, ours, anneal in (("learning_rate", "learning_rate", "anneal_lr"), ("clip_range", "clip_coef",
                                                                               "anneal_clip")):
        start, linear = _schedule(s[sb3])
        why = f"{sb3} = {s[sb3]!r}" + ("" if sb3 in raw else " (SB3's default)")
        put(ours, start, why)
        put(anneal, linear, why)
    batch = int(s["n_envs"]) * int(s["n_steps"])
    minibatch = int(s["batch_size"])
    if minibatch >= batch:  # SB3's buffer then yields the whole rollout as one minibatch
        put("num_minibatches", 1, f"batch_size = {minibatch} >= n_envs * n_steps = {batch}: one minibatch")
    elif batch % minibatch == 0:
        put("num_minibatches", batch // minibatch, f"batch_size = {minibatch} (SB3's minibatch size) of "
                                                   f"n_envs * n_steps = {batch}")
    else:
        untranslated["batch_size"] = (f"{minibatch} does not divide n_envs * n_steps = {batch} (SB3 keeps a short "
                                      "last minibatch; ppokit's minibatches are equal)")
    # SB3 clips the value change only when clip_range_vf is set, by its own range; ppokit's clip_vloss uses clip_coef.
    vf_clip = s["clip_range_vf"]
    if vf_clip is None:
        put("clip_vloss", False, "clip_range_vf = None (SB3's default: no value clipping)")
    elif vf_clip == s["clip_range"]:
        put("clip_vloss", True, f"clip_range_vf = {vf_clip!r}, the policy's clip range")
    else:
        untranslated["clip_range_vf"] = f"{vf_clip!r}: ppokit clips the value change by clip_coef only"
    _normalize(s["normalize"], put, untranslated)
    if s.get("use_sde"):
        untranslated["use_sde"] = "gSDE exploration: ppokit's Gaussian policy has a state-independent std"
        if "sde_sample_freq" in raw:
            untranslated["sde_sample_freq"] = f"{raw['sde_sample_freq']!r}: a gSDE setting (see use_sde)"
    for key in ("env_wrapper", "frame_stack", "callback", "vec_env_wrapper", "env_kwargs",
                "monitor_kwargs", "normalize_kwargs", "n_envs_eval"):
        # ppokit's own Atari wrappers (envs/atari.py) are SB3's AtariWrapper with 4 stacked frames.
        if key in raw and not (entry == "atari" and key in ("env_wrapper", "frame_stack")):
            untranslated[key] = f"{raw[key]!r}: not translated (set the env up with --env-kwargs or a wrapper)"
    policy = s.get("policy", "MlpPolicy")
    if policy not in _POLICIES:
        untranslated["policy"] = f"{policy!r}: ppokit trains {', '.join(_POLICIES)} (no recurrent policy)"
    if "policy_kwargs" in raw:
        _policy_kwargs(raw["policy_kwargs"], put, untranslated)
    known = set(SB3_DEFAULTS) | {"n_timesteps", "policy", "policy_kwargs"} | set(untranslated)
    known |= {"sde_sample_freq", "env_wrapper", "frame_stack"}
    for key in raw:
        if key not in known:
            untranslated[key] = f"{raw[key]!r}: no ppokit counterpart"
    return ZooSettings(file, entry, dict(raw), values, reasons, untranslated)


def _normalize(value: Any, put, untranslated: dict[str, str]) -> None:
    """RL-Zoo's ``normalize``: a bool (VecNormalize of observations and rewards) or a dict string of its kwargs."""
    if isinstance(value, str):
        try:
            value = _literal(value, "normalize")
        except (SyntaxError, ValueError) as exc:
            untranslated["normalize"] = f"{value!r}: not a literal ({exc})"
            return
    if isinstance(value, bool):
        obs = reward = value
    elif isinstance(value, dict):
        obs, reward = bool(value.pop("norm_obs", True)), bool(value.pop("norm_reward", True))
        for k, v in value.items():
            untranslated[f"normalize.{k}"] = f"{v!r}: VecNormalize option with no ppokit counterpart"
    else:
        untranslated["normalize"] = f"{value!r}: neither a bool nor a dict"
        return
    put("normalize_obs", obs, f"normalize = {value!r} (VecNormalize: running mean/std of observations)")
    put("normalize_reward", reward, f"normalize = {value!r} (VecNormalize: rewards scaled by the return's std)")


def _policy_kwargs(text: Any, put, untranslated: dict[str, str]) -> None:
    try:
        kwargs = _literal(text, "policy_kwargs") if isinstance(text, str) else text
    except (SyntaxError, ValueError) as exc:
        untranslated["policy_kwargs"] = f"{text!r}: not a literal ({exc})"
        return
    if not isinstance(kwargs, dict):
        untranslated["policy_kwargs"] = f"{text!r}: not a dict"
        return
    for key, value in kwargs.items():
        name = f"policy_kwargs.{key}"
        if key == "net_arch":
            arch = value
            if isinstance(arch, list) and len(arch) == 1 and isinstance(arch[0], dict):
                arch = arch[0]  # SB3 < 1.8 wrote [dict(pi=..., vf=...)]
            if isinstance(arch, dict) and arch.get("pi") == arch.get("vf") and set(arch) <= {"pi", "vf"}:
                arch = arch.get("pi")
            if isinstance(arch, list) and arch and all(isinstance(w, int) and w > 0 for w in arch):
                put("hidden_sizes", list(arch), f"{name} = {value!r}")
            else:
                untranslated[name] = f"{value!r}: ppokit's actor and critic have the same hidden sizes"
        elif key == "activation_fn":
            if value in _ACTIVATIONS:
                put("activation", _ACTIVATIONS[value], f"{name} = nn.{value}")
            else:
                untranslated[name] = f"nn.{value}: ppokit's MLPs use {' or '.join(_ACTIVATIONS)}"
        elif key == "ortho_init" and value is True:
            continue  # ppokit initializes orthogonally, as SB3 does by default
        elif key == "ortho_init":
            untranslated[name] = "False: ppokit always initializes orthogonally (gains sqrt 2, 0.01, 1)"
        elif key == "log_std_init":
            untranslated[name] = f"{value!r}: ppokit's Gaussian policy starts at log std 0"
        else:
            untranslated[name] = f"{value!r}: no ppokit counterpart"
