"""Test-only envs for the actor fault tests (test_actors.py, test_ray_actors.py), imported by rollout workers through
their env ids: ``actor_faults:RaisingCartPole-v0``, CartPole whose process raises once, at the first step past
``raise_after`` steps, the first time any process gets there (``flag``, a file, records that it did); and
``actor_faults:SlowStartCartPole-v0``, whose actors take ``delay_s`` to start; and
``actor_faults:HangingCartPole-v0``, whose step past ``hang_after`` steps never returns, once (``flag``); and
``actor_faults:FaultyCartPole-v0``, all three at once (each with its own flag), for one run that meets every
fault."""

from __future__ import annotations

import os
import time

import gymnasium as gym


def _first_past(steps: int, after: int, flag: str) -> bool:
    """True for the first step past ``after`` of the first process to get there (it records its pid in ``flag``)."""
    if steps <= after or os.path.exists(flag):
        return False
    with open(flag, "w") as f:
        f.write(str(os.getpid()))
    return True


def _hang() -> None:
    while True:
        time.sleep(3600)


class RaisingCartPole(gym.Wrapper):
    def __init__(self, flag: str, raise_after: int):
        super().__init__(gym.make("CartPole-v1"))
        self.flag, self.raise_after, self.steps = flag, raise_after, 0

    def step(self, action):
        self.steps += 1
        if _first_past(self.steps, self.raise_after, self.flag):
            raise RuntimeError("injected fault in the third chunk")
        return self.env.step(action)


if "RaisingCartPole-v0" not in gym.registry:
    gym.register("RaisingCartPole-v0", entry_point=RaisingCartPole)


_SLEPT: list[bool] = []  # this process slept already (once per process, however many envs it builds)


class SlowStartCartPole(gym.Wrapper):
    """CartPole whose first build in every process but the first to build one (the learner, which records its pid in
    ``flag``) sleeps ``delay_s``: the rollout actors stay in their ``__init__`` that long."""

    def __init__(self, flag: str, delay_s: float):
        super().__init__(gym.make("CartPole-v1"))
        if not os.path.exists(flag):
            with open(flag, "w") as f:
                f.write(str(os.getpid()))
        elif open(flag).read() != str(os.getpid()) and not _SLEPT:
            _SLEPT.append(True)
            time.sleep(delay_s)


if "SlowStartCartPole-v0" not in gym.registry:
    gym.register("SlowStartCartPole-v0", entry_point=SlowStartCartPole)


class HangingCartPole(gym.Wrapper):
    """CartPole whose step past ``hang_after`` steps sleeps for good, the first time any process gets there (the
    process writes its pid to ``flag`` first)."""

    def __init__(self, flag: str, hang_after: int):
        super().__init__(gym.make("CartPole-v1"))
        self.flag, self.hang_after, self.steps = flag, hang_after, 0

    def step(self, action):
        self.steps += 1
        if _first_past(self.steps, self.hang_after, self.flag):
            _hang()
        return self.env.step(action)


if "HangingCartPole-v0" not in gym.registry:
    gym.register("HangingCartPole-v0", entry_point=HangingCartPole)


class FaultyCartPole(gym.Wrapper):
    """SlowStartCartPole, RaisingCartPole and HangingCartPole in one env, each fault with its own flag: every actor
    process sleeps ``delay_s`` in its first build, the first process past ``raise_after`` steps raises (once), and
    the first past ``hang_after`` steps hangs for good (once). With ``raise_after < hang_after`` no process both
    raises and hangs: its envs step together, so it raises first and dies."""

    def __init__(self, start_flag: str, delay_s: float, raise_flag: str, raise_after: int, hang_flag: str,
                 hang_after: int):
        super().__init__(SlowStartCartPole(start_flag, delay_s))
        self.raise_flag, self.raise_after = raise_flag, raise_after
        self.hang_flag, self.hang_after = hang_flag, hang_after
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if _first_past(self.steps, self.raise_after, self.raise_flag):
            raise RuntimeError("injected fault in the third chunk")
        if _first_past(self.steps, self.hang_after, self.hang_flag):
            _hang()
        return self.env.step(action)


if "FaultyCartPole-v0" not in gym.registry:
    gym.register("FaultyCartPole-v0", entry_point=FaultyCartPole)
