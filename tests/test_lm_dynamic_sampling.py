"""DAPO's dynamic sampling on real rollouts of a tiny GPT-2: groups whose rewards are all equal are dropped and
new prompt groups sampled until the batch holds ``batch_prompts`` groups with a spread, at most
``max_resample_rounds`` extra rounds; the rounds and the dropped groups are logged."""

from __future__ import annotations

import csv

import pytest
import torch

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

from ppokit.core import schema as S  # noqa: E402
from ppokit.core.errors import ConfigError  # noqa: E402
from ppokit.lm.config import LMConfig  # noqa: E402

G = 4
# Prompts "X:" score 1.0 whatever is sampled (a constant group); "AB:"/"BAAB:" score the sum of the completion's token
# ids, which differs between the G samples of a group.
PROMPTS = ["X:", "X:", "AB:", "X:", "BAAB:", "X:"]


class Reward:
    def __init__(self, constant=("X:",)):
        self.constant, self.calls, self.seen = constant, 0, []

    def __call__(self, prompts, completions, completion_ids, **_):
        self.calls += 1
        self.seen += list(prompts)
        return [1.0 if p in self.constant else float(sum(ids)) for p, ids in zip(prompts, completion_ids)]


def _trainer(reward, tmp_path=None, **kw):
    from ppokit.lm import GRPOTrainer
    from ppokit.lm.tiny import build_tiny

    model, tok = build_tiny("ABX:", seed=0)
    cfg = LMConfig(**{**dict(batch_prompts=3, group_size=G, max_new_tokens=4, update_epochs=1, num_minibatches=2,
                             beta=0.0, learning_rate=1e-3, tensorboard=False, console=False, seed=3,
                             drop_zero_std_groups=True, max_resample_rounds=4), **kw})
    return GRPOTrainer(model, tok, reward=reward, prompts=PROMPTS, config=cfg,
                       run_dir=None if tmp_path is None else tmp_path / "run")


def _group_stds(scores):
    return scores.float().view(-1, G).std(dim=1, correction=0)


def test_resampling_fills_the_batch_with_groups_whose_rewards_differ():
    reward = Reward()
    t = _trainer(reward)
    s, g, rounds, dropped = t._rollout()
    # The batch has exactly batch_prompts groups, none of them constant, each a varying prompt's.
    assert len(s.completions) == 3 * G and len(s.batch) == 3 * G
    assert (_group_stds(s.batch.scores) > 0).all()
    assert set(s.prompts) <= {"AB:", "BAAB:"}
    # It took extra rounds (two of every three prompts are constant), each one counted, each constant group dropped.
    assert rounds >= 1 and reward.calls == rounds + 1
    assert dropped == reward.seen.count("X:") // G and dropped > 0
    assert len(g.completions) == len(reward.seen) == (rounds + 1) * 3 * G
    # The kept rows are the sampled rows: the same scores and completions as the reward saw them, padded alike.
    assert s.batch.input_ids.shape == s.batch.attention_mask.shape
    assert s.batch.response_mask.shape == s.batch.logp_old.shape
    real = s.batch.response_mask.sum(-1)
    assert torch.equal(s.batch.attention_mask[:, -s.batch.n_response:].sum(-1), real)


def _recomputed(t, b):
    from ppokit.lm.logprobs import token_logprobs

    logp, _ = token_logprobs(t.policy, b.input_ids, b.attention_mask, b.n_response, t.config.temperature)
    return torch.where(b.response_mask, logp, 0.0)


def test_rounds_of_other_widths_are_joined_with_every_token_at_its_position():
    from ppokit.lm.dynamic_sampling import concat_sampled

    t = _trainer(Reward())
    short = t._sample(["X:"] * G, with_ref=False)  # prompt width 2
    t.sampling.max_new_tokens = 7
    long = t._sample(["BAAB:"] * G, with_ref=False)  # prompt width 5, a longer response block
    assert short.batch.n_response < long.batch.n_response
    s = concat_sampled([short, long], t.sampling.pad_token_id)
    b = s.batch
    assert b.input_ids.shape == (2 * G, 5 + 7) and b.n_response == 7
    assert s.prompts == short.prompts + long.prompts and s.completions == short.completions + long.completions
    assert torch.equal(b.scores, torch.cat([short.batch.scores, long.batch.scores]))
    # Each row's real tokens, and the log-probs the policy gives them, are those of its own round.
    assert torch.equal(b.response_mask.sum(-1), torch.cat([x.batch.response_mask.sum(-1) for x in (short, long)]))
    assert torch.equal(b.attention_mask.sum(-1), torch.cat([x.batch.attention_mask.sum(-1) for x in (short, long)]))
    assert torch.allclose(_recomputed(t, b), torch.where(b.response_mask, b.logp_old, 0.0), atol=1e-5)


def test_the_bound_on_rounds_is_respected_and_logged(tmp_path):
    reward = Reward(constant=("X:", "AB:", "BAAB:"))  # every group constant: the batch can never be filled
    t = _trainer(reward, tmp_path, max_resample_rounds=2, log_every=1)
    before = [p.detach().clone() for p in t.policy.parameters()]
    m = t.step()
    t.close()
    assert reward.calls == 3  # the first round and two extra, no more
    assert m[S.RESAMPLE_ROUNDS] == 2 and m[S.DROPPED_GROUPS] == 9 and m[S.TRAIN_GROUPS] == 0
    assert m[S.FRAC_REWARD_ZERO_STD] == 1.0 and m[S.MINIBATCHES] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, t.policy.parameters()))
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert float(row[S.RESAMPLE_ROUNDS]) == 2 and float(row[S.DROPPED_GROUPS]) == 9


def test_a_step_with_resampling_trains_on_a_full_batch_and_logs_its_rounds():
    reward = Reward()
    t = _trainer(reward)
    m = t.step()
    assert m[S.TRAIN_GROUPS] == 3 and m[S.MINIBATCHES] == 2
    assert m[S.RESAMPLE_ROUNDS] == reward.calls - 1 >= 1
    assert m[S.DROPPED_GROUPS] == reward.seen.count("X:") // G
    # The rollout's numbers describe every completion sampled, the constant groups included.
    assert m[S.FRAC_REWARD_ZERO_STD] == pytest.approx(m[S.DROPPED_GROUPS] / (len(reward.seen) // G))


def test_without_resampling_one_round_is_sampled_and_the_constant_groups_are_dropped():
    reward = Reward()
    t = _trainer(reward, max_resample_rounds=0)
    m = t.step()
    assert reward.calls == 1 and m[S.RESAMPLE_ROUNDS] == 0
    assert m[S.TRAIN_GROUPS] == 3 - m[S.DROPPED_GROUPS] and m[S.DROPPED_GROUPS] >= 1


def test_resampling_needs_drop_zero_std_groups_and_a_non_negative_bound():
    with pytest.raises(ConfigError, match="max_resample_rounds.*drop_zero_std_groups"):
        LMConfig(max_resample_rounds=2).validate()
    with pytest.raises(ConfigError, match="max_resample_rounds"):
        LMConfig(max_resample_rounds=-1, drop_zero_std_groups=True).validate()
