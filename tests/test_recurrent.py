"""Recurrent policies (``policies.recurrent``): CleanRL's init, the state reset at every episode start in both
autoreset modes, ``evaluate_sequence`` replaying exactly what ``act`` computed, the config and CLI fields, the
CartPoleNoVel env and preset, and the planner's proposal. Training through sequence minibatches, checkpoints,
resume, ``Agent.predict`` and ``ppokit eval`` of recurrent runs are in ``test_recurrent_training.py``.
"""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import ppokit  # noqa: F401  (registers ppokit's envs)
from ppokit.config.planner import make_plan, memory_reason
from ppokit.config.ppo_config import ConfigError, PPOConfig, load_preset
from ppokit.envs.encoders import observation_encoder
from ppokit.policies import RecurrentActorCritic, config_policy, policy_from_spec
from ppokit.policies.recurrent import _segments, _stepped
from ppokit.rollout.collector import Collector

CELLS = [("lstm", "separate"), ("lstm", "shared"), ("gru", "separate"), ("gru", "shared")]


def _policy(cell="lstm", critic="separate", kind="discrete", dims=(3,), obs_dim=3, encoding=None, seed=0):
    torch.manual_seed(seed)
    return RecurrentActorCritic(obs_dim, kind, list(dims), [16], "tanh", obs_encoding=encoding, cell=cell,
                                recurrent_hidden=8, critic=critic)


# ------------------------------------------------------------------------------------------------ init
@pytest.mark.parametrize("cell,critic", CELLS)
def test_the_cores_start_as_cleanrl_inits_them_and_the_state_at_zeros(cell, critic):
    policy = _policy(cell, critic)
    cores = [policy.actor_core] + ([policy.critic_core] if critic == "separate" else [])
    assert (policy.critic_core is None) == (critic == "shared")
    for core in cores:
        for name, p in core.named_parameters():
            if name.startswith("bias"):
                assert torch.equal(p, torch.zeros_like(p)), name
            else:  # orthogonal with gain 1: the columns (fewer than the rows) are orthonormal
                gram = p.detach().T @ p.detach()
                assert torch.allclose(gram, torch.eye(gram.shape[0]), atol=1e-5), name
    state = policy.initial_state(5)
    assert state.shape == (5, (2 if cell == "lstm" else 1) * len(cores), 8) and not state.any()


def test_without_ortho_init_every_layer_gets_pytorchs_default_init():
    cfg = PPOConfig(recurrent="lstm", recurrent_hidden=8, hidden_sizes=[16], ortho_init=False)
    torch.manual_seed(0)
    policy = config_policy(spaces.Box(-1, 1, (3,)), spaces.Discrete(2), cfg)
    w = policy.actor_core.weight_hh_l0.detach()
    # nn.LSTM's own init: uniform in +-1/sqrt(hidden), biases too; no longer orthogonal, biases not zero.
    assert w.abs().max() <= 1 / np.sqrt(8) and policy.actor_core.bias_ih_l0.abs().sum() > 0
    assert not torch.allclose(w.T @ w, torch.eye(8), atol=1e-2)
    assert policy.actor_head[-1].weight.abs().max() <= 1 / np.sqrt(16)  # not the 0.01-gain orthogonal head


# ------------------------------------------------------------------------------------------------ replay
def _stepped_act(policy, obs, state, starts, masks=None):
    """Act step by step over ``obs [L, N, ...]`` as the collector does; the buffer's view of it."""
    L = starts.shape[0]
    actions, logps, values = [], [], []
    with torch.inference_mode():
        for t in range(L):
            obs_t = {k: v[t] for k, v in obs.items()} if isinstance(obs, dict) else obs[t]
            a, lp, v, state = policy.act(obs_t, state, starts[t].numpy(), None if masks is None else masks[t])
            actions.append(a)
            logps.append(lp)
            values.append(v)
    return torch.stack(actions), torch.stack(logps), torch.stack(values)


