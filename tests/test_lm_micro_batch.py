"""Micro-batches (``LMConfig.micro_batch_size``) give the whole minibatch's loss and gradient.

Each micro-batch's loss is weighted by its share of the minibatch's normalizer (``step.Share``): the gradient
accumulated over micro-batches of 1 and 3 rows must equal the one pass's, for PPO (policy + value loss), GRPO with
each ``loss_type`` (token mean, sequence mean, Dr. GRPO, DAPO) and DPO, on a tiny Llama and a tiny GPT-2 built from
a config. The minibatch has responses of different lengths and one empty row, so a plain mean over the
micro-batches (each weighted by its row count) gives another gradient: the reference here is the one pass.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

import torch  # noqa: E402

from ppokit.config.ppo_config import ConfigError  # noqa: E402
from ppokit.core import schema as S  # noqa: E402
from ppokit.lm import DPOTrainer, GRPOTrainer, LMConfig, PPOTrainer  # noqa: E402
from ppokit.lm.logprobs import token_logprobs  # noqa: E402
from ppokit.lm.rollout import TokenBatch  # noqa: E402
from ppokit.lm.step import TokenStep  # noqa: E402
from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama, build_tiny_model  # noqa: E402

ALPHABET = "ABCDEFGH:"
PROMPTS = ["AB:", "CDE:", "F:"]
ROWS, P, R = 7, 4, 6
LENGTHS = [6, 1, 0, 4, 6, 3, 2]  # response tokens per row: uneven, one empty row
MICRO = (1, 3, None)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def base(request):
    tok = build_char_tokenizer(ALPHABET)
    if request.param == "llama":
        return build_tiny_llama(tok, seed=0), tok
    return build_tiny_model(tok, seed=0), tok


def _batch(model, tok, with_values: bool) -> TokenBatch:
    """A hand-made minibatch: random prompts and responses of ``LENGTHS``, pi_old a perturbed copy of the policy's
    log-probs (ratios away from 1, some clipped), random advantages, pi_ref, values and returns."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, len(tok), (ROWS, P + R), generator=g)
    lengths = torch.tensor(LENGTHS)
    resp = torch.arange(R)[None] < lengths[:, None]  # [B, R]
    attn = torch.cat([torch.ones(ROWS, P, dtype=torch.long), resp.long()], 1)
    ids[:, P:] = torch.where(resp, ids[:, P:], tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, attn, R)
    noise = lambda scale: scale * torch.randn(ROWS, R, generator=g)  # noqa: E731
    fields = dict(logp_old=logp + noise(0.3), logp_ref=logp + noise(0.3), advantages=noise(1.0))
    if with_values:
        fields.update(values=noise(1.0), returns=noise(1.0))
    return TokenBatch(ids, attn, resp, scores=torch.zeros(ROWS), **fields)


def _grads(trainer, batch, micro) -> tuple[float, dict, list[torch.Tensor]]:
    step = TokenStep(trainer._loss, trainer.optimizer, trainer.device, 1.0, micro)
    trainer.policy.train(False)
    step.backward(batch)
    grads = [p.grad.clone() for g in trainer.optimizer.param_groups for p in g["params"]]
    return float(step._loss), {k: float(v) for k, v in step._stats.items()}, grads


def _agree(results) -> None:
    (loss0, stats0, grads0), *others = results
    assert any(float(g.abs().max()) > 1e-3 for g in grads0)  # a gradient to compare
    for loss, stats, grads in others:
        assert loss == pytest.approx(loss0, abs=1e-5)
        for name, v in stats0.items():
            assert stats[name] == pytest.approx(v, abs=1e-5), name
        for a, b in zip(grads0, grads):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def _reward(prompts, completions):
    return [float(c.count("A")) for c in completions]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_gradients_are_the_same_in_micro_batches_of_1_3_and_none(base, loss_type):
    model, tok = base
    cfg = LMConfig(batch_prompts=2, group_size=2, max_new_tokens=R, beta=0.1, ent_coef=0.01, loss_type=loss_type)
    t = GRPOTrainer(copy.deepcopy(model), tok, reward=_reward, prompts=PROMPTS, config=cfg)
    b = _batch(t.policy, tok, with_values=False)
    t._tokens_per_minibatch = 9.0  # dapo's constant normalizer
    _agree([_grads(t, b, m) for m in (None, 1, 3)])


def test_gspo_with_clip_higher_gradients_are_the_same_in_micro_batches(base):
    model, tok = base
    cfg = LMConfig(batch_prompts=2, group_size=2, max_new_tokens=R, beta=0.1, loss_type="grpo",
                   importance_sampling_level="sequence", epsilon_high=0.28)
    t = GRPOTrainer(copy.deepcopy(model), tok, reward=_reward, prompts=PROMPTS, config=cfg)
    b = _batch(t.policy, tok, with_values=False)
    _agree([_grads(t, b, m) for m in (None, 1, 3)])


