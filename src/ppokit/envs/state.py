"""Capture and restore the internal state of in-process vector environments, in checkpoint-safe form.

A resumed run only continues *exactly* like the uninterrupted one if the environments continue from where they
stopped. Gymnasium environments are not serializable in general and pickling them would let a checkpoint run
code, so this walks each environment's wrapper chain and records only plain data attributes: numbers,
strings, numpy scalars and arrays of any dtype (as tensors, or raw bytes for dtypes torch lacks), numpy
``Generator`` states (as their bit-generator state dict), and lists/tuples/dicts of those, nested. That covers
the classic-control and toy-text environments, whose whole state is such data. Environments living in other
processes (``async``) or holding simulator objects (Box2D's world) cannot be captured; resume then continues
from freshly reset environments.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["capture_env_state", "restore_env_state"]

_PRIMITIVES = (bool, int, float, str, type(None))
# Array dtypes torch stores natively (and readably); any other dtype (uint16..uint64, strings, datetimes,
# structured records) is stored as its raw bytes plus numpy's dtype description, so nothing is approximated.
_TORCH_DTYPES = {np.dtype(d) for d in ("bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32",
                                       "float64", "complex64", "complex128")}
# Modules whose objects hold simulator state outside Python data (Box2D's world, bodies and joints): an env
# holding one cannot be captured, and restoring only its plain attributes would desynchronize it.
_FOREIGN_STATE_MODULES = ("Box2D", "gymnasium.envs.box2d")


def _chain(env: Any) -> list[Any]:
    """The env, then every wrapped env below it, down to the unwrapped one."""
    out, seen = [], set()
    while env is not None and id(env) not in seen:
        seen.add(id(env))
        out.append(env)
        env = getattr(env, "env", None)
    return out


def _encode_array(value: np.ndarray) -> dict:
    arr = np.array(value, copy=True, order="C")  # not ascontiguousarray: that turns a 0-d array into 1-d
    if arr.dtype in _TORCH_DTYPES:
        return {"t": "nd", "v": torch.from_numpy(arr), "dtype": str(arr.dtype)}
    raw = np.frombuffer(arr.tobytes(), dtype=np.uint8).copy()
    return {"t": "raw", "v": torch.from_numpy(raw), "descr": np.lib.format.dtype_to_descr(arr.dtype),
            "shape": list(arr.shape)}


def _items(values: Any) -> list | None:
    """Container elements: exact Python primitives as they are, anything else encoded; None if one is not data."""
    out = []
    for value in values:
        if type(value) in _PRIMITIVES:
            out.append(value)
            continue
        enc = _encode(value)
        if enc is None:
            return None
        out.append(enc)
    return out


def _encode(value: Any) -> dict | None:
    """A weights_only-safe encoding of ``value``, or None when it is not plain data.

    Types are matched exactly: numpy scalars subclass float/int and enums subclass int/str, and the restricted
    unpickler refuses both, so they are encoded (numpy scalars keep their dtype) or skipped, never passed through.
    """
    if type(value) in _PRIMITIVES:
        return {"t": "py", "v": value}
    if isinstance(value, np.generic):
        if value.dtype == object:
            return None
        return {"t": "np", "v": _encode_array(np.asarray(value))}
    if isinstance(value, np.ndarray):
        return None if value.dtype.hasobject else _encode_array(value)
    if isinstance(value, np.random.Generator):
        return {"t": "rng", "v": _plain(value.bit_generator.state)}
    if type(value) in (list, tuple):
        items = _items(value)
        return None if items is None else {"t": type(value).__name__, "v": items}
    if type(value) is dict:
        items = _items(value.values()) if all(type(k) in _PRIMITIVES for k in value) else None
        return None if items is None else {"t": "dict", "k": list(value), "v": items}
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


def _decode_item(item: Any) -> Any:
    return _decode(item, None) if isinstance(item, dict) else item


def _decode(enc: dict, current: Any) -> Any:
    kind = enc["t"]
    if kind == "py":
        return enc["v"]
    if kind == "nd":
        return enc["v"].numpy().astype(enc["dtype"], copy=True)
    if kind == "raw":
        dtype = np.lib.format.descr_to_dtype(enc["descr"])
        return np.frombuffer(enc["v"].numpy().tobytes(), dtype=dtype).reshape(enc["shape"]).copy()
    if kind == "np":
        return _decode(enc["v"], None)[()]  # a 0-d array back to the numpy scalar it was, dtype and all
    if kind == "rng":
        rng = current if isinstance(current, np.random.Generator) else np.random.Generator(np.random.PCG64())
        state = dict(enc["v"])
        rng.bit_generator.state = state
        return rng
    if kind == "dict":
        return {k: _decode_item(v) for k, v in zip(enc["k"], enc["v"])}
    # "list"/"tuple": version-1 checkpoints hold only primitives here, which decode as themselves.
    items = [_decode_item(v) for v in enc["v"]]
    return tuple(items) if kind == "tuple" else items


def _holds_foreign_state(obj: Any) -> bool:
    def foreign(value: Any) -> bool:
        return type(value).__module__.startswith(_FOREIGN_STATE_MODULES)

    for value in vars(obj).values():
        if foreign(value) or (type(value) in (list, tuple) and any(foreign(v) for v in value)):
            return True
    return False


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
    sub_chains = [_chain(sub) for sub in getattr(chain[-1], "envs", []) or []]
    if any(_holds_foreign_state(e) for c in sub_chains for e in c):
        return None
    state = {"vector": [_capture_obj(e) for e in chain], "envs": []}
    for sub_chain in sub_chains:
        state["envs"].append([_capture_obj(e) for e in sub_chain])
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
