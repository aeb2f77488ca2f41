"""Test-only envs imported by rollout workers through their env ids (test_recurrent_actors.py): CartPole without
velocities (``ppokit/CartPoleNoVel-v1``'s ``[x, theta]``) seen as a Dict, ``obs_envs:DictCartPoleNoVel-v0``
(``{"x": [x], "theta": [theta]}``), and as a 36x36 grayscale image, ``obs_envs:PixelCartPoleNoVel-v0`` (a bright
column at the cart's position, a bright row at the pole's angle): both need memory to act well, as the flat one."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

import ppokit  # noqa: F401 - registers ppokit/CartPoleNoVel-v1

SIDE = 36  # the Nature CNN's smallest input


class DictCartPoleNoVel(gym.ObservationWrapper):
    def __init__(self):
        super().__init__(gym.make("ppokit/CartPoleNoVel-v1"))
        low, high = self.env.observation_space.low, self.env.observation_space.high
        self.observation_space = gym.spaces.Dict({
            "x": gym.spaces.Box(low[:1], high[:1], dtype=np.float32),
            "theta": gym.spaces.Box(low[1:], high[1:], dtype=np.float32)})

    def observation(self, obs):
        return {"x": obs[:1].astype(np.float32), "theta": obs[1:].astype(np.float32)}


class PixelCartPoleNoVel(gym.ObservationWrapper):
    def __init__(self):
        super().__init__(gym.make("ppokit/CartPoleNoVel-v1"))
        self.observation_space = gym.spaces.Box(0, 255, (SIDE, SIDE, 1), np.uint8)

    def observation(self, obs):
        img = np.zeros((SIDE, SIDE, 1), np.uint8)
        col = int(np.clip((obs[0] + 2.4) / 4.8 * (SIDE - 1), 0, SIDE - 1))
        row = int(np.clip((obs[1] + 0.21) / 0.42 * (SIDE - 1), 0, SIDE - 1))
        img[:, col] = 255
        img[row, :] = 128
        return img


for _name, _cls in (("DictCartPoleNoVel-v0", DictCartPoleNoVel), ("PixelCartPoleNoVel-v0", PixelCartPoleNoVel)):
    if _name not in gym.registry:
        gym.register(_name, entry_point=_cls)
