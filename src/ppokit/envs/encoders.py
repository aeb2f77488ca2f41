"""Observation encoders: how an env's observations become the arrays the policy reads.

One encoder per observation space, chosen by ``observation_encoder(space)``. Every place where observations enter
(the collector's reset/step/final observations, the env checks, the evaluation gate, ``Agent``) converts through
it, so a new kind of space is added here once:

- ``Box`` (any other than an image) -> identity flatten: ``np.asarray(obs, dtype=np.float32).reshape(n, -1)``, the
  exact conversion ppokit always made (Box runs compute bit for bit what they did before encoders existed);
- ``Discrete(n, start)`` -> one-hot float32 of size ``n`` (observation ``start + i`` -> ``e_i``);
- an image ``Box`` (dtype uint8, bounds 0..255, 3-D, one axis of size 1, 3 or 4 first or last) -> uint8
  ``[n, C, H, W]``: the pixels stay bytes in the buffer (a 4x84x84 Atari frame stack is 28 KB a step, not 113 KB
  of floats) and the model (``policies.encoder_networks.NatureCNN``) scales them by 1/255. The layout is decided
  by where the channel axis is:
  ``(C, H, W)`` when the FIRST axis has size 1/3/4 (Atari frame stacks ``(4, 84, 84)``), else ``(H, W, C)`` when
  the LAST one has (``(64, 64, 3)`` from ``render()``), transposed to channels-first here; an image too small
  for the Nature CNN (height or width < 36) is refused naming its shape;
- ``Dict`` -> one encoder per key (keys in the space's order), a dict of arrays; the key ``"action_mask"``
  (PettingZoo's convention) is the action mask, not an input (``mask_key``, read by the collector and ``Agent``);
- ``Tuple`` -> like ``Dict`` with the keys ``"0"``, ``"1"``, ...

An encoder's ``spec()`` is stored with the policy (``obs_encoding``) so a loaded agent encodes the observations it
is given the way training did; a flat Box stores nothing (old checkpoints load unchanged).

Encoded observations are an ndarray (flat or image) or, for Dict/Tuple, a dict of ndarrays; the ``obs_*`` helpers
below apply one operation to either (to a tensor, indexed, copied), so the buffer, the batch and the collector
treat both alike.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

__all__ = ["BoxEncoder", "OneHotEncoder", "ImageEncoder", "DictEncoder", "observation_encoder", "encoder_from_spec",
           "image_layout", "MASK_KEY", "MIN_IMAGE_SIZE", "obs_map", "obs_index", "obs_to_tensor", "obs_copy_"]

MASK_KEY = "action_mask"  # a Dict observation's action mask (PettingZoo), never an input of the policy
CHANNEL_SIZES = (1, 3, 4)  # grayscale, RGB, RGBA or a 4-frame stack
# The Nature CNN's three convolutions (8x8 stride 4, 4x4 stride 2, 3x3 stride 1) leave no pixel below 36x36.
MIN_IMAGE_SIZE = 36


# ---------------------------------------------------------------------------------------- observation trees
def obs_map(fn: Callable[[Any], Any], obs: Any) -> Any:
    """``fn`` applied to an encoded observation: to each part of a dict, else to the array itself."""
    return {k: fn(v) for k, v in obs.items()} if isinstance(obs, dict) else fn(obs)


def obs_index(obs: Any, idx: Any) -> Any:
    """The rows ``idx`` of an encoded batch (every part of a dict)."""
    return {k: v[idx] for k, v in obs.items()} if isinstance(obs, dict) else obs[idx]


def obs_to_tensor(obs: Any, device: torch.device | str) -> Any:
    """An encoded observation as tensor(s) on ``device`` (dtypes kept: images stay uint8)."""
    return obs_map(lambda a: torch.as_tensor(a, device=device), obs)


def obs_copy_(dest: Any, src: Any) -> None:
    """``dest.copy_(src)`` for a tensor or each part of a dict of tensors."""
    if isinstance(dest, dict):
        for k, v in dest.items():
            v.copy_(src[k])
    else:
        dest.copy_(src)


# ---------------------------------------------------------------------------------------- flat encoders
class _FloatRows:
    """What flat float32 encodings share: NaN/Inf detection by row and the buffer layout."""

    structured = False
    flat_dim: int

    def nonfinite(self, obs: np.ndarray) -> np.ndarray:
        """``[n]`` bool: the rows holding a NaN/Inf."""
        return ~np.isfinite(obs).all(1)

    def zero_nonfinite(self, obs: np.ndarray) -> np.ndarray:
        """``obs`` with NaN/Inf replaced by 0 (such steps are not trained on; the policy still acts on them)."""
        return np.where(np.isfinite(obs), obs, 0.0).astype(np.float32)

    def layout(self) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of one encoded observation, as the buffer stores it."""
        return (self.flat_dim,), torch.float32


