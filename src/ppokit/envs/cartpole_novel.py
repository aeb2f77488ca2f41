"""CartPole without velocities (``ppokit/CartPoleNoVel-v1``): CartPole-v1 observing only ``[x, theta]``.

RL-Zoo's ``CartPoleNoVel-v1`` (``rl_zoo3``'s ``CartPoleNoVelEnv``), the task its recurrent PPO settings
(``ppo_lstm.yml``) are tuned on: the cart's and the pole's velocities are dropped from the observation, so one
observation does not show the state and a feed-forward policy cannot balance the pole for long; a recurrent one
infers the velocities from the observations before. Dynamics, reward, termination and the 500-step time limit
are CartPole-v1's; the observation bounds are CartPole's twice-the-threshold bounds for ``x`` and ``theta``.
"""

from __future__ import annotations

import numpy as np
from gymnasium import spaces
from gymnasium.envs.classic_control.cartpole import CartPoleEnv, CartPoleVectorEnv

__all__ = ["CartPoleNoVelEnv", "CartPoleNoVelVectorEnv", "POSITIONS"]

POSITIONS = [0, 2]  # x and theta of CartPole's [x, x_dot, theta, theta_dot]


def _position_space(env) -> spaces.Box:
    high = np.array([env.x_threshold * 2, env.theta_threshold_radians * 2], dtype=np.float32)
    return spaces.Box(-high, high, dtype=np.float32)


class CartPoleNoVelEnv(CartPoleEnv):
    """CartPole-v1 whose observation is ``[x, theta]``."""

    def __init__(self, render_mode: str | None = None, **kwargs):
        super().__init__(render_mode=render_mode, **kwargs)
        self.observation_space = _position_space(self)

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        return obs[POSITIONS], info

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs[POSITIONS], reward, terminated, truncated, info


class CartPoleNoVelVectorEnv(CartPoleVectorEnv):
    """Gymnasium's batched CartPole (``vector_mode = "native"``) observing ``[x, theta]`` of each env."""

    def __init__(self, num_envs: int = 1, max_episode_steps: int = 500, render_mode: str | None = None, **kwargs):
        super().__init__(num_envs=num_envs, max_episode_steps=max_episode_steps, render_mode=render_mode, **kwargs)
        self.single_observation_space = _position_space(self)
        self.observation_space = spaces.Box(np.tile(self.single_observation_space.low, (num_envs, 1)),
                                            np.tile(self.single_observation_space.high, (num_envs, 1)),
                                            dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        return obs[:, POSITIONS], info

    def step(self, actions):
        obs, reward, terminated, truncated, info = super().step(actions)
        return obs[:, POSITIONS], reward, terminated, truncated, info
