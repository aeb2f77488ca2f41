"""Checkpoints that cannot run code on load and cannot be left half-written.

Loading always goes through ``torch.load(..., weights_only=True)``, so a checkpoint from an untrusted source
can at worst fail to load; it can never execute a pickled payload. Saving checks the state up front for
anything that restricted loader would refuse, so a run never writes a checkpoint it cannot read back, and
refuses non-finite tensors in the learner's state (``finite=``: policy, optimizer, normalizers), so a diverged
run cannot overwrite the last good checkpoint with NaNs, and weights beyond ``WEIGHT_BOUND`` (``bounded=``: the
policy), which no trained policy reaches and a forged file would use. Raw environment buffers may hold the NaN an env
emitted; they are stored as they are.

Format version 2 stores a SHA-256 over every value (tensor bytes, dtypes, shapes, numbers, strings) and the
list of keys that were checked finite; loading recomputes both and refuses a file whose bytes changed after it
was written, or whose learner state holds NaN/Inf. Version-1 files (no checksum) still load, with a
:class:`CheckpointWarning`, and are checked finite everywhere, as version 1 required when it wrote them.

Writes go to a temp file in the target directory, are fsynced, then renamed over the target: a crash or
Ctrl-C at any point leaves either the old checkpoint or the new one, never a truncated file. A failed write
(disk full, read-only directory, torch's ``inline_container`` errors) raises :class:`CheckpointError` saying
what failed; the previous checkpoint is untouched.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import pickle
import random
import tempfile
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CHECKPOINT_NAME",
    "CheckpointError",
    "CheckpointWarning",
    "FORMAT",
    "LEARNER_KEYS",
    "BOUNDED_KEYS",
    "VERSION",
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
    "check_stored_env_id",
    "check_counters",
    "WEIGHT_BOUND",
    "one_line",
    "describe_write_error",
]

# The file a run dir keeps its latest checkpoint in.
CHECKPOINT_NAME = "checkpoint.pt"

FORMAT = "ppokit-checkpoint"
# 2: adds "checksum" (SHA-256 of every value) and "finite" (the keys checked for NaN/Inf at save).
VERSION = 2

# The keys of a ppokit training checkpoint that hold the learner: these must be finite to save or load.
# Everything else (env buffers, episode counters) may legitimately hold what a misbehaving env produced.
LEARNER_KEYS = ("policy", "optimizer", "obs_norm", "reward_scaler")
# The keys whose weights must lie within +-WEIGHT_BOUND (the normalizers hold raw observation and return
# statistics, which may be any size; Adam's second moments are squared gradients).
BOUNDED_KEYS = ("policy",)

# |weight| above this is refused in the policy (save and load). Orthogonal initialization gives |w| <= ~1.5 and
# Adam moves a weight by at most ~learning_rate per update, so even 10^6 updates at learning rate 1 stay below
# it; float32 allows 3.4e38, which a forged file can use to make every action and value meaningless.
WEIGHT_BOUND = 1e6

_RESERVED = ("format", "version", "checksum", "finite")
# Exact types, not isinstance: numpy scalars subclass float and IntEnums subclass int, yet the restricted
# unpickler refuses both.
_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)
_CONTAINERS = (dict, OrderedDict, list, tuple)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


class CheckpointError(Exception):
    """A checkpoint could not be saved or loaded safely."""


class CheckpointWarning(UserWarning):
    """A checkpoint loaded, but could not be fully verified (an old format without a checksum)."""


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _nonfinite(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())


def _largest(t: torch.Tensor) -> float:
    """The element of a float tensor farthest from 0, with its sign (0 for an empty or non-float tensor)."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0.0
    flat = t.detach().reshape(-1)
    return float(flat[flat.abs().argmax()])


def _validate(obj: Any, where: str, active: set[int], finite: bool = True, bounded: bool = False) -> None:
    cls = type(obj)
    if cls in _TENSORS:
        if finite and _nonfinite(obj):
            raise CheckpointError(f"{where} contains NaN or Inf; refusing to checkpoint a diverged state")
        if bounded and abs(_largest(obj)) > WEIGHT_BOUND:
            raise CheckpointError(f"{where} holds a weight of {_largest(obj):.3g}, beyond +-{WEIGHT_BOUND:g}; refusing "
                                  "to checkpoint a diverged policy")
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
                _validate(value, f"{where}[{key!r}]", active, finite, bounded)
        else:
            for i, value in enumerate(obj):
                _validate(value, f"{where}[{i}]", active, finite, bounded)
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


