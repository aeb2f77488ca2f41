"""The recurrent acting kernel (``kernels.recurrent_acting``) against the eager ``RecurrentActorCritic.act``, its
reference: the same actions for the same RNG state and the same numbers to rounding, for every cell, critic
layout, action kind, mask and activation; it follows the weights after optimizer steps (torch's fused Adam moves no
version counter) and ``load_state_dict``; the trainer acts with it unless ``fused_update`` is off, and still starts
each update at ratio exactly 1 (pi_old's log-probs from one replay)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from ppokit.config.ppo_config import PPOConfig
from ppokit.kernels.recurrent_acting import RecurrentActingKernel
from ppokit.policies import RecurrentActorCritic
from ppokit.training.trainer import Trainer

CELLS = [("lstm", "separate"), ("lstm", "shared"), ("gru", "separate"), ("gru", "shared")]
KINDS = [("discrete", [4]), ("multidiscrete", [2, 3]), ("continuous", [2])]


def _policy(cell, critic, kind, dims, activation="tanh", hidden=(16,), seed=0):
    torch.manual_seed(seed)
    return RecurrentActorCritic(3, kind, list(dims), list(hidden), activation, cell=cell, recurrent_hidden=8,
                                critic=critic)


def _inputs(policy, B=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(B, 3, generator=g)
    state = torch.randn(B, policy.state_size, 8, generator=g)  # mid-episode states: every gate and core matters
    starts = np.zeros(B, dtype=bool)
    starts[[1, 4]] = True  # and two envs starting an episode: their state is reset first
    mask = None
    if policy.kind != "continuous":
        mask = torch.rand(B, sum(policy.action_dims), generator=g) < 0.6
        mask[:, 0] = True
        if policy.kind == "multidiscrete":
            mask[:, policy.action_dims[0]] = True
    return obs, state, starts, mask


def _both(policy, kernel, obs, state, starts, mask=None, deterministic=False, seed=7):
    out = []
    for acting in (policy, kernel):
        torch.manual_seed(seed)
        with torch.inference_mode():
            out.append(acting.act(obs, state.clone(), starts, mask, deterministic=deterministic))
    return out


def _assert_same(ref, got):
    # The same actions: the same random numbers, drawn the same way (Gaussian ones to rounding: mean + std * noise).
    if ref[0].is_floating_point():
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(ref[0], got[0])
    for a, b in zip(ref[1:], got[1:]):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cell,critic", CELLS)
@pytest.mark.parametrize("kind,dims,masked", [(k, d, m) for k, d in KINDS for m in (False, True)
                                              if not (m and k == "continuous")])  # no masks on continuous actions
def test_the_kernel_acts_as_the_eager_policy_does(cell, critic, kind, dims, masked):
    policy = _policy(cell, critic, kind, dims)
    kernel = RecurrentActingKernel(policy)
    obs, state, starts, mask = _inputs(policy)
    mask = mask if masked else None
    for deterministic in (False, True):
        ref, got = _both(policy, kernel, obs, state, starts, mask, deterministic)
        _assert_same(ref, got)
    # The reset rows start from zeros, the others from their state: a kernel that ignored either would differ.
    fresh, _ = _both(policy, kernel, obs, torch.zeros_like(state), np.zeros(6, dtype=bool))
    assert torch.allclose(fresh[3][starts], ref[3][starts]) and not torch.allclose(fresh[3][~starts], ref[3][~starts])


@pytest.mark.parametrize("activation,hidden", [("relu", (16,)), ("tanh", (16, 12)), ("tanh", ())])
def test_the_kernel_acts_as_the_eager_policy_does_for_every_head_depth_and_activation(activation, hidden):
    policy = _policy("lstm", "separate", "discrete", [3], activation, hidden)
    kernel = RecurrentActingKernel(policy)
    obs, state, starts, _ = _inputs(policy)
    _assert_same(*_both(policy, kernel, obs, state, starts))


@pytest.mark.parametrize("fused", [True, False])
def test_the_kernel_follows_optimizer_steps_and_loaded_weights(fused):
    policy = _policy("lstm", "separate", "discrete", [4])
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.05, fused=fused, foreach=not fused)
    kernel = RecurrentActingKernel(policy, optimizer)
    obs, state, starts, _ = _inputs(policy)
    before = [t.clone() for t in _both(policy, kernel, obs, state, starts)[1]]
    for _ in range(2):  # the policy moves: a kernel still on its first weights would act as before
        optimizer.zero_grad()
        logp, _, values = policy.evaluate_sequence(obs.unsqueeze(0), before[0].unsqueeze(0), state,
                                                   torch.as_tensor(starts).unsqueeze(0))
        (values.square().mean() - logp.mean()).backward()
        optimizer.step()
        ref, got = _both(policy, kernel, obs, state, starts)
        _assert_same(ref, got)
        assert (ref[2] - before[2]).abs().max() > 1e-3
    other = _policy("lstm", "separate", "discrete", [4], seed=5)
    policy.load_state_dict(copy.deepcopy(other.state_dict()))
    _assert_same(*_both(other, kernel, obs, state, starts))


def _trainer(tmp_path, name, **kw):
    cfg = PPOConfig(env_id="ppokit/CartPoleNoVel-v1", num_envs=3, num_steps=32, total_timesteps=2 * 3 * 32,
                    num_minibatches=2, update_epochs=2, seed=0, tensorboard=False, recurrent="lstm",
                    recurrent_hidden=16, hidden_sizes=[16], run_dir=str(tmp_path / name), **kw)
    return Trainer(cfg, console_enabled=False)


@pytest.mark.parametrize("seq_len", [0, 8])
def test_the_trainer_acts_with_the_kernel_and_each_update_starts_at_ratio_exactly_one(tmp_path, seq_len):
    """The rollout's log-probs are the kernel's (equal to the replay's to rounding only), so pi_old's are taken
    from one replay of the update's chunks: the first minibatch's replay equals them bit for bit."""
    trainer = _trainer(tmp_path, "k", recurrent_seq_len=seq_len)
    try:
        assert isinstance(trainer.acting, RecurrentActingKernel)
        trainer.collect_rollout()
    finally:
        trainer.envs.close()
    kernel_logp = trainer.buffer.logp.clone()
    batch, advantages, returns = trainer.compute_advantages()
    seq = trainer.update_batch(batch, advantages, returns)
    logp, _, _ = trainer.policy.evaluate_sequence(seq.obs, seq.actions, seq.state0, seq.episode_start)
    assert torch.equal(logp.detach()[seq.mask], seq.logp_old[seq.mask])
    # The replay's pi_old is the kernel's policy: the same log-probs to rounding (not another policy's).
    replay = trainer.buffer.sequences(seq_len or 32, advantages, returns)
    torch.testing.assert_close(seq.logp_old[seq.mask], replay.logp_old[replay.mask], rtol=1e-5, atol=1e-6)
    assert torch.equal(replay.logp_old[replay.mask].sort().values, kernel_logp.flatten().sort().values)


def test_fused_update_off_acts_with_the_eager_policy(tmp_path):
    trainer = _trainer(tmp_path, "e", fused_update=False)
    trainer.envs.close()
    assert trainer.acting is None