# token_mean and a per-sequence mean weigh a micro-batch differently (its tokens' share vs its rows').
@pytest.mark.parametrize("reduction", ["seq_mean_token_mean", "token_mean"])
def test_ppo_gradients_are_the_same_in_micro_batches_of_1_3_and_none(base, reduction):
    model, tok = base
    cfg = LMConfig(batch_prompts=2, group_size=2, max_new_tokens=R, vf_coef=0.5, ent_coef=0.01,
                   loss_reduction=reduction)
    t = PPOTrainer(copy.deepcopy(model), tok, reward=_reward, prompts=PROMPTS, config=cfg)
    b = _batch(t.policy, tok, with_values=True)
    _agree([_grads(t, b, m) for m in (None, 1, 3)])


def test_dpo_gradients_and_loss_are_the_same_in_micro_batches_of_1_3_and_none(base):
    model, tok = base
    pairs = [("AB:", "CD", "E"), ("C:", "A", "BBBB"), ("DE:", "FGH", "G"), ("H:", "AAB", "C"), ("A:", "B", "CC")]
    out = []
    for micro in MICRO:
        # lr 0: the step computes and clips the gradient, and leaves the weights, so p.grad is the step's.
        cfg = LMConfig(batch_prompts=5, learning_rate=0.0, max_grad_norm=1e6, beta=0.5, micro_batch_size=micro)
        t = DPOTrainer(copy.deepcopy(model), tok, pairs=pairs, config=cfg)
        m = t.step()
        out.append((m[S.POLICY_LOSS], {"acc": m[S.DPO_PREF_ACCURACY], "margin": m[S.DPO_REWARD_MARGIN]},
                    [p.grad.clone() for p in t.trainable_parameters()]))
    _agree(out)


@pytest.mark.parametrize("trainer", [GRPOTrainer, PPOTrainer])
def test_one_iteration_gives_the_same_weights_in_micro_batches(trainer):
    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_llama(tok, seed=1)
    weights = []
    for micro in MICRO:
        cfg = LMConfig(batch_prompts=3, group_size=3, max_new_tokens=5, learning_rate=1e-4, num_minibatches=2,
                       micro_batch_size=micro, seed=3)
        t = trainer(copy.deepcopy(model), tok, reward=_reward, prompts=PROMPTS, config=cfg)
        t.step()
        weights.append([p.detach().clone() for p in t.trainable_parameters()])
    moved = max(float((a - b.detach()).abs().max()) for a, b in zip(weights[0], model.parameters()))
    assert moved > 1e-5
    for other in weights[1:]:
        for a, b in zip(weights[-1], other):
            torch.testing.assert_close(b, a, atol=2e-6, rtol=0)


def test_micro_batch_size_must_be_a_positive_integer():
    for bad in (0, -2):
        with pytest.raises(ConfigError, match="micro_batch_size"):
            LMConfig(micro_batch_size=bad).validate()
    with pytest.raises(ConfigError, match="micro_batch_size"):
        LMConfig(micro_batch_size=2.5).validate()
    assert LMConfig(micro_batch_size=5).validate().micro_batch_size == 5


def test_no_full_vocabulary_tensor_larger_than_a_micro_batch_is_saved_for_the_backward(base):
    model, tok = base
    cfg = LMConfig(batch_prompts=2, group_size=2, max_new_tokens=R, beta=0.1)
    t = GRPOTrainer(copy.deepcopy(model), tok, reward=_reward, prompts=PROMPTS, config=cfg)
    b = _batch(t.policy, tok, with_values=False)
    V = t.policy.get_output_embeddings().weight.shape[0]
    largest = {}
    for micro in (None, 2):
        rows = []

        def pack(x, rows=rows):
            if x.dim() == 3 and x.shape[1:] == (R, V):  # the logits of the response tokens, [rows, R, V]
                rows.append(x.shape[0])
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            _grads(t, b, micro)
        largest[micro] = max(rows)
    assert largest[None] == ROWS and largest[2] == 2


def test_a_reward_model_scores_in_micro_batches_as_in_one_call():
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from ppokit.lm.reward_models import RewardModel
    from ppokit.lm.rewards import make_reward

    tok = build_char_tokenizer(ALPHABET)
    torch.manual_seed(0)
    rm = GPT2ForSequenceClassification(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=1, n_head=2,
                                                  num_labels=1, pad_token_id=tok.pad_token_id)).eval()
    calls = []
    forward = rm.forward

    def counted(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    rm.forward = counted
    prompts, completions = ["AB:", "C:", "DEF:", "G:", "H:"], ["A", "BBB", "C", "", "DDDDD"]
    whole = make_reward(RewardModel(rm, tok), tok)(prompts, completions, {})
    assert calls == [5]
    chunked = make_reward(RewardModel(rm, tok), tok, micro_batch_size=2)(prompts, completions, {})
    assert calls[1:] == [2, 2, 1]
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)


def test_the_memory_estimate_counts_one_micro_batch_of_logits(base):
    from ppokit.lm.checks import estimate_lm_memory

    def estimate(**kw):
        return estimate_lm_memory(LMConfig(num_minibatches=1, **kw), base[0], 64, 16, 16, extra_models=1,
                                  value_model=False)

    whole, micro = estimate(), estimate(micro_batch_size=16)
    assert micro["update"] * 4 == whole["update"]  # 16 of the minibatch's 64 rows per backward
    assert micro["rollout"] < whole["rollout"]  # the no-gradient passes' logits: 16 rows at a time