class BoxEncoder(_FloatRows):
    """A Box observation, flattened to ``prod(shape)`` float32 features."""

    normalizable = True  # running mean/std normalization applies (float vector features)
    check_values = None  # the collector's hot path needs no per-value test (shape and dtype suffice)
    what = "a float vector"

    def __init__(self, flat_dim: int):
        self.flat_dim = flat_dim

    def encode(self, obs: Any, n: int) -> np.ndarray:
        """``n`` observations as a ``[n, flat_dim]`` float32 array."""
        return np.asarray(obs, dtype=np.float32).reshape(n, -1)

    def encode_rows(self, rows: list) -> np.ndarray:
        """Observations given one by one (e.g. an object array of ``final_obs``) as ``[len(rows), flat_dim]``."""
        return np.stack([np.asarray(o, dtype=np.float32).reshape(-1) for o in rows])

    def problem(self, obs: Any) -> str | None:
        return None

    def spec(self) -> dict | None:
        return None

    def part_spec(self) -> dict:
        """The spec of this encoder as a part of a Dict/Tuple (there a Box must say its size)."""
        return {"type": "box", "flat_dim": self.flat_dim}


class OneHotEncoder(_FloatRows):
    """A ``Discrete(n, start)`` observation as a one-hot float32 vector of size ``n``."""

    normalizable = False  # a one-hot code is not a scale to standardize
    what = "one-hot encoded"

    def __init__(self, n: int, start: int = 0):
        if n < 1:
            raise ValueError(f"Unsupported observation space Discrete({n}): it has no values")
        self.n, self.start, self.flat_dim = int(n), int(start), int(n)
        self._eye = np.eye(self.n, dtype=np.float32)

    def problem(self, obs: Any) -> str | None:
        """What is wrong with a batch of observations (not integers, out of range), or None."""
        arr = np.asarray(obs)
        if arr.dtype.kind not in "biuf":
            return f"observations of dtype {arr.dtype}, expected integers"
        if arr.dtype.kind == "f" and not (np.isfinite(arr).all() and (arr == np.round(arr)).all()):
            return f"non-integer observations {arr.reshape(-1)[:4].tolist()}, expected integers"
        if arr.size and (arr.min() < self.start or arr.max() >= self.start + self.n):
            bad = arr[(arr < self.start) | (arr >= self.start + self.n)].reshape(-1)[0].item()
            return (f"observation {bad!r} outside Discrete({self.n}, start={self.start}): expected "
                    f"{self.start}..{self.start + self.n - 1}")
        return None

    def check_values(self, obs: np.ndarray) -> bool:
        """The collector's hot-path test: integer dtype and every value in range."""
        return obs.dtype.kind in "iu" and (obs.size == 0 or (obs.min() >= self.start
                                                             and obs.max() < self.start + self.n))

    def encode(self, obs: Any, n: int) -> np.ndarray:
        """``n`` observations (ints, any shape holding ``n`` values) as ``[n, n_values]`` one-hot float32."""
        problem = self.problem(obs)
        if problem is not None:
            raise ValueError(problem)
        idx = np.asarray(obs).reshape(n).astype(np.int64) - self.start
        return self._eye[idx]

    def encode_rows(self, rows: list) -> np.ndarray:
        return self.encode(np.asarray([np.asarray(o).reshape(()) for o in rows]), len(rows))

    def spec(self) -> dict:
        return {"type": "one_hot", "n": self.n, "start": self.start}

    part_spec = spec


