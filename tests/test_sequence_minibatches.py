"""Sequence minibatches for stateful policies: each env's rollout cut into contiguous chunks of
``recurrent_seq_len`` steps, replayed in order from the state stored at each chunk's first step.

``TinyGRU`` (a GRU cell before linear heads, written here) is the stateful policy: it resets its state where
``episode_start`` is True, in ``act`` and in ``evaluate_sequence``. It trains through the real trainer.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from ppokit.config.ppo_config import PPOConfig
from ppokit.core.batch import Field
from ppokit.core.errors import ConfigError
from ppokit.policies import PolicyBase, action_spec, register_policy, registry
from ppokit.rollout.buffer import step_field_declared
from ppokit.training.trainer import Trainer
from ppokit.update.autograd import AutogradStep, sequence_minibatch_loss
from ppokit.update.epochs import SequenceBatch, ppo_epochs

HIDDEN = 6


class TinyGRU(PolicyBase):
    """``h_t = GRUCell(obs_t, 0 if episode_start_t else h_{t-1})``; logits and value are linear in ``h_t``. The
    state is ``[N, HIDDEN]`` (env axis first). float64 so that a batch of M chunks and one of N envs round alike."""

    def __init__(self, obs_dim: int, kind: str, action_dims: list[int]):
        super().__init__(kind, action_dims)
        self.obs_dim, self.obs_encoding = obs_dim, None
        self.cell = nn.GRUCell(obs_dim, HIDDEN, dtype=torch.float64)
        self.actor = nn.Linear(HIDDEN, self.n_out, dtype=torch.float64)
        self.critic = nn.Linear(HIDDEN, 1, dtype=torch.float64)

    def initial_state(self, num_envs: int) -> torch.Tensor:
        return torch.zeros(num_envs, HIDDEN, dtype=torch.float64)

    def _step(self, obs, h, starts):
        h = torch.where(torch.as_tensor(starts, device=h.device)[:, None], torch.zeros_like(h), h)
        return self.cell(obs.double(), h)

    def act(self, obs, state, episode_start, action_mask=None, deterministic=False):
        h = self._step(obs, state, np.array(episode_start, dtype=bool))
        head = self.actor(h)
        actions = self.sample(head, deterministic)
        logp, _ = self.log_prob_entropy(head, actions)
        return actions, logp.float(), self.critic(h).squeeze(-1).float(), h

    def evaluate_sequence(self, obs, actions, state0, episode_start, action_mask=None):
        h, out = state0, []
        for t in range(episode_start.shape[0]):
            h = self._step(obs[t], h, episode_start[t])
            logp, ent = self.log_prob_entropy(self.actor(h), actions[t])
            out.append((logp.float(), ent.float(), self.critic(h).squeeze(-1).float()))
        logp, ent, values = (torch.stack(x) for x in zip(*out))
        return logp, ent, values

    def value(self, obs, state=None, episode_start=None):
        # From the env's live state (the truncation bootstrap, GAE's last value); None: a fresh one.
        h = self.initial_state(obs.shape[0]) if state is None else state
        starts = np.zeros(obs.shape[0], dtype=bool) if episode_start is None else np.array(episode_start, dtype=bool)
        return self.critic(self._step(obs, h, starts)).squeeze(-1).float()

    def actor_head(self, obs):
        return self.actor(self.cell(obs.double(), self.initial_state(obs.shape[0])))

    def spec(self) -> dict:
        return {"type": "test_tiny_gru", "obs_dim": self.obs_dim, "kind": self.kind, "action_dims": self.action_dims}


@pytest.fixture(autouse=True)
def tiny_gru_type(monkeypatch):
    monkeypatch.setattr(registry, "_POLICY_TYPES", dict(registry._POLICY_TYPES))
    register_policy("test_tiny_gru", TinyGRU)


def gru_factory(obs_space, act_space, cfg):
    kind, dims = action_spec(act_space)
    return TinyGRU(int(np.prod(obs_space.shape)), kind, dims)


STAMP = Field("stamp", (), torch.long, batch="stamp", doc="t * N + n of the step (which step a row is)")


def make_trainer(tmp_path, seq_len=0, vector_mode="sync", num_steps=10, **kw):
    cfg = PPOConfig(env_id="CartPole-v1", num_envs=3, num_steps=num_steps, total_timesteps=2 * 3 * num_steps, num_minibatches=2,
                    update_epochs=2, seed=0, tensorboard=False, vector_mode=vector_mode,
                    recurrent_seq_len=seq_len, run_dir=str(tmp_path / "r"), **kw)
    return Trainer(cfg, console_enabled=False, policy=gru_factory)


def rollout_sequences(trainer):
    trainer.collect_rollout()
    buf = trainer.buffer
    T, N = buf.valid.shape
    if "stamp" in buf:  # declared by the test that asks which step a row is
        buf.stamp.copy_(torch.arange(T * N).reshape(T, N))
    batch, advantages, returns = trainer.compute_advantages()
    return trainer.update_batch(batch, advantages, returns)


class Recording:
    def __init__(self, step, seen):
        self.step, self.seen = step, seen

    def __getattr__(self, name):
        return getattr(self.step, name)

    def minibatches(self, perm, sizes):
        for mb in self.step.minibatches(perm, sizes):
            self.seen.append(mb)
            yield mb


@pytest.mark.parametrize("vector_mode", ["sync", "native"])  # native CartPole: NEXT_STEP, invalid reset steps
def test_chunks_are_contiguous_and_cover_every_valid_step_once_per_epoch(tmp_path, vector_mode):
    with step_field_declared(STAMP):
        # 30 steps (CartPole's random episodes end within them): chunks of 4, the eighth 2 steps and padding
        trainer = make_trainer(tmp_path, seq_len=4, vector_mode=vector_mode, num_steps=30)
        try:
            sb = rollout_sequences(trainer)
            buf = trainer.buffer
            assert isinstance(sb, SequenceBatch) and len(sb) == 8 * 3 and sb.mask.shape == (4, 24)
            T, N = buf.valid.shape
            for c in range(len(sb)):
                k, n = divmod(c, N)
                steps = list(range(k * 4, min(k * 4 + 4, T)))
                # Column c is env n's steps k*4 ... in order; past the rollout's end only padding (masked out).
                assert sb.stamp[: len(steps), c].tolist() == [t * N + n for t in steps]
                assert sb.mask[:, c].tolist() == [bool(buf.valid[t, n]) for t in steps] + [False] * (4 - len(steps))
                assert sb.episode_start[: len(steps), c].tolist() == [bool(buf.episode_start[t, n]) for t in steps]
                torch.testing.assert_close(sb.state0[c], buf.policy_state[k * 4, n], rtol=0, atol=0)
            seen = []
            settings = trainer.update_settings(0.2)
            ppo_epochs(sb, settings, Recording(AutogradStep(trainer.policy, trainer.optimizer), seen),
                       generator=torch.Generator().manual_seed(0))
            assert len(seen) == settings.update_epochs * settings.num_minibatches
            valid = sorted((buf.stamp[buf.valid]).tolist())
            for epoch in range(settings.update_epochs):
                mbs = seen[epoch * 2:(epoch + 1) * 2]
                assert all(mb.obs.shape[0] == 4 and mb.state0.shape[1:] == (HIDDEN,) for mb in mbs)
                assert sorted(s for mb in mbs for s in mb.stamp[mb.mask].tolist()) == valid
            assert sb.episode_start[1:][sb.mask[1:]].any()  # some chunk crosses an episode start
            if vector_mode == "native":
                assert len(valid) < T * N  # NEXT_STEP: the reset step after an episode end is left out
        finally:
            trainer.envs.close()


def test_padded_steps_get_exactly_zero_gradient(tmp_path):
    trainer = make_trainer(tmp_path, seq_len=4)
    try:
        sb = rollout_sequences(trainer)
    finally:
        trainer.envs.close()
    policy, settings = trainer.policy, trainer.update_settings(0.2)
    pad = torch.zeros_like(sb.mask)
    pad[2:, 6:] = True  # the third chunk of every env holds steps 8, 9 and two padded ones
    assert not sb.mask[pad].any() and sb.mask[~pad].any()

    def grads(mb):
        policy.zero_grad()
        obs = mb.obs.clone().requires_grad_(True)
        fields = dict(mb.items(), obs=obs)
        loss, _ = sequence_minibatch_loss(policy, SequenceBatch(**fields), settings)
        loss.backward()
        return [p.grad.clone() for p in policy.parameters()], obs.grad

    base, obs_grad = grads(sb)
    assert torch.equal(obs_grad[pad], torch.zeros_like(obs_grad[pad])) and obs_grad[~pad].abs().sum() > 0
    # Whatever the padding holds (finite), the gradient is bit for bit the same.
    g = torch.Generator().manual_seed(1)
    noisy = dict(sb.items())
    for name in ("obs", "logp_old", "values_old", "advantages", "returns"):
        x = noisy[name].clone()
        x[pad] = 50 * torch.randn(x[pad].shape, generator=g, dtype=x.dtype)
        noisy[name] = x
    again, _ = grads(SequenceBatch(**noisy))
    assert all(torch.equal(a, b) for a, b in zip(base, again))


class FirstStats:
    """An UpdateStep that keeps what each minibatch measured (before its optimizer step)."""

    def __init__(self, step, seen):
        self.step, self.seen = step, seen

    def __getattr__(self, name):
        return getattr(self.step, name)

    def backward(self, mb):
        self.step.backward(mb)
        with torch.no_grad():
            logp, _, _ = self.step.policy.evaluate_sequence(mb.obs, mb.actions, mb.state0, mb.episode_start)
        self.seen.append((mb, logp))

    def measure(self):
        result = self.step.measure()
        self.seen[-1] = (*self.seen[-1], result)
        return result


@pytest.mark.parametrize("seq_len", [0, 8])  # 0: one chunk per env (the whole rollout); 8: state0 mid-rollout
def test_the_first_minibatch_of_the_first_epoch_has_ratio_exactly_one(tmp_path, seq_len):
    trainer = make_trainer(tmp_path, seq_len=seq_len, num_steps=32)
    seen = []
    trainer.epoch_loop = lambda batch, s, step, **k: ppo_epochs(batch, s, FirstStats(step, seen), **k)
    run = trainer.run()
    assert len(run.metrics) == 2
    mb, logp, result = seen[0]
    assert isinstance(mb, SequenceBatch) and mb.mask.any()
    if seq_len:
        assert mb.state0.abs().sum() > 0  # some chunk starts mid-episode: its stored state is not the initial one
    assert mb.episode_start[1:][mb.mask[1:]].any()  # and some chunk crosses an episode start (a reset replayed)
    # state0 and the in-order replay reproduce the rollout's log-probs: ratio 1 exactly on every counted step.
    assert torch.equal(logp[mb.mask], mb.logp_old[mb.mask])
    assert result.approx_kl == 0.0 and float(result.stats["clipfrac"]) == 0.0
    # Later minibatches are measured after an optimizer step: the policy moved.
    assert any(r.approx_kl > 0 for _, _, r in seen[1:])


def test_a_chunk_that_crosses_an_episode_start_resets_the_state_there(tmp_path):
    trainer = make_trainer(tmp_path, seq_len=0, num_steps=40)  # CartPole's random episodes end within 40 steps
    try:
        sb = rollout_sequences(trainer)
    finally:
        trainer.envs.close()
    starts = sb.episode_start.clone()
    starts[0] = False
    t, c = (int(i) for i in starts.nonzero()[0])  # chunk c has an episode start at step t > 0
    policy = trainer.policy
    with torch.no_grad():
        logp, _, values = policy.evaluate_sequence(sb.obs, sb.actions, sb.state0, sb.episode_start)
        assert torch.equal(logp[sb.mask], sb.logp_old[sb.mask])  # the replay is the rollout
        # From step t on, the chunk's outputs do not depend on the state before the reset: from another state0
        # (the first step is made no episode start, so state0 is used), they are the same from t on only.
        es = sb.episode_start.clone()
        es[0] = False
        logp_a, _, values_a = policy.evaluate_sequence(sb.obs, sb.actions, sb.state0, es)
        logp_b, _, values_b = policy.evaluate_sequence(sb.obs, sb.actions, sb.state0 + 1.0, es)
        assert torch.equal(logp_b[t:, c], logp_a[t:, c]) and torch.equal(values_b[t:, c], values_a[t:, c])
        assert not torch.equal(logp_b[:t, c], logp_a[:t, c])  # before it, the state matters
        tail, _, _ = policy.evaluate_sequence(sb.obs[t:], sb.actions[t:], sb.state0 - 1.0, es[t:])
        assert torch.equal(tail[:, c], logp_a[t:, c])


def test_recurrent_seq_len_is_validated_in_one_line(tmp_path):
    for bad in (-1, 11, 2.5):
        with pytest.raises(ConfigError, match="recurrent_seq_len") as info:
            PPOConfig(num_steps=10, recurrent_seq_len=bad).validate()
        assert "\n" not in str(info.value)
    assert PPOConfig(num_steps=10, recurrent_seq_len=10).validate().recurrent_seq_len == 10
    # The CLI flag: one line naming the field, exit code 2, before any env is built.
    proc = subprocess.run([sys.executable, "-m", "ppokit", "train", "--num-steps", "8", "--recurrent-seq-len", "9",
                           "--run-dir", "unused"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "recurrent_seq_len" in lines[0], proc.stderr
    assert not (tmp_path / "unused").exists()


def test_a_stateless_policy_keeps_row_minibatches_and_stores_no_state(tmp_path):
    cfg = PPOConfig(env_id="CartPole-v1", num_envs=2, num_steps=8, total_timesteps=16, num_minibatches=2,
                    update_epochs=1, seed=0, tensorboard=False, recurrent_seq_len=4, run_dir=str(tmp_path / "r"))
    trainer = Trainer(cfg, console_enabled=False)
    try:
        assert trainer.buffer.policy_state is None and trainer.buffer.episode_start is None
        trainer.collect_rollout()
        batch, adv, ret = trainer.compute_advantages()
        assert trainer.update_batch(batch, adv, ret) is batch
    finally:
        trainer.envs.close()


def test_settings_of_a_sequence_update_count_chunks():
    """``num_minibatches`` splits the chunks (``len`` of a sequence batch), as the rows of a flat batch."""
    z = torch.zeros(3, 5)
    sb = SequenceBatch(torch.zeros(3, 5, 2), z.long(), z, z, z, z, mask=z.bool())
    picked = sb.index(torch.tensor([4, 0]))
    assert len(sb) == 5 and len(picked) == 2 and picked.obs.shape == (3, 2, 2) and picked.state0 is None
