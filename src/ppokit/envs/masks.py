"""Action masks from an env: whether a vector env sends them, and reading them after a reset or step.

Two conventions are read: ``info["action_mask"]`` (Gymnasium's Taxi; a vector env batches it and
``info["_action_mask"]`` flags the envs that sent one) and each sub-env's ``action_masks()`` method
(SB3-contrib's); a Dict observation's ``"action_mask"`` entry (PettingZoo's) comes first.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ppokit.envs.encoders import MASK_KEY
from ppokit.envs.errors import env_failure
from ppokit.envs.watchdog import NO_WATCHDOG, EnvTimeout

__all__ = ["action_masks_available", "forget_probe_reset", "read_action_masks", "take_probe_reset"]


def action_masks_available(envs: Any, probe_seed: int | None = None, env_id: str = "?",
                           watchdog: Any = NO_WATCHDOG) -> bool:
    """Whether ``envs`` provides action masks: a sub-env (or the vector env itself) with an ``action_masks()``
    method (SB3-contrib's convention) or with an ``action_mask`` attribute (Gymnasium's Taxi), a Dict observation
    with an ``"action_mask"`` key (PettingZoo's convention), or ``info["action_mask"]`` from the first reset.

    Decided before the collector's first reset, so the trainer can choose its update path: the attributes are
    looked up, and when none is found and ``probe_seed`` is given, the envs are reset once with that seed (the
    collector's first reset, which repeats it with the same seed, then starts from the same observations) to see
    whether the info carries a mask: the only way to learn it from an env that sends masks in ``info`` alone, or
    from an async vector env (its sub-envs live in other processes). The answer is kept per vector env, so the
    collector built on the same envs agrees, and so is the reset's result, which ``Collector.reset`` with the
    same seed takes as its own (the envs are reset once; ``forget_probe_reset`` when they change in between). A
    probe that fails is the run's ``reset()`` failure."""
    if MASK_KEY in getattr(getattr(envs, "single_observation_space", None), "spaces", ()):  # a gymnasium Dict
        return True
    if hasattr(envs, "action_masks") or _sub_env_has(envs, "action_masks") or _sub_env_has(envs, "action_mask"):
        return True
    known = _INFO_MASKS.get(envs)
    if known is not None or probe_seed is None:
        return bool(known)
    try:
        with watchdog.guard("reset()"):
            obs, info = envs.reset(seed=probe_seed)
    except (Exception, EnvTimeout) as exc:  # noqa: BLE001 - the first reset's failure, said as such
        raise env_failure(env_id, "reset()", 0, exc, envs) from exc
    _INFO_MASKS[envs] = found = isinstance(info, dict) and "action_mask" in info
    _PROBE_RESETS[envs] = (probe_seed, (obs, info))
    return found


def forget_probe_reset(envs: Any) -> None:
    """The envs changed after ``action_masks_available``'s probe (a sub-env replaced): the collector resets them."""
    _PROBE_RESETS.pop(envs, None)


# Vector env -> whether its first reset's info held "action_mask" (action_masks_available's probe).
_INFO_MASKS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
# Vector env -> (seed, (obs, info)) of that probe reset, until the collector takes it as its first reset.
_PROBE_RESETS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _sub_env_has(envs: Any, name: str) -> bool:
    subs = getattr(envs, "envs", None)  # a SyncVectorEnv's sub-envs (wrappers included)
    return bool(subs) and subs[0].has_wrapper_attr(name)


def read_action_masks(envs: Any, info: dict, mask_dim: int, obs: Any = None) -> np.ndarray:
    """The ``[N, mask_dim]`` bool masks of the observations a reset or step just returned: ``info["action_mask"]``
    where the envs sent it (rows flagged False by ``info["_action_mask"]`` ask the method or allow every action),
    else each sub-env's ``action_masks()``; a Dict observation's ``"action_mask"`` entry (``obs``, the batch the
    env returned) comes first. ValueError for a mask of another shape or one that allows no action."""
    n = envs.num_envs
    masks = None
    if hasattr(obs, "keys") and MASK_KEY in obs:
        raw = np.asarray(obs[MASK_KEY])
        if raw.size != n * mask_dim:
            raise ValueError(f"observation['{MASK_KEY}'] has shape {raw.shape}, expected ({n}, {mask_dim})")
        masks = raw.reshape(n, mask_dim) != 0
    elif isinstance(info, dict) and "action_mask" in info:
        raw = info["action_mask"]
        if isinstance(raw, np.ndarray) and raw.dtype != object:
            masks = raw.reshape(n, -1) != 0 if raw.size == n * mask_dim else None
            if masks is None:
                raise ValueError(f"info['action_mask'] has shape {raw.shape}, expected ({n}, {mask_dim})")
        else:  # per-env objects (envs whose masks differ in type): each row on its own
            masks = np.ones((n, mask_dim), dtype=bool)
            for i, row in enumerate(raw):
                if row is not None:
                    masks[i] = _one_mask(row, mask_dim, i)
        present = info.get("_action_mask")
        if present is not None and not np.asarray(present, dtype=bool).all():
            masks = masks.copy()
            masks[~np.asarray(present, dtype=bool)] = True
    elif hasattr(envs, "action_masks"):
        masks = np.asarray(envs.action_masks()).reshape(n, -1) != 0
    elif _sub_env_has(envs, "action_masks"):
        masks = np.stack([_one_mask(m, mask_dim, i) for i, m in enumerate(envs.call("action_masks"))])
    else:  # an info-mask env whose step sent none this time: every action allowed
        masks = np.ones((n, mask_dim), dtype=bool)
    if masks.shape != (n, mask_dim):
        raise ValueError(f"action masks of shape {masks.shape}, expected ({n}, {mask_dim})")
    empty = ~masks.any(1)
    if empty.any():
        raise ValueError(f"the action mask of env {int(np.flatnonzero(empty)[0])} allows no action")
    return masks


def _one_mask(row: Any, mask_dim: int, i: int) -> np.ndarray:
    m = np.asarray(row).reshape(-1)
    if m.shape != (mask_dim,):
        raise ValueError(f"the action mask of env {i} has {m.size} entries, expected {mask_dim}")
    return m != 0


def take_probe_reset(envs: Any, seed: int) -> tuple | None:
    """The ``(obs, info)`` of ``action_masks_available``'s probe reset of ``envs`` with ``seed`` (forgotten once
    taken), or None when there was none: the first reset is then the caller's."""
    probed = _PROBE_RESETS.pop(envs, None)
    return probed[1] if probed is not None and probed[0] == seed else None
