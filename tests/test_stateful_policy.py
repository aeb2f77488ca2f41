"""The stateful policy protocol (``policies.Policy``): whoever steps envs starts from ``initial_state``, passes
back the state each ``act`` returned and says where an episode starts. A toy stateful policy, registered here
with ``register_policy`` (for the test that needs it), trains through the real trainer (general and one-env loops, the evaluation gate), loads
and acts through ``Agent.predict``; the built-in policies and the acting kernel are stateless (state None).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import ppokit
from ppokit.config.ppo_config import ConfigError, PPOConfig
from ppokit.envs import make_vec_env
from ppokit.kernels.acting import ActingKernel
from ppokit.policies import ActorCritic, EncoderActorCritic, build_policy, register_policy, registry
from ppokit.rollout.collector import Collector

EPISODE = 5  # steps per episode of _Fixed


class StepCounter(ActorCritic):
    """An MLP actor-critic whose state is, per env, how many times it acted in the current episode (reset where
    ``episode_start``); each ``act`` is recorded as (state in, episode_start, state out, deterministic)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[tuple[torch.Tensor, np.ndarray, torch.Tensor, bool]] = []

    def initial_state(self, num_envs: int) -> torch.Tensor:
        return torch.zeros(num_envs, dtype=torch.long)

    def act(self, obs, state, episode_start, action_mask=None, deterministic=False):
        actions, logp, values, none = super().act(obs, None, episode_start, action_mask, deterministic)
        assert none is None
        starts = np.array(episode_start, dtype=bool)
        out = torch.where(torch.as_tensor(starts), 0, state) + 1
        self.calls.append((state.clone(), starts, out, deterministic))
        return actions, logp, values, out

    def evaluate_sequence(self, obs, actions, state0, episode_start, action_mask=None):
        """The counter changes no output: the chunk's steps evaluated as rows, ``[L, M]`` each."""
        L, M = episode_start.shape

        def rows(x):
            return None if x is None else x.reshape(L * M, *x.shape[2:])

        logp, entropy, values = self.evaluate(rows(obs), rows(actions), rows(action_mask))
        return logp.reshape(L, M), entropy.reshape(L, M), values.reshape(L, M)

    def spec(self) -> dict:
        return {**super().spec(), "type": "test_step_counter"}


@pytest.fixture
def step_counter_type(monkeypatch):
    """``StepCounter`` registered as ``"test_step_counter"`` for one test: the registry is restored after it, so
    the other tests see only ppokit's own types."""
    monkeypatch.setattr(registry, "_POLICY_TYPES", dict(registry._POLICY_TYPES))
    register_policy("test_step_counter", StepCounter)


def counter_factory(obs_space, act_space, cfg) -> StepCounter:
    policy = build_policy(obs_space, act_space, cfg.hidden_sizes, cfg.activation)
    spec = {k: v for k, v in policy.spec().items() if k != "type"}
    return StepCounter(**spec)


class _Fixed(gym.Env):
    """Box(3) observations, 2 actions, every episode exactly ``EPISODE`` steps (truncated)."""

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {}

    def step(self, action):
        self.t += 1
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), float(action), False, self.t >= EPISODE, {}


def test_a_stateful_policy_without_evaluate_sequence_is_refused_in_one_line(tmp_path, step_counter_type,
                                                                           monkeypatch):
    monkeypatch.delattr(StepCounter, "evaluate_sequence")
    cfg = PPOConfig(num_envs=2, num_steps=8, total_timesteps=16, hidden_sizes=[8], tensorboard=False)
    with pytest.raises(ConfigError, match="StepCounter is stateful .* has no evaluate_sequence") as info:
        ppokit.train(cfg, run_dir=tmp_path / "r", console_enabled=False, env=_Fixed, policy=counter_factory)
    assert "\n" not in str(info.value)


def _threaded(calls) -> None:
    """Each call got back the state the call before it returned; the first started from the initial state."""
    assert torch.equal(calls[0][0], torch.zeros_like(calls[0][0])) and calls[0][1].all()
    for (_, _, out, _), (state_in, _, _, _) in zip(calls, calls[1:]):
        assert torch.equal(state_in, out)


