"""Capture and restore the internal state of in-process vector environments, in checkpoint-safe form.

A resumed run only continues *exactly* like the uninterrupted one if the environments continue from where they
stopped. Gymnasium environments are not serializable in general and pickling them would let a checkpoint run
code, so this walks each environment's wrapper chain and records only plain data attributes: numbers, strings,
numpy arrays (stored as tensors) and numpy ``Generator`` states (stored as their bit-generator state dict).
That covers the classic-control and toy environments whose whole state is such data; environments living in
other processes (``async``) cannot be captured, and resume then continues from freshly reset environments.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["capture_env_state", "restore_env_state"]

_PRIMITIVES = (bool, int, float, str, type(None))


def _chain(env: Any) -> list[Any]:
    """The env, then every wrapped env below it, down to the unwrapped one."""
    out, seen = [], set()
    while env is not None and id(env) not in seen:
        seen.add(id(env))
        out.append(env)
        env = getattr(env, "env", None)
    return out


def _encode(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, _PRIMITIVES):
        return {"t": "py", "v": value}
    if isinstance(value, np.ndarray) and value.dtype != object:
        return {"t": "nd", "v": torch.from_numpy(np.array(value, copy=True)), "dtype": str(value.dtype)}
    if isinstance(value, np.random.Generator):
        return {"t": "rng", "v": _plain(value.bit_generator.state)}
    if isinstance(value, (list, tuple)) and all(isinstance(v, _PRIMITIVES) for v in value):
        return {"t": "list" if isinstance(value, list) else "tuple", "v": list(value)}
    return None


def _plain(d: Any) -> Any:
    """Bit-generator state dicts hold Python ints and numpy arrays; make them weights_only-safe."""
    if isinstance(d, dict):
        return {k: _plain(v) for k, v in d.items()}
    if isinstance(d, np.ndarray):
        return d.tolist()
    if isinstance(d, np.generic):
        return d.item()
    return d


def _decode(enc: dict, current: Any) -> Any:
    kind = enc["t"]
    if kind == "py":
        return enc["v"]
    if kind == "nd":
        return enc["v"].numpy().astype(enc["dtype"], copy=True)
    if kind == "rng":
        rng = current if isinstance(current, np.random.Generator) else np.random.Generator(np.random.PCG64())
        state = dict(enc["v"])
        rng.bit_generator.state = state
        return rng
    if kind == "tuple":
        return tuple(enc["v"])
    return list(enc["v"])


def _capture_obj(obj: Any) -> dict:
    out = {}
    for name, value in vars(obj).items():
        if name in ("env", "metadata", "spec", "render_mode"):
            continue
        enc = _encode(value)
        if enc is not None:
            out[name] = enc
    return out


def capture_env_state(vec_env: Any) -> dict | None:
    """Plain-data state of a sync or natively batched vector env (``None`` when it lives in subprocesses or C++)."""
    from gymnasium.vector import AsyncVectorEnv

    chain = _chain(vec_env)
    if any(isinstance(e, AsyncVectorEnv) or getattr(e, "state_capturable", True) is False for e in chain):
        return None
    state = {"vector": [_capture_obj(e) for e in chain], "envs": []}
    base = chain[-1]
    for sub in getattr(base, "envs", []) or []:
        state["envs"].append([_capture_obj(e) for e in _chain(sub)])
    return state


def _restore_obj(obj: Any, saved: dict) -> None:
    for name, enc in saved.items():
        setattr(obj, name, _decode(enc, getattr(obj, name, None)))


def restore_env_state(vec_env: Any, state: dict | None) -> bool:
    """Restore what ``capture_env_state`` took; returns False when there was nothing to restore."""
    if not state:
        return False
    chain = _chain(vec_env)
    if len(chain) != len(state["vector"]):
        raise ValueError("environment wrapper chain differs from the checkpoint's; cannot restore its state")
    for obj, saved in zip(chain, state["vector"]):
        _restore_obj(obj, saved)
    subs = getattr(chain[-1], "envs", []) or []
    if len(subs) != len(state["envs"]):
        raise ValueError("number of environments differs from the checkpoint's")
    for sub, saved_chain in zip(subs, state["envs"]):
        for obj, saved in zip(_chain(sub), saved_chain):
            _restore_obj(obj, saved)
    return True
