"""Checkpoints that cannot run code on load and cannot be left half-written.

Loading always goes through ``torch.load(..., weights_only=True)``, so a checkpoint from an untrusted source
can at worst fail to load; it can never execute a pickled payload. Saving checks the state up front for
anything that restricted loader would refuse, so a run never writes a checkpoint it cannot read back, and
refuses non-finite tensors, so a diverged run cannot overwrite the last good checkpoint with NaNs.

Writes go to a temp file in the target directory, are fsynced, then renamed over the target: a crash or
Ctrl-C at any point leaves either the old checkpoint or the new one, never a truncated file.
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CheckpointError",
    "FORMAT",
    "VERSION",
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
]

FORMAT = "ppokit-checkpoint"
VERSION = 1

_RESERVED = ("format", "version")
# Exact types, not isinstance: numpy scalars subclass float and IntEnums subclass int, yet the restricted
# unpickler refuses both.
_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)
_CONTAINERS = (dict, OrderedDict, list, tuple)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


class CheckpointError(Exception):
    """A checkpoint could not be saved or loaded safely."""


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _validate(obj: Any, where: str, active: set[int]) -> None:
    cls = type(obj)
    if cls in _TENSORS:
        if (obj.is_floating_point() or obj.is_complex()) and not bool(torch.isfinite(obj).all()):
            raise CheckpointError(f"{where} contains NaN or Inf; refusing to checkpoint a diverged state")
        return
    if cls in _LEAVES:
        return
    if cls not in _CONTAINERS:
        raise CheckpointError(
            f"{where} is {_type_name(obj)}, which torch.load(weights_only=True) cannot load; "
            "store tensors, numbers, strings, None, or lists/tuples/dicts of those"
        )
    if id(obj) in active:
        raise CheckpointError(f"{where} refers back to one of its own parents (a cycle)")
    active.add(id(obj))
    try:
        if isinstance(obj, dict):
            for key, value in obj.items():
                if type(key) not in _LEAVES:
                    raise CheckpointError(f"{where} has a key of type {_type_name(key)}; keys must be str or numbers")
                _validate(value, f"{where}[{key!r}]", active)
        else:
            for i, value in enumerate(obj):
                _validate(value, f"{where}[{i}]", active)
    finally:
        active.discard(id(obj))


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable on POSIX; directories cannot be opened this way on Windows.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Atomically write ``state`` (plus the ppokit format marker) to ``path``; the old file survives any failure."""
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint state must be a dict, got {_type_name(state)}")
    clash = [k for k in _RESERVED if k in state]
    if clash:
        raise CheckpointError(f"state uses reserved key(s) {clash}; ppokit writes those itself")
    _validate(state, "state", set())
    payload = {"format": FORMAT, "version": VERSION, **state}

    path = Path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    # mkstemp-style files are 0600; keep the mode an existing checkpoint had, else a normal 0644.
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    tmp = tempfile.NamedTemporaryFile(delete=False, dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with tmp as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp.name, mode)
        os.replace(tmp.name, path)
    except BaseException:
        try:
            os.unlink(tmp.name)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Load a ppokit checkpoint with ``weights_only=True``; anything else raises :class:`CheckpointError`."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint path {path} is not a file")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        if not zipfile.is_zipfile(path):
            raise CheckpointError(
                f"{path} is not a valid checkpoint: the file is truncated, corrupt, or was not written by torch.save"
            ) from exc
        if isinstance(exc, pickle.UnpicklingError):
            raise CheckpointError(
                f"{path} contains pickled Python objects that are not plain data; refusing to load it, since "
                "unpickling them could run arbitrary code"
            ) from exc
        raise CheckpointError(f"{path} is a damaged checkpoint: {exc}") from exc

    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a ppokit checkpoint (no {FORMAT!r} format marker); "
            "a bare state_dict or another library's checkpoint cannot be resumed"
        )
    version = obj.get("version")
    if type(version) is not int or version < 1:
        raise CheckpointError(f"{path} has an invalid checkpoint version {version!r}")
    if version > VERSION:
        raise CheckpointError(
            f"{path} is checkpoint format version {version}, written by a newer ppokit; "
            f"this version reads up to {VERSION}, please upgrade"
        )
    return obj


def rng_state() -> dict:
    """Capture python ``random``, numpy's global RNG and torch's CPU (and CUDA) RNG in weights_only-safe form."""
    py_version, py_internal, py_gauss = random.getstate()
    bit_generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {
        "python": {"version": py_version, "state": list(py_internal), "gauss": py_gauss},
        "numpy": {
            "bit_generator": str(bit_generator),
            # int64 because torch's uint32 support is partial; MT19937 keys fit either way.
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the generators captured by :func:`rng_state`; sections absent from ``state`` are left alone."""
    try:
        if "python" in state:
            py = state["python"]
            random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss"]))
        if "numpy" in state:
            nps = state["numpy"]
            keys = np.asarray(torch.as_tensor(nps["keys"]).cpu().numpy(), dtype=np.uint32)
            np.random.set_state(
                (nps["bit_generator"], keys, int(nps["pos"]), int(nps["has_gauss"]), float(nps["cached_gaussian"]))
            )
        if "torch" in state:
            torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
        if "cuda" in state and torch.cuda.is_available():
            # Resuming on a machine with fewer GPUs restores the ones that exist.
            for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(torch.as_tensor(s, dtype=torch.uint8).cpu(), i)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"malformed RNG state in checkpoint: {exc}") from exc
