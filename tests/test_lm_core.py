"""ppokit.lm's pieces against hand-computed values: response masks and where the score lands (pad == EOS), the
missing-EOS penalty, k1/k3, GRPO's group advantages, the DPO loss, the three reward kinds, LMConfig's validation and
guard rails, prompt files and orders, and the lazy import."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ppokit.core.objectives import approx_kl_k3  # noqa: E402
from ppokit.lm import LMConfig  # noqa: E402
from ppokit.lm.config import ConfigError  # noqa: E402
from ppokit.lm.generation import SamplingSettings  # noqa: E402
from ppokit.lm.grpo import group_advantages  # noqa: E402
from ppokit.lm.logprobs import kl_per_token, position_ids, response_mask  # noqa: E402
from ppokit.lm.losses import LossSettings  # noqa: E402
from ppokit.lm.losses import policy_loss_dpo as dpo_loss  # noqa: E402
from ppokit.lm.ppo import adaptive_kl_coef, rlhf_rewards, token_advantages  # noqa: E402
from ppokit.lm.prompts import PromptSource, load_prompts  # noqa: E402
from ppokit.lm.rewards import make_reward  # noqa: E402
from ppokit.lm.rollout import place_scores, sample  # noqa: E402
from ppokit.lm.tiny import build_tiny  # noqa: E402

EOS = 1  # tiny.build_char_tokenizer: ids 0, 1, 2 are pad, eos, unk


# ---------------------------------------------------------------- masks and the score's position
def test_response_mask_includes_the_first_eos_when_pad_is_eos():
    ids = torch.tensor([[5, 6, EOS, EOS, EOS],   # EOS at 2, then pads that are EOS too
                        [5, 6, 7, 8, 9],         # never stopped
                        [EOS, EOS, EOS, EOS, EOS]])  # stopped at once
    mask = response_mask(ids, EOS)
    assert mask.tolist() == [[True, True, True, False, False], [True] * 5, [True, False, False, False, False]]


def test_the_score_lands_on_the_eos_token_or_on_the_last_token_without_eos():
    ids = torch.tensor([[5, 6, EOS, EOS, EOS], [5, 6, 7, 8, 9]])
    scores = place_scores(torch.tensor([2.0, 3.0]), response_mask(ids, EOS))
    assert scores.tolist() == [[0, 0, 2.0, 0, 0], [0, 0, 0, 0, 3.0]]
    # An empty response (no real token at all) gets no score anywhere, and nothing fails.
    empty = place_scores(torch.tensor([4.0]), torch.zeros(1, 3, dtype=torch.bool))
    assert empty.tolist() == [[0, 0, 0]]


def test_rlhf_rewards_put_the_kl_penalty_on_real_tokens_and_the_score_on_the_last():
    mask = torch.tensor([[True, True, False]])
    logp_old = torch.tensor([[-1.0, -2.0, -9.0]])
    logp_ref = torch.tensor([[-1.5, -1.0, 5.0]])
    rewards, kl = rlhf_rewards(torch.tensor([10.0]), logp_old, logp_ref, mask, kl_coef=0.1, estimator="k1")
    assert kl[0].tolist() == pytest.approx([0.5, -1.0, 0.0])
    assert rewards[0].tolist() == pytest.approx([-0.05, 10.0 + 0.1, 0.0])


def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_masked_gae_on_tokens_matches_a_hand_computed_row():
    # Row 0: 2 real tokens, rewards [0, 1], values [0.5, 0.25], gamma 1, lambda 0.5:
    # delta_1 = 1 - 0.25 = 0.75 (the last real token bootstraps from 0); delta_0 = 0 + 0.25 - 0.5 = -0.25;
    # A_1 = 0.75, A_0 = -0.25 + 0.5 * 0.75 = 0.125.
    mask = torch.tensor([[True, True, False]])
    adv, ret = token_advantages(torch.tensor([[0.0, 1.0, 7.0]]), torch.tensor([[0.5, 0.25, 99.0]]), mask,
                                gamma=1.0, lam=0.5, whiten=False)
    assert adv[0].tolist() == pytest.approx([0.125, 0.75, 0.0])
    assert ret[0].tolist() == pytest.approx([0.625, 1.0, 0.0])


# ---------------------------------------------------------------- KL estimators
def test_k1_and_k3_per_token_values():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    logp_ref = torch.tensor([-1.5, -1.0, -0.5])
    assert kl_per_token(logp, logp_ref, "k1").tolist() == pytest.approx([0.5, -1.0, 0.0])
    expected = [math.exp(r - p) - 1 - (r - p) for p, r in zip(logp.tolist(), logp_ref.tolist())]
    k3 = kl_per_token(logp, logp_ref, "k3")
    assert k3.tolist() == pytest.approx(expected, rel=1e-6)
    assert (k3 >= 0).all()
    # The core's estimator with pi_ref in the numerator is the same number.
    assert float(k3.mean()) == pytest.approx(float(approx_kl_k3(logp_ref, logp)), rel=1e-6)
    with pytest.raises(ValueError, match="unknown estimator"):
        kl_per_token(logp, logp_ref, "k2")


def test_k3_is_non_negative_on_random_samples():
    g = torch.Generator().manual_seed(0)
    logp, logp_ref = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_per_token(logp, logp_ref, "k3") >= 0).all()


def test_adaptive_kl_controller_moves_towards_the_target():
    assert adaptive_kl_coef(0.1, kl=12.0, target=6.0, n=100, horizon=1000) == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    assert adaptive_kl_coef(0.1, kl=5.4, target=6.0, n=100, horizon=1000) == pytest.approx(0.1 * (1 - 0.1 * 0.1))


# ---------------------------------------------------------------- GRPO advantages
def test_group_advantages_are_zero_mean_per_group_and_zero_for_a_constant_group():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.1, 0.1, 0.1, 0.1])
    adv, zero = group_advantages(r, 4, "group", eps=1e-4)
    groups = adv.view(2, 4)
    assert groups[0].sum().abs() < 1e-6 and groups[1].tolist() == [0.0] * 4
    assert zero.tolist() == [False, True]
    std = torch.tensor([1.0, 2.0, 3.0, 6.0]).std(unbiased=False)
    assert groups[0].tolist() == pytest.approx(((torch.tensor([1.0, 2.0, 3.0, 6.0]) - 3.0) / (std + 1e-4)).tolist())


def test_group_advantages_scale_by_the_batch_std_or_not_at_all():
    r = torch.tensor([1.0, 3.0, 5.0, 5.0])
    batch_std = float(r.std(unbiased=False))
    adv_b, _ = group_advantages(r, 2, "batch", eps=0.0 + 1e-8)
    assert adv_b.tolist() == pytest.approx([-1 / batch_std, 1 / batch_std, 0.0, 0.0], rel=1e-5)
    # Data-parallel: the std over every rank's rewards, given, replaces this rank's own.
    adv_g, _ = group_advantages(r, 2, "batch", eps=1e-8, batch_std=4.0)
    assert adv_g.tolist() == pytest.approx([-1 / 4.0, 1 / 4.0, 0.0, 0.0], rel=1e-6)
    adv_n, zero = group_advantages(r, 2, "none")
    assert adv_n.tolist() == [-1.0, 1.0, 0.0, 0.0] and zero.tolist() == [False, True]
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def test_group_advantages_default_to_the_group_std_plus_1e_4_and_handle_one_and_no_reward():
    r = torch.tensor([1.0, 2.0, 4.0, 4.5])
    std = torch.tensor([1.0, 2.0]).std(unbiased=False)  # 0.5 (and 0.25 for the second group)
    hand = [-0.5 / (std + 1e-4), 0.5 / (std + 1e-4), -0.25 / (std / 2 + 1e-4), 0.25 / (std / 2 + 1e-4)]
    assert group_advantages(r, 2)[0].tolist() == pytest.approx([float(h) for h in hand], rel=1e-6)
    # One reward in a group of one: no spread, advantage exactly 0 (not the reward itself).
    adv, zero = group_advantages(torch.tensor([2.5]), 1)
    assert adv.tolist() == [0.0] and zero.tolist() == [True]
    adv, zero = group_advantages(torch.zeros(0), 4)  # every group dropped: nothing to centre
    assert adv.shape == zero.shape == (0,)


# ---------------------------------------------------------------- DPO
def test_dpo_loss_against_a_hand_computed_value():
    beta = 0.1
    lc, lr_, rc, rr = -3.0, -5.0, -4.0, -4.5
    z = beta * ((lc - rc) - (lr_ - rr))  # 0.1 * (1 - (-0.5)) = 0.15
    expected = -math.log(1.0 / (1.0 + math.exp(-z)))
    # One response token per row: the sequence log-prob is that token's.
    one = torch.ones(2, 1, dtype=torch.bool)
    loss, stats = dpo_loss(torch.tensor([[lc], [lr_]]), None, torch.tensor([[rc], [rr]]), None, one,
                           LossSettings(beta=beta))
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(stats["chosen_rewards"]) == pytest.approx(0.1)
    assert float(stats["rejected_rewards"]) == pytest.approx(-0.05)
    # At pi == pi_ref the loss is log 2 whatever the pair.
    zero = torch.zeros(6, 1)
    assert float(dpo_loss(zero, None, zero, None, torch.ones(6, 1, dtype=torch.bool), LossSettings(beta=0.5))[0]) \
        == pytest.approx(math.log(2))


# ---------------------------------------------------------------- rewards
INFO = {"completion_ids": [[3], [4, 5]], "eos": [True, False], "input_ids": torch.zeros(2, 3, dtype=torch.long),
        "attention_mask": torch.ones(2, 3, dtype=torch.long)}


def test_a_plain_callable_gets_only_the_info_it_names():
    seen = {}

    def plain(prompts, completions):
        return [len(c) for c in completions]

    def with_eos(prompts, completions, eos):
        seen["eos"] = eos
        return [1.0 if e else 0.0 for e in eos]

    def with_kwargs(prompts, completions, **info):
        seen["keys"] = set(info)
        return [0.5, 0.5]

    assert make_reward(plain)(["p", "p"], ["ab", "c"], INFO).tolist() == [2.0, 1.0]
    assert make_reward(with_eos)(["p", "p"], ["ab", "c"], INFO).tolist() == [1.0, 0.0]
    assert seen["eos"] == [True, False]
    make_reward(with_kwargs)(["p", "p"], ["ab", "c"], INFO)
    assert {"completion_ids", "eos"} <= seen["keys"]


def test_a_weighted_list_sums_its_rewards():
    def one(prompts, completions):
        return [1.0] * len(completions)

    def length(prompts, completions):
        return [float(len(c)) for c in completions]

    r = make_reward([(one, 0.5), length, (length, -2)])
    assert r(["p", "p"], ["ab", "c"], INFO).tolist() == [0.5 + 2 - 4, 0.5 + 1 - 2]


def test_an_nn_module_reward_model_scores_the_prompt_and_completion_re_tokenized_and_right_padded():
    from ppokit.lm.tiny import build_char_tokenizer

    class SumIds(nn.Module):
        def forward(self, input_ids, attention_mask):
            return (input_ids * attention_mask).sum(-1, keepdim=True).float()  # [B, 1]

    tok = build_char_tokenizer("pab")  # ids: p 3, a 4, b 5
    # The policy's ids in info are not what it reads: the text, tokenized by the tokenizer it is given.
    assert make_reward(SumIds(), tok)(["p", "pp"], ["a", "bb"], INFO).tolist() == [3 + 4, 3 + 3 + 5 + 5]


def test_bad_rewards_fail_with_one_clear_line():
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        make_reward(lambda p, c: [1.0])(["p", "p"], ["a", "b"], INFO)
    with pytest.raises(ValueError, match="non-finite value"):
        make_reward(lambda p, c: [1.0, float("nan")])(["p", "p"], ["a", "b"], INFO)
    with pytest.raises(ValueError, match=r"reward\[0\]'s weight"):
        make_reward([(lambda p, c: [1.0], "heavy")])
    with pytest.raises(ValueError, match="reward must be a callable"):
        make_reward(42)


# ---------------------------------------------------------------- the rollout with a scripted generator
class Scripted:
    """A ``Generator`` that returns fixed responses (to test what the rollout does with them)."""

    def __init__(self, responses):
        self.responses = responses

    def generate(self, model, prompt_ids, prompt_mask, settings):
        return torch.tensor(self.responses, dtype=torch.long)


@pytest.fixture(scope="module")
def tiny_pad_eos():
    return build_tiny("ABX:", pad_is_eos=True, seed=0)


def test_the_rollout_masks_through_eos_and_applies_the_missing_eos_penalty(tiny_pad_eos):
    model, tok = tiny_pad_eos
    a, x = tok.convert_tokens_to_ids("A"), tok.convert_tokens_to_ids("X")
    settings = SamplingSettings(4, 1.0, tok.eos_token_id, tok.pad_token_id)
    assert tok.pad_token_id == tok.eos_token_id
    gen = Scripted([[x, tok.eos_token_id, tok.eos_token_id, tok.eos_token_id], [a, x, a, x]])
    seen = {}

    def reward(prompts, completions, eos):
        seen["completions"], seen["eos"] = completions, eos
        return [1.0, 1.0]

    s = sample(model, tok, gen, ["X:", "AX:"], settings, make_reward(reward), torch.device("cpu"),
               missing_eos_penalty=0.25)
    assert seen["completions"] == ["X", "AXAX"] and seen["eos"] == [True, False]
    assert s.batch.response_mask.tolist() == [[True, True, False, False], [True] * 4]
    assert s.batch.scores.tolist() == [1.0, 0.75] and s.raw_scores.tolist() == [1.0, 1.0]
    # Left padding: both prompts end at the same column, the shorter one padded in front, masked out.
    assert s.batch.attention_mask[:, :3].tolist() == [[0, 1, 1], [1, 1, 1]]


# ---------------------------------------------------------------- config
def test_lmconfig_defaults_validate_and_name_the_bad_field():
    assert LMConfig().validate().rollout_size == 64
    for kwargs, field in [({"batch_prompts": 0}, "batch_prompts"), ({"temperature": 0.0}, "temperature"),
                          ({"kl_estimator": "k2"}, "kl_estimator"), ({"scale_rewards": "std"}, "scale_rewards"),
                          ({"loss_reduction": "sum"}, "loss_reduction"), ({"learning_rate": float("nan")},
                                                                            "learning_rate"),
                          ({"group_size": True}, "group_size"), ({"beta": "0.1"}, "beta"),
                          ({"missing_eos_penalty": -1.0}, "missing_eos_penalty"),
                          ({"num_minibatches": 65}, "num_minibatches"), ({"device": "tpu"}, "device")]:
        with pytest.raises(ConfigError) as err:
            LMConfig(**kwargs).validate()
        assert err.value.field == field, (kwargs, err.value)


@pytest.mark.parametrize("kwargs,field", [({"update_epochs": 31}, "update_epochs"), ({"clip_coef": 0.31}, "clip_coef"),
                                          ({"whiten_advantages": False}, "whiten_advantages"),
                                          ({"monitor_kl": False}, "monitor_kl"),
                                          ({"monitor_clipfrac": False}, "monitor_clipfrac")])
def test_guard_rails_refuse_unless_unsafe(kwargs, field):
    with pytest.raises(ConfigError, match="unsafe") as err:
        LMConfig(**kwargs).validate()
    assert err.value.field == field
    LMConfig(**kwargs, unsafe=True).validate()


def test_from_dict_refuses_an_unknown_field():
    with pytest.raises(ConfigError, match="not an LMConfig field"):
        LMConfig.from_dict({"lerning_rate": 1e-3})
    assert LMConfig.from_dict(LMConfig(seed=3).to_dict()).seed == 3


# ---------------------------------------------------------------- prompts
def test_prompt_files_load_and_bad_lines_are_named(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "a:"}) + "\n\n" + json.dumps("b:") + "\n")
    assert load_prompts(jl) == ["a:", "b:"]
    txt = tmp_path / "p.txt"
    txt.write_text("x:\n\ny:\n")
    assert load_prompts(txt) == ["x:", "y:"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"text": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_prompts(bad)


def test_a_prompt_list_cycles_in_a_seeded_order_and_resumes_from_its_position():
    items = [f"p{i}" for i in range(5)]
    a = PromptSource(items, seed=3)
    first = a.take(7)
    assert sorted(first[:5]) == sorted(items)  # one pass visits every prompt once
    b = PromptSource(items, seed=3)
    b.load_state(a.state())
    assert a.take(6) == b.take(6)
    assert PromptSource(items, seed=4).take(5) != first[:5]


def test_a_one_shot_iterable_is_read_lazily_and_replayed_on_resume():
    a = PromptSource(iter(["a", "b", "c", "d"]), seed=0)
    assert a.take(2) == ["a", "b"]
    b = PromptSource(iter(["a", "b", "c", "d"]), seed=0)
    b.load_state(a.state())
    assert b.take(2) == ["c", "d"]
    with pytest.raises(ValueError, match="ran out after 4"):
        b.take(1)


# ---------------------------------------------------------------- import cost
def test_import_ppokit_lm_and_lmconfig_load_no_transformers(tmp_path):
    code = ("import sys, ppokit, ppokit.lm; from ppokit.lm import LMConfig; LMConfig().validate(); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- live LM alerts
def test_live_lm_alerts_fire_on_runaway_kl_and_on_sustained_zero_std_groups():
    from ppokit.analysis.doctor_lm import KL_REF_RUNAWAY, ZERO_STD_FRAC
    from ppokit.core import schema as S
    from ppokit.lm.alerts import LMAlerts

    alerts = LMAlerts("beta", cooldown=10)
    assert alerts.check(1, {S.KL_REF: KL_REF_RUNAWAY * 0.9}) == []
    fired = alerts.check(2, {S.KL_REF: KL_REF_RUNAWAY * 1.5})
    assert [a.name for a in fired] == ["kl_ref_runaway"] and "raise beta" in fired[0].message
    assert alerts.check(3, {S.KL_REF: KL_REF_RUNAWAY * 2}) == []  # rate-limited
    patience = int(S.THRESHOLDS["reward_patience"])
    names = [[a.name for a in alerts.check(10 + i, {S.FRAC_REWARD_ZERO_STD: ZERO_STD_FRAC})] for i in range(patience)]
    assert names[-1] == ["zero_reward_variance"] and all(n == [] for n in names[:-1])
    fresh = LMAlerts("kl_coef")  # an interrupted streak starts over
    for i, frac in enumerate([1.0] * (patience - 1) + [0.0, 1.0]):
        assert fresh.check(i, {S.FRAC_REWARD_ZERO_STD: frac}) == []


def test_token_gae_matches_a_per_sequence_loop_on_ragged_responses():
    # The independent reference: TRL-style reversed loop over each response's real tokens, bootstrapping 0 after
    # the last one (the episode ends at the EOS / the budget).
    g = torch.Generator().manual_seed(0)
    B, R, gamma, lam = 6, 7, 0.9, 0.8
    lengths = [0, 1, 3, 7, 5, 2]
    mask = torch.arange(R)[None, :] < torch.tensor(lengths)[:, None]
    rewards, values = torch.randn(B, R, generator=g), torch.randn(B, R, generator=g)
    adv, ret = token_advantages(rewards, values, mask, gamma, lam, whiten=False)
    for b, n in enumerate(lengths):
        last = 0.0
        for t in reversed(range(n)):
            next_value = float(values[b, t + 1]) if t + 1 < n else 0.0
            last = float(rewards[b, t]) + gamma * next_value - float(values[b, t]) + gamma * lam * last
            assert float(adv[b, t]) == pytest.approx(last, rel=1e-5, abs=1e-6)
            assert float(ret[b, t]) == pytest.approx(last + float(values[b, t]), rel=1e-5, abs=1e-6)
        assert adv[b, n:].abs().sum() == 0
    whitened, _ = token_advantages(rewards, values, mask, gamma, lam, whiten=True)
    real = whitened[mask]
    assert abs(float(real.mean())) < 1e-6 and float(real.std(unbiased=False)) == pytest.approx(1.0, rel=1e-4)
    assert torch.equal(token_advantages(rewards, values, mask, gamma, lam)[0], whitened)  # whitened by default


def test_token_gae_of_one_token_responses_is_the_reward_minus_the_value_and_of_none_is_empty():
    # One token per response: the episode ends at once, so A = r - V and the return is r (no bootstrap).
    mask = torch.tensor([[True], [True], [False]])
    adv, ret = token_advantages(torch.tensor([[2.0], [-1.0], [5.0]]), torch.tensor([[0.5], [0.25], [9.0]]), mask,
                                gamma=0.9, lam=0.8, whiten=False)
    assert adv.tolist() == [[1.5], [-1.25], [0.0]] and ret.tolist() == [[2.0], [-1.0], [0.0]]
    empty = torch.zeros(2, 0)
    adv, ret = token_advantages(empty, empty, torch.zeros(2, 0, dtype=torch.bool), 0.9, 0.8)
    assert adv.shape == ret.shape == (2, 0)


def test_the_log_prob_forward_skips_the_last_position_and_matches_the_full_forward(tiny_pad_eos):
    """The response's log-probs come from positions P - 1 .. P + R - 2, so the forward runs on ``[:, :-1]`` (the
    last position's logits are never read); reading the full forward's logits at those positions gives the same."""
    from ppokit.lm.logprobs import token_logprobs

    model, tok = tiny_pad_eos
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 9), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :2] = 0  # left padding
    attn[1, -2:] = 0  # padding after a stop
    R = 4
    lengths = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        with torch.no_grad():
            logp, entropy = token_logprobs(model, ids, attn, R, 0.7, with_entropy=True)
    finally:
        handle.remove()
    assert lengths == [ids.shape[1] - 1]
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), use_cache=False).logits
    ref = torch.log_softmax(full[:, -(R + 1):-1].float() / 0.7, -1)
    assert torch.allclose(logp, ref.gather(-1, ids[:, -R:, None]).squeeze(-1), atol=1e-5)
    assert torch.allclose(entropy, -(ref.exp() * ref).sum(-1), atol=1e-5)
