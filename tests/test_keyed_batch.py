"""The declared-fields batch (``core.batch``): the rollout buffer, the update's minibatches and the LM rollout are
sets of declared tensors, so a new per-step field is one declaration plus the code that writes and reads it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppokit.config.ppo_config import PPOConfig
from ppokit.core.batch import Field, Schema, TensorBatch, chunk_starts, chunk_steps, flatten_steps, unchunk_steps
from ppokit.lm.rollout import TokenBatch
from ppokit.rollout.buffer import ROLLOUT_FIELDS, RolloutBuffer, step_field_declared
from ppokit.rollout.collector import Collector
from ppokit.training.trainer import Trainer
from ppokit.update.epochs import BATCH_FIELDS, Batch, ppo_epochs

STAMP = Field("step_stamp", (), torch.long, batch="step_stamp",
                doc="a stamp naming the step and env it was written at")


class StampingCollector(Collector):
    """The real collector, then a stamp per step: ``1000 * rollout + t * N + n`` (so a minibatch row names the
    buffer step it came from). Nothing else knows of the field."""

    rollouts = 0

    def collect(self, global_step):
        out = super().collect(global_step)
        T, N = self.buffer.valid.shape
        stamp = torch.arange(T * N).reshape(T, N) + 1000 * StampingCollector.rollouts
        self.buffer.step_stamp.copy_(stamp)
        StampingCollector.rollouts += 1
        return out


class Recording:
    """An UpdateStep that records each minibatch of the step it wraps."""

    def __init__(self, step, seen):
        self.step, self.seen = step, seen

    def __getattr__(self, name):
        return getattr(self.step, name)

    def minibatches(self, perm, sizes):
        for mb in self.step.minibatches(perm, sizes):
            self.seen.append(mb)
            yield mb


@pytest.mark.parametrize("vector_mode", ["sync", "native"])  # SAME_STEP / NEXT_STEP (invalid reset steps)
def test_a_declared_field_reaches_every_minibatch_without_editing_another_module(tmp_path, vector_mode):
    StampingCollector.rollouts = 0
    cfg = PPOConfig(env_id="CartPole-v1", num_envs=3, num_steps=40, total_timesteps=2 * 120, num_minibatches=4,
                    update_epochs=2, hidden_sizes=[8], seed=0, tensorboard=False, fused_update=False,
                    vector_mode=vector_mode, run_dir=str(tmp_path / "r"))
    with step_field_declared(STAMP):
        trainer = Trainer(cfg, console_enabled=False, rollout=StampingCollector)
        buf = trainer.buffer
        assert buf.step_stamp.shape == (40, 3) and buf.step_stamp.dtype == torch.long
        checked = []

        def loop(batch, settings, step, **kw):
            seen = []
            stats = ppo_epochs(batch, settings, Recording(step, seen), **kw)
            valid = buf.valid.reshape(-1)
            stamps = buf.step_stamp.reshape(-1)[valid]
            # The flat batch holds the valid steps, each once; every minibatch row is one buffer step's fields.
            assert sorted(batch.step_stamp.tolist()) == sorted(stamps.tolist())
            assert len(seen) == settings.update_epochs * settings.num_minibatches
            for mb in seen:
                t, n = np.divmod(mb.step_stamp.numpy() % 1000, 3)
                torch.testing.assert_close(mb.obs, buf.obs[t, n], rtol=0, atol=0)
                torch.testing.assert_close(mb.logp_old, buf.logp[t, n], rtol=0, atol=0)
                torch.testing.assert_close(mb.actions, buf.actions[t, n], rtol=0, atol=0)
            checked.append(int(valid.sum()))
            return stats

        trainer.epoch_loop = loop
        trainer.run()
    assert len(checked) == 2
    if vector_mode == "native":
        assert min(checked) <= 120  # under NEXT_STEP, an episode's end makes an invalid step (left out)
    assert "step_stamp" not in ROLLOUT_FIELDS and "step_stamp" not in BATCH_FIELDS  # undeclared again


def test_declaring_a_taken_name_or_an_undeclared_field_is_refused():
    with pytest.raises(ValueError, match="'logp' is already declared"):
        with step_field_declared(Field("logp")):
            pass
    with pytest.raises(ValueError, match="'advantages' is already declared"):
        with step_field_declared(Field("adv_copy", batch="advantages")):
            pass
    assert "adv_copy" not in ROLLOUT_FIELDS  # a refused minibatch name leaves no half declaration behind
    z = torch.zeros(4)
    with pytest.raises(TypeError, match="no declared field 'advantage'"):
        Batch(torch.zeros(4, 2), z, z, z, advantages=z, returns=z, advantage=z)
    with pytest.raises(TypeError, match="required field 'returns' is missing"):
        Batch(torch.zeros(4, 2), z, z, z, z)
    batch = Batch(torch.zeros(4, 2), z, z, z, z, z)
    with pytest.raises(AttributeError, match="no declared field 'advantage'"):
        batch.advantage = z  # a typo is an error, not a silent new attribute
    assert batch.action_mask is None and "action_mask" not in batch and len(batch) == 4
    assert batch.keys() == ["obs", "actions", "logp_old", "values_old", "advantages", "returns"]


def test_the_buffer_is_allocated_from_its_declarations_for_the_run():
    layout = {"image": ((1, 3, 3), torch.uint8), "pos": 2}
    buf = RolloutBuffer.allocate(5, 2, layout, (3,), torch.long, "cpu", mask_dim=4,
                                 policy_state=(torch.zeros(2, 7), torch.zeros(2, 1, 7, dtype=torch.float64)))
    assert buf.obs["image"].shape == (5, 2, 1, 3, 3) and buf.obs["image"].dtype == torch.uint8
    assert buf.obs["pos"].shape == (5, 2, 2) and buf.obs["pos"].dtype == torch.float32
    assert buf.actions.shape == (5, 2, 3) and buf.masks.shape == (5, 2, 4) and buf.masks.dtype == torch.bool
    h, c = buf.policy_state
    assert h.shape == (5, 2, 7) and c.shape == (5, 2, 1, 7) and c.dtype == torch.float64
    assert buf.episode_start.shape == (5, 2) and buf.episode_start.dtype == torch.bool
    # A stateless policy without masks stores neither.
    plain = RolloutBuffer.allocate(5, 2, 3, (), torch.long, "cpu")
    assert plain.masks is None and plain.policy_state is None and plain.episode_start is None
    # policy_version: declared by rollout.source (every source writes it), imported with the collector.
    assert plain.keys() == ["obs", "actions", "logp", "values", "rewards", "terminated", "truncated", "valid",
                            "final_values", "has_final", "policy_version"]


def test_flatten_and_chunks_keep_every_part_of_a_tree_in_step():
    T, N, L = 5, 2, 2
    x = torch.arange(T * N).reshape(T, N)
    tree = {"a": x, "b": (x.float()[..., None].expand(T, N, 3),)}
    flat = flatten_steps(tree, torch.tensor([0, 3, 9]))
    assert flat["a"].tolist() == [0, 3, 9] and flat["b"][0][:, 0].tolist() == [0.0, 3.0, 9.0]
    chunks = chunk_steps(tree, L)  # K = 3 chunks per env, the last padded
    assert chunks["a"].shape == (L, 3 * N) and chunks["b"][0].shape == (L, 3 * N, 3)
    # column k*N + n: env n's steps k*L, k*L+1 (zeros past T)
    assert chunks["a"][:, 1].tolist() == [1, 3] and chunks["a"][:, 2 * N + 1].tolist() == [9, 0]
    assert chunk_starts(x, L).tolist() == [x[k * L, n].item() for k in range(3) for n in range(N)]
    # unchunk_steps undoes it, the padding dropped (per-step values computed on the chunks land on their steps)
    for seq_len in (1, 2, 3, T):
        y = torch.randn(T, N, 4)
        assert torch.equal(unchunk_steps(chunk_steps(y, seq_len), T), y)


def test_a_batch_type_is_its_schema():
    schema = Schema(Field("x", (2,)), Field("state", lambda d: d["state"], None, per_step=False))

    class Seq(TensorBatch):
        row_dim = 1

    Seq.schema = schema
    seq = Seq(x=torch.arange(12.0).reshape(3, 2, 2), state=(torch.tensor([5, 6]),))
    picked = seq.index(torch.tensor([1]))
    assert len(seq) == 2 and picked.x.shape == (3, 1, 2) and picked.state[0].tolist() == [6]
    storage = schema.allocate((4, 3), {"state": ((7,), torch.int8)}, "cpu")
    assert storage["x"].shape == (4, 3, 2) and storage["state"].shape == (3, 7)


def test_the_lm_rollout_is_a_declared_batch_too():
    B, P, R = 3, 2, 4
    batch = TokenBatch(torch.zeros(B, P + R, dtype=torch.long), torch.ones(B, P + R, dtype=torch.long),
                       torch.ones(B, R, dtype=torch.bool), torch.randn(B, R), torch.arange(3.0),
                       values=torch.zeros(B, R))
    batch.advantages = torch.ones(B, R)
    mb = batch.index(torch.tensor([2, 0]))
    assert mb.scores.tolist() == [2.0, 0.0] and mb.logp_ref is None and mb.advantages.shape == (2, R)
    assert mb.n_response == R and mb.obs is mb.logp_old and len(mb) == 2
    assert batch.to("cpu").keys() == ["input_ids", "attention_mask", "response_mask", "logp_old", "scores",
                                      "values", "advantages"]


def test_replace_gives_a_new_batch_with_the_named_fields_changed_and_refuses_an_undeclared_one():
    B, P, R = 2, 1, 3
    batch = TokenBatch(torch.zeros(B, P + R, dtype=torch.long), torch.ones(B, P + R, dtype=torch.long),
                       torch.ones(B, R, dtype=torch.bool), torch.randn(B, R), torch.arange(2.0))
    masked = batch.replace(response_mask=torch.zeros(B, R, dtype=torch.bool))
    assert not masked.response_mask.any() and batch.response_mask.all()  # the original is untouched
    assert masked.logp_old is batch.logp_old and type(masked) is TokenBatch
    with pytest.raises(AttributeError, match="no declared field 'respons_mask'"):
        batch.replace(respons_mask=batch.response_mask)
