"""A test-only env for the actor fault tests (test_actors.py): CartPole whose process raises once, at the first
step past ``raise_after`` steps, the first time any process gets there (``flag``, a file, records that it did).
Imported by rollout workers through the env id ``actor_faults:RaisingCartPole-v0``."""

from __future__ import annotations

import os

import gymnasium as gym


class RaisingCartPole(gym.Wrapper):
    def __init__(self, flag: str, raise_after: int):
        super().__init__(gym.make("CartPole-v1"))
        self.flag, self.raise_after, self.steps = flag, raise_after, 0

    def step(self, action):
        self.steps += 1
        if self.steps > self.raise_after and not os.path.exists(self.flag):
            with open(self.flag, "w") as f:
                f.write(str(os.getpid()))
            raise RuntimeError("injected fault in the third chunk")
        return self.env.step(action)


if "RaisingCartPole-v0" not in gym.registry:
    gym.register("RaisingCartPole-v0", entry_point=RaisingCartPole)