def _digest(obj: Any, h: "hashlib._Hash") -> None:
    """Feed ``obj`` into ``h`` in a canonical order: container structure, keys, leaf reprs, tensor bytes."""
    cls = type(obj)
    if cls in _TENSORS:
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        # A uint8 view of the elements: every dtype (bfloat16 and bool included) hashes its exact bytes.
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for key, value in obj.items():
            h.update(f"{type(key).__name__}:{key!r}=".encode())
            _digest(value, h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)) and cls is not torch.Size:
        h.update(b"[" if isinstance(obj, list) else b"(")
        for value in obj:
            _digest(value, h)
        h.update(b"]")
    else:
        h.update(f"{_type_name(obj)}:{obj!r};".encode())


def _checksum(payload: dict) -> str:
    h = hashlib.sha256()
    _digest({k: v for k, v in payload.items() if k != "checksum"}, h)
    return h.hexdigest()


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line (torch's multi-line errors joined), cut to ``limit`` characters."""
    text = "; ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_write_error(exc: BaseException) -> str:
    """One line for a failed write: the OS reason with its errno name, or the first line of torch's message."""
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, "")
        reason = exc.strerror or str(exc)
        hint = ""
        if exc.errno == errno.ENOSPC:
            hint = "; the disk is full"
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            hint = "; the directory is not writable"
        return f"{reason} (errno {exc.errno} {name}{hint})"
    return one_line(exc)


def save_checkpoint(path: str | os.PathLike, state: dict, finite: Iterable[str] | None = None,
                    bounded: Iterable[str] = ()) -> None:
    """Atomically write ``state`` (plus the ppokit format marker and a checksum) to ``path``.

    ``finite`` names the top-level keys whose tensors must be free of NaN/Inf (default: every key), ``bounded``
    those whose float values must lie within +-``WEIGHT_BOUND``. The old file survives any failure; a failed
    write raises :class:`CheckpointError` naming the path and the reason.
    """
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint state must be a dict, got {_type_name(state)}")
    clash = [k for k in _RESERVED if k in state]
    if clash:
        raise CheckpointError(f"state uses reserved key(s) {clash}; ppokit writes those itself")
    finite_keys = None if finite is None else [str(k) for k in finite]
    bounded_keys = {str(k) for k in bounded}
    for key, value in state.items():
        if type(key) not in _LEAVES:
            raise CheckpointError(f"state has a key of type {_type_name(key)}; keys must be str or numbers")
        _validate(value, f"state[{key!r}]", set(), finite_keys is None or key in finite_keys, key in bounded_keys)
    payload = {"format": FORMAT, "version": VERSION, "finite": finite_keys, **state}
    payload["checksum"] = {"sha256": _checksum(payload)}

    path = Path(path)
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # mkstemp-style files are 0600; keep the mode an existing checkpoint had, else a normal 0644.
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
        tmp = tempfile.NamedTemporaryFile(delete=False, dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise CheckpointError(f"could not write the checkpoint {path}: {describe_write_error(exc)}") from exc
    try:
        with tmp as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp.name, mode)
        os.replace(tmp.name, path)
    except BaseException as exc:
        try:
            os.unlink(tmp.name)
        except OSError:
            pass
        if isinstance(exc, (OSError, RuntimeError)):
            # Disk full, read-only dir, or torch's "[enforce fail at inline_container.cc]" (its wrapper of a
            # failed write): say what failed; the previous checkpoint was never touched.
            kept = "; the previous checkpoint is unchanged" if path.exists() else ""
            raise CheckpointError(f"could not write the checkpoint {path}: {describe_write_error(exc)}{kept}") from exc
        raise
    _fsync_dir(directory)


