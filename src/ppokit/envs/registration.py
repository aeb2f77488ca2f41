"""Registering ppokit's own environments with gymnasium (``ppokit/GridWorld-v0``, ``ppokit/GridWorldWalls-v0``,
``ppokit/CartPoleNoVel-v1``)."""

from __future__ import annotations

import gymnasium as gym

from ppokit.envs.gridworld import DEFAULT_MAX_EPISODE_STEPS

GRIDWORLD_ID = "ppokit/GridWorld-v0"
GRIDWORLD_WALLS_ID = "ppokit/GridWorldWalls-v0"  # walls and an action mask (no natively batched version)
CARTPOLE_NOVEL_ID = "ppokit/CartPoleNoVel-v1"  # CartPole-v1 observing [x, theta]: not Markov (cartpole_novel.py)


def register_envs() -> None:
    """Register ppokit's environments with gymnasium (safe to call repeatedly)."""
    # Re-registering would make gymnasium warn on every re-import (e.g. in subprocess workers).
    if GRIDWORLD_ID not in gym.registry:
        gym.register(
            id=GRIDWORLD_ID,
            entry_point="ppokit.envs.gridworld:GridWorldEnv",
            vector_entry_point="ppokit.envs.gridworld:GridWorldVectorEnv",
            max_episode_steps=DEFAULT_MAX_EPISODE_STEPS,
        )
    if GRIDWORLD_WALLS_ID not in gym.registry:
        gym.register(
            id=GRIDWORLD_WALLS_ID,
            entry_point="ppokit.envs.gridworld:GridWorldWallsEnv",
            reward_threshold=0.93,  # 0.02 below the optimum 0.95, as for GridWorld
            max_episode_steps=DEFAULT_MAX_EPISODE_STEPS,
        )
    if CARTPOLE_NOVEL_ID not in gym.registry:
        gym.register(
            id=CARTPOLE_NOVEL_ID,
            entry_point="ppokit.envs.cartpole_novel:CartPoleNoVelEnv",
            vector_entry_point="ppokit.envs.cartpole_novel:CartPoleNoVelVectorEnv",
            reward_threshold=475.0,  # CartPole-v1's
            max_episode_steps=500,
        )
