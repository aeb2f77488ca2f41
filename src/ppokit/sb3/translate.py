"""Stable-Baselines3's PPO arguments as ``PPOConfig`` fields: the one table (``TABLE``) and its translation.

Each ``Row`` names an SB3 argument, the ppokit fields it sets and how (the text docs/sb3.md renders), and converts
a value: ``convert(value, ctx) -> {field: value}``. An argument ppokit has no counterpart for has a row too; its
converter accepts only SB3's default and refuses anything else with ``SB3Error`` naming the argument. SB3's
semantics: stable_baselines3/ppo/ppo.py and common/on_policy_algorithm.py (version 2.x).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["SB3Error", "Row", "TABLE", "POLICY_KWARGS", "translate", "schedule", "markdown_table"]


class SB3Error(ValueError):
    """An SB3 argument ppokit cannot honour: the message names it and says why."""


@dataclass(frozen=True)
class Row:
    sb3: str
    default: Any
    ppokit: str  # the PPOConfig fields it sets ("" when refused)
    how: str  # one line for the docs table
    convert: Callable[[Any, dict], dict]


# Points of progress_remaining (1 at the start of learn, 0 at its end) a schedule is sampled at to recognise it.
_PROBES = (1.0, 0.75, 0.5, 0.25, 0.0)


def schedule(name: str, value: Any) -> tuple[float, bool]:
    """``(start value, linear to 0?)`` of an SB3 number or schedule (a callable of progress_remaining).

    ppokit either keeps a value constant or anneals it linearly to 0 over the run; a callable is sampled at
    ``_PROBES`` and must be one of the two (RL-Zoo's ``lin_X`` is ``X * progress_remaining``)."""
    if not callable(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SB3Error(f"{name}: expected a number or a schedule (a callable of progress_remaining), got "
                           f"{type(value).__name__}")
        return float(value), False
    try:
        points = [float(value(p)) for p in _PROBES]
    except Exception as exc:  # noqa: BLE001 - the user's callable; its failure is one line naming it
        raise SB3Error(f"{name}: the schedule {_callable_name(value)} raised {type(exc).__name__}: {exc}") from None
    start = points[0]
    if all(math.isclose(v, start, rel_tol=1e-9, abs_tol=1e-12) for v in points):
        return start, False
    if all(math.isclose(v, start * p, rel_tol=1e-6, abs_tol=1e-12) for v, p in zip(points, _PROBES)):
        return start, True
    shown = ", ".join(f"{v:g}" for v in points)
    raise SB3Error(f"{name}: the schedule {_callable_name(value)} is neither constant nor linear to 0 (values {shown} "
                   f"at progress_remaining {', '.join(map(str, _PROBES))}); ppokit keeps {name} constant or anneals "
                   "it linearly to 0")


def _callable_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _only_default(name: str, default: Any, why: str) -> Callable[[Any, dict], dict]:
    def convert(value: Any, ctx: dict) -> dict:
        if value != default:
            raise SB3Error(f"{name}={value!r}: {why}")
        return {}
    return convert


def _same(field: str) -> Callable[[Any, dict], dict]:
    return lambda value, ctx: {field: value}


def _learning_rate(value: Any, ctx: dict) -> dict:
    lr, linear = schedule("learning_rate", value)
    return {"learning_rate": lr, "anneal_lr": linear}


def _clip_range(value: Any, ctx: dict) -> dict:
    clip, linear = schedule("clip_range", value)
    ctx["clip"] = (clip, linear)
    return {"clip_coef": clip, "anneal_clip": linear}


def _clip_range_vf(value: Any, ctx: dict) -> dict:
    if value is None:
        return {"clip_vloss": False}
    if schedule("clip_range_vf", value) != ctx["clip"]:
        raise SB3Error(f"clip_range_vf={value!r}: ppokit clips the value change by the policy's clip range only "
                       "(clip_vloss); pass clip_range_vf equal to clip_range, or None")
    return {"clip_vloss": True}


def _batch_size(value: Any, ctx: dict) -> dict:
    rollout = ctx["n_steps"] * ctx["n_envs"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SB3Error(f"batch_size: expected a positive integer, got {value!r}")
    if rollout % value:
        raise SB3Error(f"batch_size={value} does not divide n_steps * n_envs = {ctx['n_steps']} * {ctx['n_envs']} = "
                       f"{rollout}: ppokit splits each rollout into num_minibatches equal minibatches")
    return {"num_minibatches": rollout // value}


def _vf_coef(value: Any, ctx: dict) -> dict:
    # SB3's value loss is mean((R - V)^2), ppokit's (CleanRL's) 0.5 * mean((R - V)^2): the same gradient needs twice
    # the coefficient.
    return {"vf_coef": 2.0 * value}


def _tensorboard_log(value: Any, ctx: dict) -> dict:
    return {"tensorboard": value is not None}


def _verbose(value: Any, ctx: dict) -> dict:
    return {}  # read by PPO itself: the console is on for verbose >= 1


def _seed(value: Any, ctx: dict) -> dict:
    if value is None:
        import secrets

        value = secrets.randbelow(2**31)  # SB3 leaves an unseeded run random
    return {"seed": value}


def _device(value: Any, ctx: dict) -> dict:
    text = str(value)
    if text == "auto":
        import torch

        text = "cuda" if torch.cuda.is_available() else "cpu"
    return {"device": text}


def _policy_kwargs(value: Any, ctx: dict) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SB3Error(f"policy_kwargs: expected a dict, got {type(value).__name__}")
    out: dict = {}
    for key, item in value.items():
        row = POLICY_KWARGS.get(key)
        if row is None:
            raise SB3Error(f"policy_kwargs[{key!r}]: ppokit has no counterpart (it accepts "
                           f"{', '.join(POLICY_KWARGS)})")
        out.update(row.convert(item, ctx))
    return out


def _net_arch(value: Any, ctx: dict) -> dict:
    if isinstance(value, dict):
        pi, vf = value.get("pi"), value.get("vf")
        if set(value) - {"pi", "vf"} or pi != vf:
            raise SB3Error(f"policy_kwargs['net_arch']={value!r}: ppokit's actor and critic have the same hidden "
                           "sizes; give one list, or dict(pi=L, vf=L) with the same L")
        value = pi
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        raise SB3Error(f"policy_kwargs['net_arch']={value!r}: expected a list of layer widths")
    return {"hidden_sizes": list(value)}


def _activation_fn(value: Any, ctx: dict) -> dict:
    name = getattr(value, "__name__", type(value).__name__)
    known = {"Tanh": "tanh", "ReLU": "relu"}
    if name not in known:
        raise SB3Error(f"policy_kwargs['activation_fn']={name}: ppokit has {', '.join(f'nn.{k}' for k in known)}")
    return {"activation": known[name]}


POLICY_KWARGS = {
    "net_arch": Row("net_arch", None, "hidden_sizes", "a list, or dict(pi=L, vf=L) with equal lists (separate actor "
                    "and critic MLPs, as SB3's MlpPolicy)", _net_arch),
    "activation_fn": Row("activation_fn", "nn.Tanh", "activation", "nn.Tanh -> tanh, nn.ReLU -> relu",
                         _activation_fn),
    "ortho_init": Row("ortho_init", True, "", "True only: ppokit always initialises orthogonally (gains sqrt 2, "
                      "0.01 policy head, 1 value head, as SB3)",
                      _only_default("policy_kwargs['ortho_init']", True, "ppokit always initialises orthogonally")),
    "log_std_init": Row("log_std_init", 0.0, "", "0.0 only: ppokit's Gaussian log_std starts at 0",
                        _only_default("policy_kwargs['log_std_init']", 0.0, "ppokit's Gaussian log_std starts at 0")),
}

def _lstm_only(key: str, convert: Callable[[Any], dict]) -> Callable[[Any, dict], dict]:
    """A ``policy_kwargs`` key sb3-contrib's RecurrentPPO takes: converted for an LSTM policy, refused otherwise."""
    def conv(value: Any, ctx: dict) -> dict:
        if not ctx.get("recurrent"):
            raise SB3Error(f"policy_kwargs[{key!r}]: an LSTM policy's option; use ppokit.sb3.RecurrentPPO with "
                           "MlpLstmPolicy, CnnLstmPolicy or MultiInputLstmPolicy")
        return convert(value)
    return conv


def _lstm_hidden(value: Any) -> dict:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SB3Error(f"policy_kwargs['lstm_hidden_size']={value!r}: expected a positive integer")
    return {"recurrent_hidden": value}


def _critic_lstm(value: Any) -> dict:
    if value is not True:
        raise SB3Error(f"policy_kwargs['enable_critic_lstm']={value!r}: True only (ppokit's critic always has a "
                       "recurrent core: its own, or the actor's with shared_lstm=True)")
    return {}


def _one_layer(value: Any) -> dict:
    if value != 1:
        raise SB3Error(f"policy_kwargs['n_lstm_layers']={value!r}: 1 only (ppokit's recurrent core has one layer)")
    return {}


POLICY_KWARGS.update({
    "lstm_hidden_size": Row("lstm_hidden_size", 256, "recurrent_hidden", "the same (RecurrentPPO only)",
                            _lstm_only("lstm_hidden_size", _lstm_hidden)),
    "shared_lstm": Row("shared_lstm", False, "recurrent_critic", "False: separate (the critic's own LSTM); True: "
                       "shared (RecurrentPPO only)",
                       _lstm_only("shared_lstm", lambda v: {"recurrent_critic": "shared" if v else "separate"})),
    "enable_critic_lstm": Row("enable_critic_lstm", True, "", "True only (RecurrentPPO only)",
                              _lstm_only("enable_critic_lstm", _critic_lstm)),
    "n_lstm_layers": Row("n_lstm_layers", 1, "", "1 only (RecurrentPPO only)", _lstm_only("n_lstm_layers", _one_layer)),
})

_SDE = "ppokit has no state-dependent exploration (gSDE)"

# SB3's PPO.__init__ arguments in its order, after ``policy`` and ``env`` (PPO handles those two itself).
TABLE = [
    Row("learning_rate", 3e-4, "learning_rate, anneal_lr", "a number: constant; a schedule: must be linear to 0 "
        "(RL-Zoo's lin_X), anneal_lr", _learning_rate),
    Row("n_steps", 2048, "num_steps", "the same", _same("num_steps")),
    Row("batch_size", 64, "num_minibatches", "SB3's is a minibatch size: num_minibatches = n_steps * n_envs / "
        "batch_size (must divide)", _batch_size),
    Row("n_epochs", 10, "update_epochs", "the same", _same("update_epochs")),
    Row("gamma", 0.99, "gamma", "the same", _same("gamma")),
    Row("gae_lambda", 0.95, "gae_lambda", "the same", _same("gae_lambda")),
    Row("clip_range", 0.2, "clip_coef, anneal_clip", "as learning_rate", _clip_range),
    Row("clip_range_vf", None, "clip_vloss", "None: off; equal to clip_range: on (PPO2's max of clipped and "
        "unclipped loss; SB3 takes the clipped one)", _clip_range_vf),
    Row("normalize_advantage", True, "norm_adv", "the same (per minibatch)", _same("norm_adv")),
    Row("ent_coef", 0.0, "ent_coef", "the same (ppokit's own default is 0.01)", _same("ent_coef")),
    Row("vf_coef", 0.5, "vf_coef", "doubled: ppokit's value loss is 0.5 * mean((R - V)^2), SB3's mean((R - V)^2)",
        _vf_coef),
    Row("max_grad_norm", 0.5, "max_grad_norm", "the same", _same("max_grad_norm")),
    Row("use_sde", False, "", f"False only: {_SDE}", _only_default("use_sde", False, _SDE)),
    Row("sde_sample_freq", -1, "", f"-1 only: {_SDE}", _only_default("sde_sample_freq", -1, _SDE)),
    Row("rollout_buffer_class", None, "", "None only: ppokit's rollout buffer is its own",
        _only_default("rollout_buffer_class", None, "ppokit's rollout buffer is its own")),
    Row("rollout_buffer_kwargs", None, "", "None only", _only_default("rollout_buffer_kwargs", None,
                                                                     "ppokit's rollout buffer is its own")),
    Row("target_kl", None, "target_kl", "the same (epochs stop at approx KL > 1.5 * target_kl, as SB3)",
        _same("target_kl")),
    Row("stats_window_size", 100, "", "100 only: ppokit logs each update's finished episodes",
        _only_default("stats_window_size", 100, "ppokit logs the mean of each update's finished episodes")),
    Row("tensorboard_log", None, "tensorboard (and the run dir)", "a directory: the run writes "
        "DIR/<tb_log_name>_<i> (metrics.csv, TensorBoard, checkpoint); None: a temporary run dir, no TensorBoard",
        _tensorboard_log),
    Row("policy_kwargs", None, "hidden_sizes, activation", "the keys of the next table; any other key is refused",
        _policy_kwargs),
    Row("verbose", 0, "(console)", "0: silent; 1 or more: ppokit's console (metrics table, alerts)", _verbose),
    Row("seed", None, "seed", "the same; None: a random seed", _seed),
    Row("device", "auto", "device", "auto: cuda when available, else cpu", _device),
    Row("_init_setup_model", True, "", "True only", _only_default("_init_setup_model", True,
                                                                 "ppokit builds the model at once")),
]


def translate(kwargs: dict, n_envs: int, recurrent: bool = False) -> dict:
    """PPOConfig fields for SB3's ``kwargs`` (every ``TABLE`` argument, given or default) with ``n_envs``;
    ``recurrent``: sb3-contrib's RecurrentPPO (an LSTM policy, ``recurrent = "lstm"``)."""
    ctx: dict = {"n_envs": n_envs, "n_steps": kwargs["n_steps"], "recurrent": recurrent}
    fields: dict = {}
    for row in TABLE:
        fields.update(row.convert(kwargs[row.sb3], ctx))
    if recurrent:
        fields["recurrent"] = "lstm"
    return fields


def sb3_name(field: str) -> str | None:
    """The SB3 argument that sets ppokit's ``field`` (for error messages), else None."""
    for row in (*TABLE, *POLICY_KWARGS.values()):
        if field in [f.strip() for f in row.ppokit.split(",")]:
            return row.sb3
    return None


def markdown_table() -> str:
    """docs/sb3.md's two tables, from ``TABLE`` and ``POLICY_KWARGS``."""
    def lines(rows: list[Row], head: str) -> list[str]:
        out = [f"| {head} | SB3 default | ppokit field | how |", "|---|---|---|---|"]
        for r in rows:
            out.append(f"| `{r.sb3}` | `{r.default!r}` | {r.ppokit or 'refused unless default'} | {r.how} |")
        return out

    return "\n".join([*lines(TABLE, "PPO argument"), "", *lines(list(POLICY_KWARGS.values()), "policy_kwargs key")])
