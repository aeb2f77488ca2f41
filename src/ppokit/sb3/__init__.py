"""Stable-Baselines3's PPO interface on ppokit: change ``from stable_baselines3 import PPO`` to
``from ppokit.sb3 import PPO`` (and SB3's callbacks and ``make_vec_env`` to this package's). docs/sb3.md lists how
each argument maps to ``PPOConfig`` and what differs. Not imported by ``import ppokit``.
"""

from ppokit.sb3.callbacks import (
    BaseCallback,
    CallbackList,
    CheckpointCallback,
    EvalCallback,
    EveryNTimesteps,
    StopTrainingOnRewardThreshold,
    evaluate_policy,
)
from ppokit.sb3.ppo import PPO, RecurrentPPO
from ppokit.sb3.translate import SB3Error
from ppokit.sb3.vec_env import VecEnv, make_vec_env

__all__ = ["PPO", "RecurrentPPO", "BaseCallback", "CallbackList", "CheckpointCallback", "EvalCallback", "EveryNTimesteps",
           "StopTrainingOnRewardThreshold", "evaluate_policy", "SB3Error", "VecEnv", "make_vec_env"]