def _check_finite(obj: Any, where: str, path: Path, bounded: bool = False) -> None:
    if type(obj) in _TENSORS:
        if _nonfinite(obj):
            raise CheckpointError(f"{path}: {where} contains NaN or Inf; refusing to load a diverged learner")
        if bounded and abs(_largest(obj)) > WEIGHT_BOUND:
            raise CheckpointError(f"{path}: {where} holds a weight of {_largest(obj):.3g}, beyond +-{WEIGHT_BOUND:g}, "
                                  "which no trained policy reaches; refusing to load it (forged or diverged)")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _check_finite(value, f"{where}[{key!r}]", path, bounded)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _check_finite(value, f"{where}[{i}]", path, bounded)


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu",
                    require_finite: Iterable[str] = (), require_bounded: Iterable[str] = ()) -> dict:
    """Load a ppokit checkpoint with ``weights_only=True``; anything else raises :class:`CheckpointError`.

    The checksum (format 2) is verified, and the keys the writer checked finite, plus ``require_finite``, must
    hold no NaN/Inf; the float values under ``require_bounded`` must lie within +-``WEIGHT_BOUND`` (whatever the
    writer claimed: the checksum proves only that the file is as written, not who wrote it). The returned dict
    holds ``format``, ``version`` and the saved state.
    """
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
    if version == 1:
        warnings.warn(f"{path} is a version-1 checkpoint, which has no checksum, so damage to it cannot be "
                      "detected; the next save of this run writes version 2", CheckpointWarning, stacklevel=2)
        finite_keys = None  # version 1 refused NaN/Inf anywhere at save
    else:
        stored = obj.pop("checksum", None)
        if not isinstance(stored, dict) or not isinstance(stored.get("sha256"), str):
            raise CheckpointError(f"{path} is a version-{version} checkpoint without a checksum; "
                                  "it was damaged or not written by ppokit")
        if stored["sha256"] != _checksum(obj):
            raise CheckpointError(f"{path} is corrupt: its contents do not match the SHA-256 checksum stored "
                                  "when it was written (the file was modified or damaged on disk)")
        finite_keys = obj.pop("finite", None)
        if finite_keys is not None and not (isinstance(finite_keys, list)
                                            and all(isinstance(k, str) for k in finite_keys)):
            raise CheckpointError(f"{path} has a malformed 'finite' entry {finite_keys!r}")
    keys = [k for k in obj if k not in _RESERVED] if finite_keys is None else list(finite_keys)
    bounded = set(require_bounded)
    for key in dict.fromkeys([*keys, *require_finite, *bounded]):
        if key in obj:
            _check_finite(obj[key], f"state[{key!r}]", path, key in bounded)
    return obj


def check_counters(state: dict, batch_size: int, path: str | os.PathLike) -> None:
    """Refuse a training checkpoint whose counters no run can have written.

    ``global_step`` and ``update`` are non-negative integers; every update adds one batch per rank
    (``batch_size`` = num_envs * num_steps of the stored config), so ``global_step`` is a multiple of the batch
    and at least ``update`` batches (more when ranks were added on a resume), and 0 before the first update.
    ``kl_beta`` (ppo-kl's penalty, halved or doubled each update, so a long run may reach 0) is finite and >= 0; ``perf`` maps names to non-negative seconds.
    """
    step, update = state.get("global_step"), state.get("update")
    for name, value in (("global_step", step), ("update", update)):
        if name in state and (type(value) is not int or value < 0):
            raise CheckpointError(f"{path} cannot be used: its {name} is {value!r}, not a non-negative integer "
                                  "(the file was forged or damaged)")
    if type(step) is int and type(update) is int and (
            step % batch_size != 0 or step < update * batch_size or (update == 0) != (step == 0)):
        raise CheckpointError(f"{path} cannot be used: its global_step {step:,} does not fit update {update:,} "
                              f"with a batch of {batch_size:,} steps (each update adds one batch per rank, so "
                              f"global_step is a multiple of the batch, at least {update * batch_size:,})")
    if "kl_beta" in state:
        beta = state["kl_beta"]
        if type(beta) not in (int, float) or not math.isfinite(beta) or beta < 0:
            raise CheckpointError(f"{path} cannot be used: its kl_beta is {beta!r}, not a finite number >= 0")
    perf = state.get("perf", {})
    if not isinstance(perf, dict) or not all(
            isinstance(k, str) and type(v) in (int, float) and math.isfinite(v) and v >= 0 for k, v in perf.items()):
        raise CheckpointError(f"{path} cannot be used: its perf entry is not a map of names to seconds >= 0")


def check_stored_env_id(env_id: Any, allow_import: Iterable[str], source: str | os.PathLike) -> None:
    """Refuse a stored ``"module:Env-v0"`` id whose module the caller did not allow.

    Gymnasium imports ``module`` to build such an env, and importing runs the module's code: a checkpoint or
    run dir from someone else must never choose what runs. Only modules the user names (``--import-module``,
    ``allow_import=``) may be imported on the checkpoint's behalf.
    """
    if not isinstance(env_id, str):
        return  # the config's own validation reports a non-string id
    module, sep, _ = env_id.partition(":")
    if sep and module not in set(allow_import):
        raise CheckpointError(
            f"{source}: its env_id {env_id!r} would import the Python module {module!r}, and ppokit never "
            f"imports a module named only by a checkpoint; if you trust it, pass --import-module {module} "
            f"(Python: allow_import=({module!r},)), or give the env explicitly with --env"
        )


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
