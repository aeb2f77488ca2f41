"""The vector-env backends ``vector_mode`` names: one registry, and what each backend can do.

A backend is a function ``make(env_id, num_envs, seed, env_kwargs) -> gymnasium.vector.VectorEnv`` (un-reset)
plus its capabilities, which the rest of ppokit asks instead of testing a backend's name. ``factory.py``
registers the built-in ones (sync, async, native, and envpool from ``envpool_backend.py``); a new backend is one
module that calls ``register_backend`` (config validation, ``--vector-mode`` and
``ppokit.train(vector_mode=...)`` then accept its name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ppokit.core.errors import ConfigError

__all__ = ["Backend", "register_backend", "unregister_backend", "get_backend", "backend_names"]


@dataclass(frozen=True)
class Backend:
    """A registered ``vector_mode``.

    ``make``: ``(env_id, num_envs, seed, env_kwargs) -> VectorEnv`` from an env id.
    ``from_factories``: ``(env_fns) -> VectorEnv`` from one zero-argument env factory per env (a custom env, the
    Atari stack); None: the backend builds envs from ids only.
    ``own_task_ids``: its ids are its own task list, not Gymnasium's registry: no Gymnasium id check, and the
    planner cannot probe them.
    ``own_atari_wrappers``: its Atari tasks do their own preprocessing, so ppokit's Atari stack (atari.py) is
    not applied.
    """

    name: str
    make: Callable[[str, int, int | None, dict[str, Any]], Any]
    from_factories: Callable[[list[Callable[[], Any]]], Any] | None = None
    own_task_ids: bool = False
    own_atari_wrappers: bool = False


_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, make: Callable[[str, int, int | None, dict[str, Any]], Any], *,
                     from_factories: Callable[[list[Callable[[], Any]]], Any] | None = None,
                     own_task_ids: bool = False, own_atari_wrappers: bool = False) -> Backend:
    """Register (or replace) the backend ``vector_mode = name``; returns it."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a backend's name is a non-empty string, got {name!r}")
    backend = Backend(name, make, from_factories, own_task_ids, own_atari_wrappers)
    _BACKENDS[name] = backend
    return backend


def unregister_backend(name: str) -> None:
    """Remove the backend ``name`` (a no-op if none is registered)."""
    _BACKENDS.pop(name, None)


def backend_names() -> tuple[str, ...]:
    """The registered ``vector_mode`` values, in registration order."""
    return tuple(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend ``vector_mode = name``; a ConfigError naming ``vector_mode`` and the registered modes if none."""
    try:
        return _BACKENDS[name]
    except (KeyError, TypeError):
        raise ConfigError("vector_mode", f"must be one of {', '.join(_BACKENDS)}, got {name!r}") from None
