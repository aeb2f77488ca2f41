"""The learner pulls its rollouts from a ``RolloutSource`` (``rollout.source``) and publishes its weights back,
numbered; and the env-stepping loop (``rollout.loop``) is the one the rollout, the evaluation gate and
``Agent.evaluate`` step their envs with.

A second source, written here, acts with a copy of the learner's weights one version behind (what a remote actor
does while the learner moves on): plugged into the real trainer it trains, its batches carry the version that
acted, and the trainer logs the policy lag 1.
"""

from __future__ import annotations

import copy
import csv

import gymnasium as gym
import numpy as np
import torch

from ppokit.config.ppo_config import PPOConfig
from ppokit.envs.watchdog import NO_WATCHDOG
from ppokit.policies import build_policy
from ppokit.rollout.collector import Collector
from ppokit.rollout.evaluation import evaluate_first_episodes
from ppokit.rollout.source import RolloutSource
from ppokit.training.agent import Agent, evaluate
from ppokit.training.trainer import Trainer, train

torch.set_num_threads(1)

LAG = "diag/policy_lag"
_CFG = dict(env_id="CartPole-v1", num_envs=2, num_steps=16, total_timesteps=4 * 32, fused_update=False,
            hidden_sizes=[16], tensorboard=False)


class OneVersionBehind:
    """A rollout source that acts with the weights of the version before the last published one (the first
    rollout: the initial weights), through an in-process Collector on its own copy of the policy."""

    def __init__(self, envs, policy, acting, **kwargs):
        self.behind = copy.deepcopy(policy)
        self._local = Collector(envs, self.behind, self.behind, **kwargs)
        self.published: list[int] = []
        self.snapshots: dict[int, dict] = {}  # version -> the weights published with it
        self.stale = True

    def __getattr__(self, name):  # buffer, reset, loop_state, normalize, ...: the local collector's
        return getattr(self.__dict__["_local"], name)

    def __setattr__(self, name, value):
        if name == "watchdog":  # the trainer bounds the local collector's env calls
            self._local.watchdog = value
        else:
            super().__setattr__(name, value)

    def publish(self, weights, version):
        self.published.append(version)
        self.snapshots[version] = {k: v.clone() for k, v in weights.state_dict().items()}
        acting = max(version - 1, 0)
        self.behind.load_state_dict(self.snapshots[acting])
        self._local.publish(self.behind, acting)


def test_the_collector_has_every_member_of_the_protocol(tmp_path):
    trainer = Trainer(PPOConfig(**_CFG), run_dir=tmp_path / "run", console_enabled=False)
    try:
        source = trainer.collector
        assert isinstance(source, RolloutSource)
        for name in RolloutSource.__annotations__:  # the typed attributes, not only the methods
            assert hasattr(source, name), name
        assert source.buffer.policy_version.shape == (16, 2) and source.buffer.policy_version.dtype == torch.int64
    finally:
        trainer.envs.close()
        trainer._claim.release()


def test_a_source_acting_one_version_behind_trains_and_the_trainer_logs_lag_1(tmp_path):
    sources = []

    def backend(*args, **kwargs):
        sources.append(OneVersionBehind(*args, **kwargs))
        return sources[0]

    run = train(PPOConfig(**_CFG), run_dir=tmp_path / "run", console_enabled=False, rollout=backend)
    source = sources[0]
    # Published once at the start (version 0) and once after each of the 4 updates, numbered by update.
    assert source.published == [0, 1, 2, 3, 4]
    # The first rollout acts with the initial weights (the learner's own); every later one a version behind.
    assert [m[LAG] for m in run.metrics] == [0.0, 1.0, 1.0, 1.0]
    with open(run.run_dir / "metrics.csv") as f:
        assert [float(row[LAG]) for row in csv.DictReader(f)] == [0.0, 1.0, 1.0, 1.0]
    # The last batch was acted by version 2 (the learner was at 3); since the last publish the source acts with
    # version 3's weights, a copy, while the learner holds version 4.
    assert bool((source.buffer.policy_version == 2).all())
    snapshot = source.snapshots[3]
    assert all(torch.equal(v, snapshot[k]) for k, v in source.behind.state_dict().items())
    assert not all(torch.equal(v, snapshot[k]) for k, v in run.policy.state_dict().items())


