"""Observation encoders: how an env's observations become the flat float32 rows the policy reads.

One encoder per observation space, chosen by ``observation_encoder(space)``. Every place where observations enter
(the collector's reset/step/final observations, the evaluation gate, ``Agent``) converts through it, so a new kind
of space is added here once. Today:

- ``Box`` -> identity flatten: ``np.asarray(obs, dtype=np.float32).reshape(n, -1)``, the exact conversion ppokit
  always made (Box runs compute bit for bit what they did before encoders existed);
- ``Discrete(n, start)`` -> one-hot float32 of size ``n`` (observation ``start + i`` -> ``e_i``).

Image Boxes (a CNN in the model), Dict and Tuple spaces are meant to be added here as further encoders. An
encoder's ``spec()`` is stored with the policy (``ActorCritic.obs_encoding``) so a loaded agent encodes the
observations it is given the way training did; Box stores nothing (old checkpoints load unchanged).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["BoxEncoder", "OneHotEncoder", "observation_encoder", "encoder_from_spec"]


class BoxEncoder:
    """A Box observation, flattened to ``prod(shape)`` float32 features."""

    normalizable = True  # running mean/std normalization applies (float vector features)
    check_values = None  # the collector's hot path needs no per-value test (shape and dtype suffice)

    def __init__(self, flat_dim: int):
        self.flat_dim = flat_dim

    def encode(self, obs: Any, n: int) -> np.ndarray:
        """``n`` observations as a ``[n, flat_dim]`` float32 array."""
        return np.asarray(obs, dtype=np.float32).reshape(n, -1)

    def encode_rows(self, rows: list) -> np.ndarray:
        """Observations given one by one (e.g. an object array of ``final_obs``) as ``[len(rows), flat_dim]``."""
        return np.stack([np.asarray(o, dtype=np.float32).reshape(-1) for o in rows])

    def spec(self) -> dict | None:
        return None


class OneHotEncoder:
    """A ``Discrete(n, start)`` observation as a one-hot float32 vector of size ``n``."""

    normalizable = False  # a one-hot code is not a scale to standardize

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


def observation_encoder(space: Any) -> BoxEncoder | OneHotEncoder:
    """The encoder for one (unbatched) observation space; ValueError naming the space if there is none."""
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        return OneHotEncoder(int(space.n), int(space.start))
    if isinstance(space, spaces.Box):
        return BoxEncoder(int(np.prod(space.shape)))
    raise ValueError(f"Unsupported observation space {space}: ppokit supports Box and Discrete observations")


def encoder_from_spec(spec: dict | None, obs_dim: int) -> BoxEncoder | OneHotEncoder:
    """The encoder a stored policy was trained with (``None``: a Box of ``obs_dim`` features)."""
    if spec is None:
        return BoxEncoder(obs_dim)
    if isinstance(spec, dict) and spec.get("type") == "one_hot":
        return OneHotEncoder(int(spec["n"]), int(spec.get("start", 0)))
    raise ValueError(f"unknown observation encoding {spec!r}")
