"""A trained policy out of Python: ONNX and TorchScript graphs of the deterministic policy, and a one-file archive.

The graphs map a float32 ``[batch, obs_dim]`` observation (flattened) to the action the env takes: the frozen
observation normalization of the run (float64, clipped, as ``rollout.normalize.ObsNormalizer`` computes it), the
actor, then argmax for Discrete (``int64 [batch]``), per-part argmax for MultiDiscrete (``int64 [batch, k]``) or
the mean clipped to the action bounds for Box (``float32 [batch, D]``): what ``Agent.act(obs, deterministic=True)``
returns, so ``ppokit eval``'s actions. The archive is a ppokit checkpoint (``torch.load(weights_only=True)``: no
code runs on load) with what acting needs (config, weights, normalizer statistics, spaces) and a model card;
``ppokit.load`` and ``ppokit eval`` read it.
"""

from __future__ import annotations

import csv
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ppokit.runtime import checkpoint as ckpt

__all__ = ["FORMATS", "ExportError", "DeployedPolicy", "deployed_policy", "export", "MODEL_CARD_KEY"]

FORMATS = ("onnx", "torchscript", "archive")
MODEL_CARD_KEY = "model_card"
# The checkpoint entries an archive keeps: what ppokit.load reads to act (no optimizer, RNG or env buffers).
_ARCHIVE_KEYS = ("config", "policy_spec", "policy", "obs_norm", "spaces", "custom_env", "global_step", "update")


class ExportError(ValueError):
    """What cannot be exported, in one line naming it."""


class DeployedPolicy(nn.Module):
    """observation -> env action, with the run's normalization folded in (see the module docstring)."""

    def __init__(self, actor: nn.Module, kind: str, action_dims: list[int], obs_norm: Any = None,
                 low: Any = None, high: Any = None):
        super().__init__()
        self.actor, self.kind, self.action_dims = actor, kind, list(action_dims)
        self.normalize = obs_norm is not None
        if obs_norm is not None:
            self.register_buffer("mean", obs_norm.rms.mean.detach().to(torch.float64).cpu().clone())
            self.register_buffer("denom", torch.sqrt(obs_norm.rms.var.detach().to(torch.float64).cpu() + obs_norm.eps))
            self.clip = float(obs_norm.clip)
        self.bounded = kind == "continuous" and low is not None
        if self.bounded:
            self.register_buffer("low", torch.as_tensor(low, dtype=torch.float32).reshape(-1).clone())
            self.register_buffer("high", torch.as_tensor(high, dtype=torch.float32).reshape(-1).clone())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs
        if self.normalize:
            x = ((obs.to(torch.float64) - self.mean) / self.denom).clamp(-self.clip, self.clip).to(torch.float32)
        head = self.actor(x)
        if self.kind == "discrete":
            return head.argmax(-1)
        if self.kind == "multidiscrete":
            return torch.stack([c.argmax(-1) for c in torch.split(head, self.action_dims, dim=-1)], -1)
        if self.bounded:
            return torch.maximum(torch.minimum(head, self.high), self.low)
        return head


def deployed_policy(agent: Any) -> DeployedPolicy:
    """The ``DeployedPolicy`` of a loaded ``Agent`` (a copy on the CPU: the agent is left as it is)."""
    import copy

    from ppokit.envs.encoders import BoxEncoder

    policy = agent.policy
    if agent.stateful:
        raise ExportError("export: this policy keeps a state between steps (recurrent); export supports "
                          "feed-forward policies")
    if not isinstance(agent.encoder, BoxEncoder) or not hasattr(policy, "actor"):
        raise ExportError(f"export: the policy's observations are {getattr(agent.encoder, 'what', 'structured')}; "
                          "export supports flat Box observations (a float vector)")
    actor = copy.deepcopy(policy.actor).cpu().eval().requires_grad_(False)  # a graph for inference only
    return DeployedPolicy(actor, policy.kind, policy.action_dims, agent.obs_norm, agent.action_low,
                          agent.action_high).eval()