def test_the_in_process_source_is_published_each_update_and_logs_no_lag(tmp_path):
    published = []

    class Recording:
        def __init__(self, *args, **kwargs):
            self._local = Collector(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.__dict__["_local"], name)

        def publish(self, weights, version):
            published.append((weights, version))
            self._local.publish(weights, version)

    run = train(PPOConfig(**_CFG), run_dir=tmp_path / "run", console_enabled=False, rollout=Recording)
    assert [v for _, v in published] == [0, 1, 2, 3, 4]
    assert all(w is run.policy for w, _ in published)  # in process: the live policy, nothing copied
    # Lag 0 by construction: the column is not logged (the metrics of in-process runs are what they were).
    assert all(LAG not in m for m in run.metrics)


# ------------------------------------------------------------------ one loop for the four users


class NaNAtThird(gym.Env):
    """Episodes of 5 steps of reward 1, except the 3rd step's reward, which is NaN; observation [t / 5]."""

    observation_space = gym.spaces.Box(-1.0, 2.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        reward = float("nan") if self.t == 3 else 1.0
        return np.array([self.t / 5], np.float32), reward, self.t == 5, False, {}


def _policy():
    torch.manual_seed(0)
    return build_policy(NaNAtThird.observation_space, NaNAtThird.action_space, [8], "tanh")


def _rollout_episodes(num_envs: int, one_env_path: bool) -> tuple[list, int]:
    envs = gym.vector.SyncVectorEnv([NaNAtThird] * num_envs)
    policy = _policy()

    def fail(*args, **kw):
        raise AssertionError(f"unexpected env failure {args} {kw}")

    col = Collector(envs, policy, policy, num_steps=12, device=torch.device("cpu"), env_id="nan", obs_norm=None,
                    reward_scaler=None, perf={"env": 0.0, "inference": 0.0}, fail=fail)
    col.one_env_path = one_env_path
    col._one_env = col._one_env and one_env_path
    assert col._one_env == one_env_path  # the one-env path applies to one sync env on the CPU
    try:
        col.reset(0)
        return col.collect(0)
    finally:
        envs.close()


def test_a_nan_reward_counts_the_same_in_the_rollout_the_gate_and_agent_evaluate():
    # The rollout (the general loop with 2 envs, the one-env path with 1): the NaN step is counted, zeroed and
    # left out of the episode statistics, so each 5-step episode has return 4 over 4 valid steps.
    for num_envs, one_env_path in ((2, False), (1, True), (1, False)):
        episodes, nonfinite = _rollout_episodes(num_envs, one_env_path)
        assert episodes and all(e == (4.0, 4) for e in episodes), (num_envs, one_env_path, episodes)
        assert nonfinite == 2 * num_envs  # 12 steps: two episodes' 3rd steps in each env
    # The evaluation gate and Agent.evaluate step the same loop: the same episode, the same return (not NaN).
    envs = gym.vector.SyncVectorEnv([NaNAtThird] * 3)
    policy = _policy()
    try:
        gate = evaluate_first_episodes(envs, policy, policy.actor, lambda x: x, seed=1, max_steps=50,
                                       env_id="nan", global_step=0, fail=lambda phase, exc: exc,
                                       watchdog=NO_WATCHDOG)
    finally:
        envs.close()
    assert gate == 4.0
    agent = Agent(_policy(), PPOConfig(env_id="CartPole-v1"))
    result = evaluate(agent, env=NaNAtThird, episodes=2)
    assert result["returns"] == [4.0, 4.0] and result["lengths"] == [4, 4]