@pytest.mark.parametrize("cell,critic", CELLS)
@pytest.mark.parametrize("kind,dims", [("discrete", [4]), ("multidiscrete", [2, 3]), ("continuous", [2])])
def test_evaluate_sequence_replays_exactly_what_act_computed(cell, critic, kind, dims):
    policy = _policy(cell, critic, kind, dims)
    L, N = 24, 6
    gen = torch.Generator().manual_seed(1)
    obs = torch.randn(L, N, 3, generator=gen)
    starts = torch.rand(L, N, generator=gen) < 0.15
    starts[0, 0] = True
    state0 = torch.randn(N, policy.state_size, 8, generator=gen)  # a chunk that continues earlier episodes
    masks = None
    if kind != "continuous":
        masks = torch.rand(L, N, sum(dims), generator=gen) < 0.7
        masks[..., 0] = True  # at least one allowed action per sub-action
        if kind == "multidiscrete":
            masks[..., dims[0]] = True
    actions, logp, values = _stepped_act(policy, obs, state0.clone(), starts, masks)
    logp_new, entropy, values_new = policy.evaluate_sequence(obs, actions, state0, starts, masks)
    assert logp_new.shape == entropy.shape == values_new.shape == (L, N)
    # The first ratio of an update is exactly 1: the same log-probs, bit for bit.
    assert torch.equal(logp_new.detach(), logp)
    torch.testing.assert_close(values_new.detach(), values, rtol=0, atol=1e-6)
    assert torch.isfinite(entropy).all() and logp_new.requires_grad
    # Both replays (one padded call over the stretches between resets, or one step at a time) compute the same
    # numbers, but not bit for bit on every CPU: on one CI machine the LSTM stepped with gradients on differed in
    # the last bits from the same cells over whole stretches (equal bit for bit here), while the padded call still
    # equalled act's bit for bit (the assertion above, which the trainer's first ratio rests on).
    feats = policy.trunk(obs.reshape(L * N, 3)).reshape(L, N, -1)
    for a, b in zip(_segments(policy, feats, state0, starts), _stepped(policy, feats, state0, starts)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_evaluate_sequence_differs_when_the_chunk_starts_from_another_state():
    """state0 matters: a chunk replayed from zeros instead of its stored state gives other log-probs (so a
    sequence minibatch that dropped state0 would show ratios != 1)."""
    policy = _policy()
    L, N = 8, 4
    obs = torch.randn(L, N, 3)
    starts = torch.zeros(L, N, dtype=torch.bool)
    state0 = torch.randn(N, policy.state_size, 8)
    actions, logp, _ = _stepped_act(policy, obs, state0.clone(), starts)
    from_zeros, _, _ = policy.evaluate_sequence(obs, actions, torch.zeros_like(state0), starts)
    assert not torch.allclose(from_zeros.detach(), logp, atol=1e-4)
    # ... unless an episode starts at the chunk's first step: then state0 is not read.
    starts[0] = True
    actions, logp, _ = _stepped_act(policy, obs, state0.clone(), starts)
    assert torch.equal(policy.evaluate_sequence(obs, actions, torch.zeros_like(state0), starts)[0].detach(), logp)


@pytest.mark.parametrize("space", ["image", "dict"])
def test_images_and_dicts_go_through_the_cnn_trunk_and_replay_exactly(space):
    if space == "image":
        obs_space = spaces.Box(0, 255, (1, 36, 36), np.uint8)
    else:
        obs_space = spaces.Dict({"pixels": spaces.Box(0, 255, (36, 36, 1), np.uint8),
                                 "pos": spaces.Box(-1, 1, (2,), np.float32), "key": spaces.Discrete(3)})
    cfg = PPOConfig(recurrent="gru", recurrent_hidden=8, hidden_sizes=[16])
    torch.manual_seed(0)
    policy = config_policy(obs_space, spaces.Discrete(3), cfg)
    assert type(policy) is RecurrentActorCritic and policy.trunk.out_dim >= 512  # the Nature CNN's features
    encoder = observation_encoder(obs_space)
    L, N = 5, 3
    raw = [[obs_space.sample() for _ in range(N)] for _ in range(L)]
    if space == "image":
        obs = torch.stack([torch.as_tensor(encoder.encode(np.stack(r), N)) for r in raw])
    else:
        steps = [encoder.encode({k: np.stack([o[k] for o in r]) for k in obs_space.spaces}, N) for r in raw]
        obs = {k: torch.stack([torch.as_tensor(s[k]) for s in steps]) for k in steps[0]}
    starts = torch.zeros(L, N, dtype=torch.bool)
    starts[2, 1] = True
    state0 = policy.initial_state(N)
    actions, logp, _ = _stepped_act(policy, obs, state0.clone(), starts)
    logp_new, _, _ = policy.evaluate_sequence(obs, actions, state0, starts)
    torch.testing.assert_close(logp_new.detach(), logp, rtol=0, atol=1e-6)


def test_the_spec_rebuilds_the_same_network():
    policy = _policy("gru", "shared", "continuous", [2])
    rebuilt = policy_from_spec(policy.spec())
    rebuilt.load_state_dict(policy.state_dict())
    assert type(rebuilt) is RecurrentActorCritic and rebuilt.spec() == policy.spec()
    obs, state = torch.randn(4, 3), torch.randn(4, 1, 8)
    with torch.inference_mode():
        torch.manual_seed(3)
        a = policy.act(obs, state, np.zeros(4, bool))
        torch.manual_seed(3)
        b = rebuilt.act(obs, state, np.zeros(4, bool))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------ resets
class _Timed(gym.Env):
    """Box(2) observations, 2 actions; an episode ends by termination when action 1 is taken at an odd step,
    else by truncation after 4 steps: both ends occur, at varied times."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.uniform(-1, 1, 2).astype(np.float32), {}

    def step(self, action):
        self.t += 1
        obs = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return obs, 1.0, bool(action == 1 and self.t % 2 == 1), self.t >= 4, {}


@pytest.mark.parametrize("mode", [gym.vector.AutoresetMode.SAME_STEP, gym.vector.AutoresetMode.NEXT_STEP])
def test_the_state_is_reset_at_every_episode_start_in_both_autoreset_modes(mode):
    """Where an episode starts (after a termination or a truncation), the rollout's value is the fresh state's:
    the state was reset there, and nowhere else."""
    N, T = 3, 40
    envs = gym.vector.SyncVectorEnv([_Timed for _ in range(N)], autoreset_mode=mode)
    policy = _policy(obs_dim=2, dims=[2])
    try:
        col = Collector(envs, policy, policy, num_steps=T, device=torch.device("cpu"), env_id="timed",
                        obs_norm=None, reward_scaler=None, perf={"env": 0.0, "inference": 0.0},
                        fail=lambda *a, **k: AssertionError(a))
        col.one_env_path = False
        col.reset(seed=0)
        torch.manual_seed(0)
        col.collect(0)
        buf = col.buffer
        done = (buf.terminated | buf.truncated).numpy()
        assert buf.terminated.any() and buf.truncated.any()
        # An episode's first observation: step 0, then the step after an end (SAME_STEP) or the one after the
        # reset-only step that follows an end (NEXT_STEP).
        lag = 1 if mode == gym.vector.AutoresetMode.SAME_STEP else 2
        first = np.zeros((T, N), dtype=bool)
        first[0] = True
        first[lag:] |= done[:-lag]
        with torch.inference_mode():
            fresh = policy.value(buf.obs.reshape(T * N, 2)).reshape(T, N)
        same = (fresh - buf.values).abs() < 1e-6
        np.testing.assert_array_equal(same.numpy(), first)
    finally:
        envs.close()


class _Recording(RecurrentActorCritic):
    """Records the state each ``act`` returned and the state each ``value`` call was given."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.acted: list[torch.Tensor] = []
        self.valued: list[torch.Tensor | None] = []

    def act(self, *args, **kwargs):
        out = super().act(*args, **kwargs)
        self.acted.append(out[3].clone())
        return out

    def value(self, obs, state=None, episode_start=None):
        self.valued.append(None if state is None else state.clone())
        return super().value(obs, state, episode_start)


def test_the_rollouts_values_at_truncations_and_its_last_read_the_envs_live_state():
    """SAME_STEP truncations bootstrap V(final obs) from the state the episode's last action left, and GAE's last
    value is read from the state after the rollout (not from a fresh state)."""
    from ppokit.rollout.collector import bootstrap_values

    N, T = 2, 10
    envs = gym.vector.SyncVectorEnv([_Timed for _ in range(N)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    torch.manual_seed(0)
    policy = _Recording(obs_dim=2, kind="discrete", action_dims=[2], hidden_sizes=[16], recurrent_hidden=8)
    try:
        col = Collector(envs, policy, policy, num_steps=T, device=torch.device("cpu"), env_id="timed",
                        obs_norm=None, reward_scaler=None, perf={"env": 0.0, "inference": 0.0},
                        fail=lambda *a, **k: AssertionError(a))
        col.reset(seed=1)
        torch.manual_seed(1)
        col.collect(0)
        truncations = [(t, np.flatnonzero(row.numpy())) for t, row in enumerate(col.buffer.has_final)]
        truncations = [(t, idx) for t, idx in truncations if len(idx)]
        assert truncations and len(policy.valued) == len(truncations)
        for (t, idx), given in zip(truncations, policy.valued):
            assert given is not None and torch.equal(given, policy.acted[t][idx])
        with torch.inference_mode():
            fresh_last = policy.value(col.last_obs)
            live_last = policy.value(col.last_obs, col.policy_state, col.episode_start)
        assert torch.equal(bootstrap_values(policy, col), live_last)
        assert not col.episode_start.all() and not torch.allclose(live_last, fresh_last, atol=1e-6)
    finally:
        envs.close()


# ------------------------------------------------------------------------------------------------ config
def test_the_config_fields_are_validated_with_one_line_each():
    for field, value, reason in [("recurrent", "rnn", "must be one of none, lstm, gru"),
                                 ("recurrent_critic", "both", "must be one of separate, shared"),
                                 ("recurrent_hidden", 0, "must be an integer in [1, 65536]")]:
        with pytest.raises(ConfigError, match=re.escape(reason)) as info:
            PPOConfig(**{field: value}).validate()
        assert info.value.field == field and "\n" not in str(info.value)
    assert PPOConfig().recurrent == "none" and PPOConfig().recurrent_hidden == 128


def test_the_preset_is_rl_zoos_cartpolenovel_settings():
    cfg = load_preset("cartpole-novel")
    expected = dict(env_id="ppokit/CartPoleNoVel-v1", num_envs=8, num_steps=32, num_minibatches=1,
                    update_epochs=20, gamma=0.98, gae_lambda=0.8, learning_rate=1e-3, anneal_lr=True,
                    clip_coef=0.2, anneal_clip=True, ent_coef=0.0, normalize_obs=True, normalize_reward=True,
                    recurrent="lstm", recurrent_hidden=64, recurrent_critic="separate", activation="relu",
                    hidden_sizes=[64], ortho_init=False, total_timesteps=100_000,
                    # RL-Zoo's EvalCallback (best model kept) as the evaluation gate, stopping at the time limit
                    eval_every=10, eval_episodes=10, eval_threshold=500.0)
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.batch_size == 256
    cfg.validate()


def test_the_cartpole_without_velocities_env_observes_x_and_theta():
    full, novel = gym.make("CartPole-v1"), gym.make("ppokit/CartPoleNoVel-v1")
    try:
        assert novel.observation_space.shape == (2,) and novel.spec.max_episode_steps == 500
        a, _ = full.reset(seed=3)
        b, _ = novel.reset(seed=3)
        np.testing.assert_array_equal(b, a[[0, 2]])
        for action in [0, 1, 1, 0, 1]:
            a, ra, ta, _, _ = full.step(action)
            b, rb, tb, _, _ = novel.step(action)
            np.testing.assert_array_equal(b, a[[0, 2]])
            assert (ra, ta) == (rb, tb)
    finally:
        full.close()
        novel.close()
    from ppokit.envs import make_vec_env

    envs = make_vec_env("ppokit/CartPoleNoVel-v1", 3, 0, "native")  # gymnasium's batched CartPole, sliced
    try:
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (3, 2) and envs.single_observation_space.shape == (2,)
        assert envs.step(np.zeros(3, dtype=np.int64))[0].shape == (3, 2)
    finally:
        envs.close()


def test_the_planner_proposes_a_recurrent_policy_for_observations_that_are_not_markov():
    plan = make_plan("ppokit/CartPoleNoVel-v1", 100_000, probe=False)
    assert plan.config.recurrent == "lstm" and plan.config.recurrent_hidden == 64
    assert "hides the cart's and the pole's velocities" in plan.reasons["recurrent"]
    assert "--recurrent lstm" in plan.to_markdown()
    assert memory_reason("CartPole-v1") is None and "memory task" in memory_reason("MiniGrid-MemoryS7-v0")
    assert make_plan("CartPole-v1", 100_000, probe=False).config.recurrent == "none"


def test_recurrent_runs_take_the_autograd_update_and_the_memory_check_counts_the_cores():
    from ppokit.kernels.mlp_backward import supports as fused_supports
    from ppokit.policies.build import policy_parameters

    cfg = PPOConfig(recurrent="lstm", recurrent_hidden=64, hidden_sizes=[64])
    obs, act = spaces.Box(-1, 1, (2,)), spaces.Discrete(2)
    policy = config_policy(obs, act, cfg)
    assert not fused_supports(policy, "ppo")
    # Two LSTM(2 -> 64) cores (4 gates: 4 * 64 * (2 + 64 + 2)) plus two heads of 64: counted on the meta device.
    assert policy_parameters(obs, act, cfg.hidden_sizes, cfg.activation, cfg) == \
        sum(p.numel() for p in policy.parameters()) == 2 * 4 * 64 * 68 + (64 * 64 + 64 + 64 * 2 + 2) + (64 * 64 + 64 + 65)