def export(run: str | Path, fmt: str, out: str | Path, checkpoint: str | Path | None = None) -> dict[str, Any]:
    """Write ``run``'s policy (a run dir or a checkpoint file; ``checkpoint`` another file of the run, e.g.
    best.pt) as ``fmt`` to ``out``; returns what was written (``{"path", "format", "obs_dim", ...}``)."""
    from ppokit.training.agent import load

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    source = Path(checkpoint) if checkpoint is not None else Path(run)
    out = Path(out)
    agent = load(source)
    if fmt == "archive":
        return _archive(source, Path(run), agent, out)
    module = deployed_policy(agent)
    example = torch.zeros(2, agent.policy.obs_dim)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # torch >= 2.9 defaults to the torch.export-based ONNX exporter, which needs onnxscript; the legacy
            # exporter it warns about handles this graph (linear layers, tanh/relu, argmax, clamp) without it.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            if fmt == "onnx":
                _require("onnx")
                torch.onnx.export(module, example, str(tmp), input_names=["obs"], output_names=["action"],
                                  dynamic_axes={"obs": {0: "batch"}, "action": {0: "batch"}}, dynamo=False)
            else:
                torch.jit.trace(module, example).save(str(tmp))
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"path": out, "format": fmt, "obs_dim": agent.policy.obs_dim, "kind": agent.policy.kind,
            "normalized": module.normalize}


def _require(module: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ExportError(f"--format onnx needs the {module} package: pip install 'ppokit[export]'")


def _archive(source: Path, run: Path, agent: Any, out: Path) -> dict[str, Any]:
    path = source / ckpt.CHECKPOINT_NAME if source.is_dir() else source
    state = ckpt.load_checkpoint(path, require_finite=("policy", "obs_norm"), require_bounded=ckpt.BOUNDED_KEYS)
    card = model_card(state, run if run.is_dir() else run.parent)
    kept = {k: state[k] for k in _ARCHIVE_KEYS if k in state}
    ckpt.save_checkpoint(out, {**kept, MODEL_CARD_KEY: card}, finite=("policy", "obs_norm"),
                         bounded=ckpt.BOUNDED_KEYS)
    return {"path": out, "format": "archive", "card": card}


def model_card(state: dict, run_dir: Path) -> dict[str, Any]:
    """env, returns (the last training episodes' and the evaluation gate's, from metrics.csv) and settings."""
    from ppokit._version import __version__

    config = state.get("config") or {}
    card: dict[str, Any] = {"env_id": str(config.get("env_id")), "global_step": int(state.get("global_step", 0)),
                            "ppokit_version": __version__, "exported": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    train_ret, eval_ret = _returns(run_dir / "metrics.csv")
    if train_ret is not None:
        card["train_return"] = train_ret  # mean over the last 10 updates that finished episodes
    if eval_ret is not None:
        card["eval_return"] = eval_ret  # the best deterministic evaluation of the gate (eval_every)
    settings = ("algo", "num_envs", "num_steps", "total_timesteps", "learning_rate", "gamma", "gae_lambda",
                "num_minibatches", "update_epochs", "clip_coef", "ent_coef", "vf_coef", "hidden_sizes", "activation",
                "normalize_obs", "normalize_reward", "seed")
    card["settings"] = {k: config[k] for k in settings if k in config}
    return card


def _returns(metrics: Path) -> tuple[float | None, float | None]:
    from ppokit.core import schema as S

    if not metrics.is_file():
        return None, None
    train, evals = [], []
    with open(metrics, newline="") as f:
        for row in csv.DictReader(f):
            for key, into in ((S.EPISODIC_RETURN, train), (S.EVAL_RETURN, evals)):
                try:
                    value = float(row.get(key) or "nan")
                except ValueError:
                    continue
                if math.isfinite(value):
                    into.append(value)
    return (sum(train[-10:]) / len(train[-10:]) if train else None), (max(evals) if evals else None)