@pytest.mark.parametrize("num_envs", [1, 2])  # 1: the one-env loop (one_env.py); 2: the general loop
def test_a_stateful_policy_trains_and_gets_its_state_back_each_step(num_envs, tmp_path, step_counter_type):
    num_steps, updates = 12, 3  # 12 is no multiple of the episode: episodes run across rollouts
    cfg = PPOConfig(num_envs=num_envs, num_steps=num_steps, total_timesteps=updates * num_steps * num_envs,
                    num_minibatches=2, update_epochs=1, hidden_sizes=[8], seed=0, tensorboard=False,
                    eval_every=1, eval_episodes=2, eval_threshold=1e9)
    run = ppokit.train(cfg, run_dir=tmp_path / "r", console_enabled=False, env=_Fixed, policy=counter_factory)
    policy = run.policy
    assert type(policy) is StepCounter and len(run.metrics) == updates
    rollout = [c for c in policy.calls if not c[3]]
    # The fused path refuses a stateful policy, so the policy itself acted: once per step, every env at once.
    assert len(rollout) == updates * num_steps and all(c[0].shape == (num_envs,) for c in rollout)
    _threaded(rollout)
    for k, (_, starts, out, _) in enumerate(rollout):
        # SAME_STEP autoreset (sync envs): episode_start is True exactly where the step before ended an episode.
        assert starts.tolist() == [k % EPISODE == 0] * num_envs, k
        assert out.tolist() == [k % EPISODE + 1] * num_envs, k
    # The evaluation gate (after each update) acts deterministically, from a fresh state, for one episode.
    gate = [c for c in policy.calls if c[3]]
    assert len(gate) == updates * EPISODE
    for i in range(updates):
        calls = gate[i * EPISODE:(i + 1) * EPISODE]
        _threaded(calls)
        assert [c[2].tolist() for c in calls] == [[k + 1] * 2 for k in range(EPISODE)]

    # Loaded, it acts through predict (SB3's shape), and evaluate carries its state through each episode.
    agent = ppokit.load(run.run_dir, env=_Fixed)
    assert type(agent.policy) is StepCounter
    obs = _Fixed.observation_space.sample()
    with pytest.raises(ValueError, match="agent.predict"):
        agent.act(obs)
    action, state = agent.predict(obs)
    assert action in (0, 1) and state.tolist() == [1]
    assert agent.predict(obs, state, episode_start=np.array([False]))[1].tolist() == [2]
    assert agent.predict(obs, state, episode_start=np.array([True]))[1].tolist() == [1]
    with pytest.raises(ValueError, match="episode_start has 2 entries, expected 1"):
        agent.predict(obs, state, episode_start=[True, False])
    agent.policy.calls.clear()
    result = ppokit.evaluate(agent, env=_Fixed, episodes=2)
    assert result["lengths"] == [EPISODE, EPISODE]
    assert [c[2].tolist() for c in agent.policy.calls] == [[k + 1] for k in range(EPISODE)] * 2
    assert [bool(c[1][0]) for c in agent.policy.calls] == [k == 0 for k in range(EPISODE)] * 2


def test_next_step_autoreset_marks_the_first_observation_after_the_reset_step():
    envs = make_vec_env("CartPole-v1", 3, 0, "native")  # NEXT_STEP autoreset
    try:
        torch.manual_seed(0)
        policy = counter_factory(envs.single_observation_space, envs.single_action_space,
                                 PPOConfig(hidden_sizes=[8]))
        col = Collector(envs, policy, policy, num_steps=64, device=torch.device("cpu"), env_id="CartPole-v1",
                        obs_norm=None, reward_scaler=None, perf={"env": 0.0, "inference": 0.0},
                        fail=lambda *a, **k: AssertionError(a))
        assert not col.same_step
        col.reset(seed=0)
        done = []
        for rollout in range(2):  # the state and episode_start carry into the next rollout
            col.collect(rollout * 64 * 3)
            done.append((col.buffer.terminated + col.buffer.truncated).bool().numpy())
        done = np.concatenate(done)  # [128, 3]
        assert done.any()
        _threaded(policy.calls)
        starts = np.stack([c[1] for c in policy.calls])
        # The step after an episode end only resets the env (no transition); the observation after that reset
        # is the episode's first: episode_start is True there, two steps after the end, and nowhere else.
        assert starts.shape == (128, 3) and starts[0].all() and not starts[1].any()
        np.testing.assert_array_equal(starts[2:], done[:-2])
    finally:
        envs.close()


def test_the_built_in_policies_and_the_acting_kernel_are_stateless():
    torch.manual_seed(0)
    mlp = ActorCritic(4, "discrete", [3], [8], "tanh")
    image = build_policy(spaces.Box(0, 255, (1, 36, 36), np.uint8), spaces.Discrete(3), [8], "tanh")
    assert isinstance(image, EncoderActorCritic)
    obs = torch.randn(5, 4)
    starts = np.ones(5, dtype=bool)
    with torch.inference_mode():
        assert mlp.initial_state(5) is None and mlp.act(obs, None, starts)[3] is None
        assert image.initial_state(5) is None
        assert image.act(torch.zeros(5, 1, 36, 36, dtype=torch.uint8), None, starts)[3] is None
        assert ActingKernel(mlp).act(obs, None, starts)[3] is None
