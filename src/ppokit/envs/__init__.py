"""Environments and environment construction for ppokit.

Importing this package registers ``ppokit/GridWorld-v0`` with gymnasium.
"""

from __future__ import annotations

from ppokit.envs.gridworld import (
    GridWorldEnv,
    GridWorldVectorEnv,
    GridWorldWallsEnv,
)
from ppokit.envs.registration import GRIDWORLD_ID, GRIDWORLD_WALLS_ID, register_envs

register_envs()

from ppokit.envs.backends import backend_names, get_backend, register_backend  # noqa: E402
from ppokit.envs.factory import (  # noqa: E402  (registration must precede factory use)
    CustomEnv,
    autoreset_mode,
    check_env_id,
    check_spaces,
    make_eval_env,
    make_vec_env,
    resolve_env,
)

__all__ = [
    "CustomEnv",
    "GRIDWORLD_ID",
    "GRIDWORLD_WALLS_ID",
    "GridWorldEnv",
    "GridWorldVectorEnv",
    "GridWorldWallsEnv",
    "autoreset_mode",
    "backend_names",
    "get_backend",
    "register_backend",
    "check_env_id",
    "check_spaces",
    "make_eval_env",
    "make_vec_env",
    "register_envs",
    "resolve_env",
]