# ---------------------------------------------------------------------------------------- images
def image_layout(space: Any) -> str | None:
    """``"chw"`` or ``"hwc"`` for an image Box (uint8 with bounds 0..255, 3-D, a channel axis of size 1/3/4 first
    or last), else None. The first axis wins when both qualify (only images too small for the CNN can have both).
    A uint8 Box with other bounds (a grid of small codes, a 0/1 mask) is no pixel image: 1/255 would flatten it to
    almost nothing, so it stays a flat Box (as Stable-Baselines3's ``is_image_space`` also requires)."""
    from gymnasium import spaces

    if not (isinstance(space, spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3):
        return None
    if not (np.all(space.low == 0) and np.all(space.high == 255)):
        return None
    if space.shape[0] in CHANNEL_SIZES:
        return "chw"
    if space.shape[-1] in CHANNEL_SIZES:
        return "hwc"
    return None


class ImageEncoder:
    """An image observation as uint8 ``[n, C, H, W]`` (an ``(H, W, C)`` one transposed); scaled in the model."""

    normalizable = False  # pixels are scaled by 1/255 inside the model, not standardized
    structured = False
    what = "an image (uint8 pixels, scaled by 1/255 inside the model)"

    def __init__(self, shape: tuple[int, ...] | list[int], channels_last: bool):
        self.shape, self.channels_last = tuple(int(d) for d in shape), bool(channels_last)
        h, w, c = self.shape if self.channels_last else (*self.shape[1:], self.shape[0])
        self.chw = (c, h, w)
        self.flat_dim = c * h * w
        if h < MIN_IMAGE_SIZE or w < MIN_IMAGE_SIZE:
            layout = "(H, W, C)" if self.channels_last else "(C, H, W)"
            raise ValueError(
                f"image observation of shape {self.shape} (read as {layout}: {h}x{w} pixels, {c} channels) is too "
                f"small for the Nature CNN (8x8 stride 4, 4x4 stride 2, 3x3 stride 1 need >= {MIN_IMAGE_SIZE}x"
                f"{MIN_IMAGE_SIZE}); resize it, or flatten it for an MLP with "
                "gymnasium.wrappers.FlattenObservation")

    def check_values(self, obs: np.ndarray) -> bool:
        """The collector's hot-path test: uint8 pixels (any other dtype is checked and converted)."""
        return obs.dtype == np.uint8

    def problem(self, obs: Any) -> str | None:
        arr = np.asarray(obs)
        if arr.dtype == np.uint8:
            return None
        if arr.dtype.kind not in "biuf":
            return f"image observations of dtype {arr.dtype}, expected uint8"
        if arr.size and not (np.isfinite(arr).all() and (arr == np.round(arr)).all()
                             and arr.min() >= 0 and arr.max() <= 255):
            return f"image observations of dtype {arr.dtype} with values outside the integers 0..255"
        return None

    def encode(self, obs: Any, n: int) -> np.ndarray:
        """``n`` images as a C-contiguous uint8 ``[n, C, H, W]`` array."""
        problem = self.problem(obs)
        if problem is not None:
            raise ValueError(problem)
        arr = np.asarray(obs).reshape(n, *self.shape)
        if self.channels_last:
            arr = arr.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(arr, dtype=np.uint8)

    def encode_rows(self, rows: list) -> np.ndarray:
        return self.encode(np.stack([np.asarray(o) for o in rows]), len(rows))

    def nonfinite(self, obs: np.ndarray) -> np.ndarray:
        return np.zeros(obs.shape[0], dtype=bool)  # bytes are never NaN

    def zero_nonfinite(self, obs: np.ndarray) -> np.ndarray:
        return obs

    def layout(self) -> tuple[tuple[int, ...], torch.dtype]:
        return self.chw, torch.uint8

    def spec(self) -> dict:
        return {"type": "image", "shape": list(self.shape), "channels_last": self.channels_last}

    part_spec = spec


# ---------------------------------------------------------------------------------------- Dict / Tuple
class DictEncoder:
    """A Dict (or Tuple) observation: one encoder per key; encoded as a dict of arrays (``"0"``, ``"1"``, ... for
    a Tuple). ``mask_key`` names the Dict key that carries the action mask (excluded from the inputs)."""

    structured = True
    check_values = None

    def __init__(self, parts: dict[str, Any], shapes: dict[str, tuple[int, ...]], tuple_space: bool = False,
                 mask_key: str | None = None):
        if not parts:
            raise ValueError("Unsupported observation space: a Dict/Tuple observation with no inputs")
        self.parts, self.shapes = dict(parts), {k: tuple(s) for k, s in shapes.items()}
        self.tuple_space, self.mask_key = bool(tuple_space), mask_key
        self.flat_dim = sum(p.flat_dim for p in self.parts.values())
        # Observation normalization standardizes the float vector parts only (images and one-hot codes pass).
        self.normalizable = any(p.normalizable for p in self.parts.values())
        self.what = "a " + ("Tuple" if tuple_space else "Dict") + " without float vector parts"

    def _raw(self, obs: Any, key: str) -> Any:
        return obs[int(key)] if self.tuple_space else obs[key]

    def problem(self, obs: Any, n: int | None = None) -> str | None:
        """What is wrong with a batch of ``n`` observations (a missing key, a part of another shape), or None."""
        kind = "Tuple" if self.tuple_space else "Dict"
        shaped = isinstance(obs, (tuple, list)) if self.tuple_space else hasattr(obs, "keys")
        if not shaped:
            return f"observations of type {type(obs).__name__}, expected a {kind} of arrays"
        for key, part in self.parts.items():
            try:
                arr = np.asarray(self._raw(obs, key))
            except (KeyError, IndexError):
                return f"observations without the {kind} entry {key!r}"
            except Exception as exc:  # noqa: BLE001 - a part numpy cannot take
                return f"observation entry {key!r} that is not array-like ({exc})"
            expected = self.shapes[key] if n is None else (n, *self.shapes[key])
            if arr.dtype.kind not in "biuf":
                return f"observation entry {key!r} of dtype {arr.dtype}, expected numbers of shape {expected}"
            if arr.shape != expected:
                return f"observation entry {key!r} of shape {arr.shape}, expected {expected}"
            problem = part.problem(arr)
            if problem is not None:
                return f"{problem} in observation entry {key!r}"
        return None

    def encode(self, obs: Any, n: int) -> dict[str, np.ndarray]:
        problem = self.problem(obs, n)
        if problem is not None:
            raise ValueError(problem)
        return {key: part.encode(self._raw(obs, key), n) for key, part in self.parts.items()}

    def encode_rows(self, rows: list) -> dict[str, np.ndarray]:
        return {key: part.encode_rows([self._raw(r, key) for r in rows]) for key, part in self.parts.items()}

    def mask(self, obs: Any) -> Any:
        """The action-mask entry of a raw (batched or single) observation, or None."""
        if self.mask_key is None or not hasattr(obs, "keys") or self.mask_key not in obs:
            return None
        return obs[self.mask_key]

    def batch_size(self, obs: Any) -> int | None:
        """None for one observation, else the batch size (read from the first part's leading axis); ValueError
        for something that is not this Dict/Tuple."""
        kind = "Tuple" if self.tuple_space else "Dict"
        shaped = isinstance(obs, (tuple, list)) if self.tuple_space else hasattr(obs, "keys")
        key = next(iter(self.parts))
        try:
            if not shaped:
                raise TypeError
            arr = np.asarray(self._raw(obs, key))
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"observation of type {type(obs).__name__}, the policy expects a {kind} with the "
                             f"entries {list(self.parts)}") from None
        single = arr.shape == self.shapes[key]
        if not single and (arr.ndim == 0 or arr.shape[1:] != self.shapes[key]):
            raise ValueError(f"observation entry {key!r} of shape {arr.shape}, the policy expects "
                             f"{self.shapes[key]} or a batch of them")
        return None if single else int(arr.shape[0])

    def nonfinite(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        bad = None
        for key, part in self.parts.items():
            b = part.nonfinite(obs[key])
            bad = b if bad is None else bad | b
        return bad

    def zero_nonfinite(self, obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {key: part.zero_nonfinite(obs[key]) for key, part in self.parts.items()}

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {key: part.layout() for key, part in self.parts.items()}

    def spec(self) -> dict:
        return {"type": "tuple" if self.tuple_space else "dict", "mask_key": self.mask_key,
                "parts": {key: part.part_spec() for key, part in self.parts.items()},
                "shapes": {key: list(s) for key, s in self.shapes.items()}}


# ---------------------------------------------------------------------------------------- choosing one
def _part_encoder(space: Any, where: str) -> Any:
    from gymnasium import spaces

    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        raise ValueError(f"Unsupported observation space: {where} is a nested {type(space).__name__}; ppokit "
                         "encodes one level of Dict/Tuple (flatten the inner one with "
                         "gymnasium.wrappers.FlattenObservation)")
    try:
        return observation_encoder(space)
    except ValueError as exc:
        raise ValueError(f"{exc} (at {where})") from None


def observation_encoder(space: Any) -> BoxEncoder | OneHotEncoder | ImageEncoder | DictEncoder:
    """The encoder for one (unbatched) observation space; ValueError naming the space if there is none."""
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        return OneHotEncoder(int(space.n), int(space.start))
    if isinstance(space, spaces.Box):
        layout = image_layout(space)
        if layout is not None:
            return ImageEncoder(space.shape, channels_last=layout == "hwc")
        return BoxEncoder(int(np.prod(space.shape)))
    if isinstance(space, spaces.Dict):
        keys = [k for k in space.spaces if k != MASK_KEY]
        parts = {str(k): _part_encoder(space.spaces[k], f"key {k!r}") for k in keys}
        shapes = {str(k): tuple(space.spaces[k].shape) for k in keys}
        return DictEncoder(parts, shapes, mask_key=MASK_KEY if MASK_KEY in space.spaces else None)
    if isinstance(space, spaces.Tuple):
        parts = {str(i): _part_encoder(s, f"index {i}") for i, s in enumerate(space.spaces)}
        return DictEncoder(parts, {str(i): tuple(s.shape) for i, s in enumerate(space.spaces)}, tuple_space=True)
    raise ValueError(f"Unsupported observation space {space}: ppokit supports Box (vectors and images), Discrete, "
                     "Dict and Tuple observations")


def encoder_from_spec(spec: dict | None, obs_dim: int | None = None) -> Any:
    """The encoder a stored policy was trained with (``None``: a Box of ``obs_dim`` features)."""
    if spec is None:
        return BoxEncoder(obs_dim)
    kind = spec.get("type") if isinstance(spec, dict) else None
    try:
        if kind == "one_hot":
            return OneHotEncoder(int(spec["n"]), int(spec.get("start", 0)))
        if kind == "box":
            return BoxEncoder(int(spec["flat_dim"]))
        if kind == "image":
            return ImageEncoder(spec["shape"], bool(spec["channels_last"]))
        if kind in ("dict", "tuple"):
            parts = {str(k): encoder_from_spec(v) for k, v in spec["parts"].items()}
            shapes = {str(k): tuple(int(d) for d in v) for k, v in spec["shapes"].items()}
            return DictEncoder(parts, shapes, tuple_space=kind == "tuple", mask_key=spec.get("mask_key"))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed observation encoding {spec!r} ({type(exc).__name__}: {exc})") from None
    raise ValueError(f"unknown observation encoding {spec!r}")
