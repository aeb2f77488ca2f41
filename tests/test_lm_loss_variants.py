"""The loss variants people run (TRL's GRPO ``loss_type``, DAPO's clip-higher, GSPO's sequence ratio, RLOO and
REINFORCE++ advantages, the std's ddof, DPO's IPO / hinge / label smoothing): each one through the config value
that chooses it, against the formula as TRL documents it or the paper writes it, recomputed here with Python
floats, token by token. Plus the GRPO trainer's dynamic sampling and truncated-completion masking on real rollouts."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from ppokit.core.errors import ConfigError
from ppokit.lm.config import LMConfig
from ppokit.lm.grpo import group_advantages
from ppokit.lm.losses import get_loss, settings_for

B, R = 4, 6
MAX_NEW = 8


def _tokens(seed=0, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    logp = (logp_old + spread * torch.randn(B, R, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, R).contiguous()
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]],
                        dtype=torch.bool)
    return logp, logp_old, adv, mask


def _hand_terms(logp, logp_old, adv, mask, lo, hi, sequence=False):
    """-min(r A, clip(r, 1 - lo, 1 + hi) A) per real token, as lists per row; r per token, or GSPO's
    exp(mean log-ratio) of the row."""
    rows = []
    for b in range(B):
        ts = [t for t in range(R) if mask[b, t]]
        seq_r = math.exp(sum(float(logp[b, t]) - float(logp_old[b, t]) for t in ts) / len(ts))
        row = []
        for t in ts:
            r = seq_r if sequence else math.exp(float(logp[b, t]) - float(logp_old[b, t]))
            a = float(adv[b, t])
            row.append(-min(r * a, min(max(r, 1 - lo), 1 + hi) * a))
        rows.append(row)
    return rows


def _loss(cfg, logp, logp_old, adv, mask, tokens=None):
    s = settings_for(cfg.validate(), beta=0.0, tokens_per_minibatch=tokens)
    return get_loss("ppo")(logp, logp_old, None, adv, mask, s)


# ---------------------------------------------------------------- loss_type: the four normalizations
def test_loss_type_grpo_averages_each_sequences_token_mean():
    logp, logp_old, adv, mask = _tokens(1)
    rows = _hand_terms(logp.detach(), logp_old, adv, mask, 0.2, 0.2)
    hand = sum(sum(r) / len(r) for r in rows) / B
    assert float(_loss(LMConfig(loss_type="grpo"), logp, logp_old, adv, mask)[0].detach()) == pytest.approx(hand, rel=1e-12)


def test_loss_type_bnpo_divides_the_token_sum_by_the_minibatch_tokens():
    logp, logp_old, adv, mask = _tokens(2)
    rows = _hand_terms(logp.detach(), logp_old, adv, mask, 0.2, 0.2)
    hand = sum(map(sum, rows)) / sum(map(len, rows))
    assert float(_loss(LMConfig(loss_type="bnpo"), logp, logp_old, adv, mask)[0]) == pytest.approx(hand, rel=1e-12)


def test_loss_type_dr_grpo_divides_the_token_sum_by_sequences_times_the_generation_budget():
    logp, logp_old, adv, mask = _tokens(3)
    rows = _hand_terms(logp.detach(), logp_old, adv, mask, 0.2, 0.2)
    hand = sum(map(sum, rows)) / (B * MAX_NEW)
    cfg = LMConfig(loss_type="dr_grpo", max_new_tokens=MAX_NEW)
    assert float(_loss(cfg, logp, logp_old, adv, mask)[0]) == pytest.approx(hand, rel=1e-12)


def test_loss_type_dapo_divides_the_token_sum_by_the_rollouts_tokens_per_minibatch():
    # DAPO eq. 10: 1 / sum_i |o_i| over the whole batch; a minibatch gets the rollout's mean token count, so the
    # minibatch with 12 tokens here is divided by 17.5, not by its own 12 (which would be bnpo).
    logp, logp_old, adv, mask = _tokens(4)
    rows = _hand_terms(logp.detach(), logp_old, adv, mask, 0.2, 0.2)
    hand = sum(map(sum, rows)) / 17.5
    loss, _ = _loss(LMConfig(loss_type="dapo"), logp, logp_old, adv, mask, tokens=17.5)
    assert float(loss) == pytest.approx(hand, rel=1e-12)
    # Without a positive token count there is nothing to divide by: one error line, not a TypeError mid-update.
    cfg = LMConfig(loss_type="dapo").validate()
    for tokens in (None, 0.0, -3.0):
        with pytest.raises(ValueError, match=r"^loss_type dapo needs the rollout's tokens per minibatch"):
            settings_for(cfg, beta=0.0, tokens_per_minibatch=tokens)
    assert settings_for(cfg, beta=0.0, tokens_per_minibatch=0.5).normalizer == 0.5  # a fraction of a token is > 0


def test_loss_type_conflicting_with_loss_reduction_and_bad_names_are_refused_naming_the_field():
    LMConfig(loss_type="grpo", loss_reduction="seq_mean_token_mean").validate()  # the same reduction: fine
    with pytest.raises(ConfigError, match="loss_type"):
        LMConfig(loss_type="bnpo", loss_reduction="seq_mean_token_mean").validate()
    with pytest.raises(ConfigError, match="loss_type"):
        LMConfig(loss_type="ppo").validate()


# ---------------------------------------------------------------- clip-higher and GSPO
def test_epsilon_high_widens_only_the_upper_clip():
    logp, logp_old, adv, mask = _tokens(5, spread=0.25)
    cfg = LMConfig(loss_type="bnpo", epsilon_high=0.28)
    loss, _ = _loss(cfg, logp, logp_old, adv, mask)
    rows = _hand_terms(logp.detach(), logp_old, adv, mask, 0.2, 0.28)
    assert float(loss) == pytest.approx(sum(map(sum, rows)) / sum(map(len, rows)), rel=1e-12)
    # The tokens clip-higher frees exist in this draw: r in (1.2, 1.28] with A > 0 now pass a gradient.
    r = (logp.detach() - logp_old).exp()
    freed = mask & (r > 1.2) & (r <= 1.28) & (adv > 0)
    assert freed.any()
    loss.backward()
    assert torch.all(logp.grad[freed] != 0)
    # The lower clip stays 1 - clip_coef: with A < 0 a ratio under 0.8 is clipped (no gradient).
    logp, logp_old, adv, mask = _tokens(0, spread=0.6)
    loss, _ = _loss(cfg, logp, logp_old, adv, mask)
    rows = _hand_terms(logp.detach(), logp_old, adv, mask, 0.2, 0.28)
    assert float(loss) == pytest.approx(sum(map(sum, rows)) / sum(map(len, rows)), rel=1e-12)
    r = (logp.detach() - logp_old).exp()
    held = mask & (r < 0.8) & (adv < 0)
    assert held.any()
    loss.backward()
    assert torch.all(logp.grad[held] == 0)


def test_importance_sampling_level_sequence_is_gspos_length_normalized_sequence_ratio():
    logp, logp_old, adv, mask = _tokens(6, spread=0.1)
    cfg = LMConfig(loss_type="grpo", importance_sampling_level="sequence")
    loss, stats = _loss(cfg, logp, logp_old, adv, mask)
    rows = _hand_terms(logp.detach(), logp_old, adv, mask, 0.2, 0.2, sequence=True)
    assert float(loss) == pytest.approx(sum(sum(r) / len(r) for r in rows) / B, rel=1e-12)
    # The gradient flows through the mean log-ratio: d/d logp_t of -s_i A_i / 1 (unclipped) is -s_i A_i / |o_i|
    # on every real token of row i (the grpo reduction's 1/|o_i| per token and 1/B then apply).
    loss.backward()
    for b in range(B):
        n = int(mask[b].sum())
        s_i = math.exp(float(((logp.detach() - logp_old)[b][mask[b]]).mean()))
        a = float(adv[b, 0])
        if 0.8 <= s_i <= 1.2:
            want = -s_i * a / n / B
            assert torch.allclose(logp.grad[b][mask[b]], torch.full((n,), want, dtype=torch.float64), rtol=1e-9)
        assert torch.all(logp.grad[b][~mask[b]] == 0)


def test_the_new_policy_loss_fields_are_refused_with_their_name():
    for kw, field in [(dict(epsilon_high=0.0), "epsilon_high"), (dict(importance_sampling_level="seq"),
                      "importance_sampling_level"), (dict(advantage_estimator="ppo"), "advantage_estimator"),
                      (dict(advantage_estimator="reinforce++"), "advantage_estimator"),
                      (dict(std_ddof=2), "std_ddof"), (dict(dpo_loss="kto"), "dpo_loss"),
                      (dict(label_smoothing=0.5), "label_smoothing"),
                      (dict(label_smoothing=0.1, dpo_loss="ipo"), "label_smoothing"),
                      (dict(drop_zero_std_groups=1), "drop_zero_std_groups")]:
        with pytest.raises(ConfigError, match=field):
            LMConfig(**kw).validate()


# ---------------------------------------------------------------- advantage estimators
REWARDS = [1.0, 0.0, 0.5, 2.0, 3.0, 3.0, 3.0, 3.0, -1.0, 0.0, 4.0, 1.0]  # three groups of 4; the second constant
G = 4


def _groups():
    return [REWARDS[i:i + G] for i in range(0, len(REWARDS), G)]


@pytest.mark.parametrize("ddof", [0, 1])
def test_grpo_advantages_are_centred_on_the_group_mean_and_scaled_by_its_std_with_the_ddof(ddof):
    std = statistics.pstdev if ddof == 0 else statistics.stdev
    hand = []
    for g in _groups():
        m, sd = statistics.fmean(g), std(g)
        hand += [0.0 if sd == 0 else (r - m) / (sd + 1e-4) for r in g]
    adv, zero = group_advantages(torch.tensor(REWARDS), G, "group", 1e-4, estimator="grpo", ddof=ddof)
    assert adv.tolist() == pytest.approx(hand, rel=1e-5, abs=1e-6)
    assert zero.tolist() == [False, True, False]


@pytest.mark.parametrize("mean", [1.0, 4.0])
@pytest.mark.parametrize("ulps", [29, 32])
@pytest.mark.parametrize("ddof", [0, 1])
def test_the_zero_std_rule_reads_the_population_spread_whatever_the_ddof(ddof, ulps, mean):
    # mean -+ 29 (or exactly 32) float32 epsilons times the mean, all exact: population std 29 (32) of them,
    # within the noise rule (SPREAD_ULPS = 32, "at most", relative to |mean|), so the group is constant; Bessel's
    # std (x sqrt 2: 41, 45) is above it, and must not decide.
    d = ulps * 2.0 ** -23 * mean
    adv, zero = group_advantages(torch.tensor([mean - d, mean + d, 2.0, 3.0]), 2, "group", 1e-4, ddof=ddof)
    assert zero.tolist() == [True, False] and adv[:2].tolist() == [0.0, 0.0]
    sd = (statistics.pstdev if ddof == 0 else statistics.stdev)([2.0, 3.0])
    assert adv[2:].tolist() == pytest.approx([-0.5 / (sd + 1e-4), 0.5 / (sd + 1e-4)], rel=1e-6)


def test_rloo_subtracts_the_mean_of_the_other_completions_of_the_group():
    hand = []
    for g in _groups():
        hand += [r - (sum(g) - r) / (G - 1) for r in g]
    adv, _ = group_advantages(torch.tensor(REWARDS), G, "none", estimator="rloo")
    assert adv.tolist() == pytest.approx(hand, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("ddof", [0, 1])
def test_reinforce_plus_plus_whitens_over_the_batch_so_a_constant_group_keeps_its_signal(ddof):
    std = statistics.pstdev if ddof == 0 else statistics.stdev
    m, sd = statistics.fmean(REWARDS), std(REWARDS)
    hand = [(r - m) / (sd + 1e-4) for r in REWARDS]
    adv, _ = group_advantages(torch.tensor(REWARDS), G, "batch", 1e-4, estimator="reinforce++", ddof=ddof)
    assert adv.tolist() == pytest.approx(hand, rel=1e-5)
    assert all(a > 0 for a in adv[4:8].tolist())  # the constant group of 3.0s is above the batch mean


def test_scale_rewards_batch_divides_by_the_batch_std_with_the_ddof():
    sd = statistics.stdev(REWARDS)
    hand = []
    for g in _groups():
        m = statistics.fmean(g)
        hand += [(r - m) / (sd + 1e-4) for r in g]
    adv, _ = group_advantages(torch.tensor(REWARDS), G, "batch", 1e-4, estimator="grpo", ddof=1)
    assert adv.tolist() == pytest.approx(hand, rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------- DPO variants
def _pairs(seed=7):
    g = torch.Generator().manual_seed(seed)
    n = 3
    logp = (-torch.rand(2 * n, R, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    logp_ref = -torch.rand(2 * n, R, generator=g, dtype=torch.float64) * 2
    mask = torch.ones(2 * n, R, dtype=torch.bool)
    mask[1, 4:] = mask[3, 2:] = mask[5, 5:] = False
    return n, logp, logp_ref, mask


def _h(logp, logp_ref, mask, i, mean=False):
    ts = [t for t in range(R) if mask[i, t]]
    d = sum(float(logp[i, t]) - float(logp_ref[i, t]) for t in ts)
    return d / len(ts) if mean else d


def _dpo(cfg, logp, logp_ref, mask):
    s = settings_for(cfg.validate(), beta=cfg.beta)
    return get_loss("dpo")(logp, None, logp_ref, None, mask, s)[0]


@pytest.mark.parametrize("ls", [0.0, 0.2])
def test_dpo_sigmoid_with_label_smoothing_is_the_conservative_dpo_loss(ls):
    n, logp, logp_ref, mask = _pairs()
    beta = 0.3
    lp = logp.detach()
    hand = 0.0
    for i in range(n):
        z = beta * (_h(lp, logp_ref, mask, i) - _h(lp, logp_ref, mask, i + n))
        log_sig = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
        hand += -(1 - ls) * log_sig(z) - ls * log_sig(-z)
    loss = _dpo(LMConfig(beta=beta, label_smoothing=ls), logp, logp_ref, mask)
    assert float(loss) == pytest.approx(hand / n, rel=1e-12)


@pytest.mark.parametrize("one_token", [False, True])
def test_dpo_ipo_is_the_squared_distance_of_the_length_normalized_margin_to_one_over_two_beta(one_token):
    n, logp, logp_ref, mask = _pairs(8)
    if one_token:  # a one-token completion: its mean is its one log-ratio
        mask[3, 1:] = False
    beta = 0.25  # 1 / (2 beta) = 2, not 2 beta (at beta = 0.5 the two are equal)
    lp = logp.detach()
    hand = sum((_h(lp, logp_ref, mask, i, True) - _h(lp, logp_ref, mask, i + n, True) - 1 / (2 * beta)) ** 2
               for i in range(n)) / n
    loss = _dpo(LMConfig(beta=beta, dpo_loss="ipo"), logp, logp_ref, mask)
    assert float(loss) == pytest.approx(hand, rel=1e-12)


def test_dpo_hinge_is_slics_margin_loss():
    n, logp, logp_ref, mask = _pairs(9)
    beta = 0.8
    lp = logp.detach()
    hand = sum(max(0.0, 1 - beta * (_h(lp, logp_ref, mask, i) - _h(lp, logp_ref, mask, i + n)))
               for i in range(n)) / n
    loss = _dpo(LMConfig(beta=beta, dpo_loss="hinge"), logp, logp_ref, mask)
    assert hand > 0 and float(loss) == pytest.approx(hand, rel=1e-12)


# ---------------------------------------------------------------- the GRPO trainer on real rollouts
def _grpo(reward, **kw):
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    from ppokit.lm import GRPOTrainer
    from ppokit.lm.tiny import build_tiny

    model, tok = build_tiny("ABX:", seed=0)
    cfg = LMConfig(batch_prompts=2, group_size=4, max_new_tokens=5, update_epochs=1, num_minibatches=2, beta=0.0,
                   learning_rate=1e-2, tensorboard=False, console=False, **kw)
    return GRPOTrainer(model, tok, reward=reward, prompts=["AB:", "X:"], config=cfg)


def test_drop_zero_std_groups_keeps_only_the_rows_of_groups_with_a_spread():
    # The "X:" group's rewards are all 1.0; the "AB:" group's are its completions' lengths, which vary.
    def reward(prompts, completions):
        return [1.0 if p == "X:" else float(len(c)) for p, c in zip(prompts, completions)]

    t = _grpo(reward, drop_zero_std_groups=True, seed=2)
    prompts = ["AB:"] * 4 + ["X:"] * 4
    s = t._sample(prompts, with_ref=False)
    _, zero = group_advantages(s.batch.scores, 4)
    assert zero.tolist() == [False, True], "the draw must give the AB: group a spread"
    train = t._update_batch(s.batch, s.has_eos, zero)
    assert len(train) == 4 and torch.equal(train.input_ids, s.batch.input_ids[:4])
    assert t._tokens_per_minibatch == pytest.approx(float(s.batch.response_mask[:4].sum()) / 2)


def test_when_every_group_is_constant_drop_zero_std_groups_skips_the_update_and_the_weights_stay():
    from ppokit.core import schema as S

    t = _grpo(lambda p, c: [1.0] * len(c), drop_zero_std_groups=True)
    before = [p.detach().clone() for p in t.policy.parameters()]
    m = t.step()
    assert m[S.MINIBATCHES] == 0 and m[S.FRAC_REWARD_ZERO_STD] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, t.policy.parameters()))


def test_mask_truncated_completions_removes_completions_without_a_stop_token_from_the_loss():
    t = _grpo(lambda p, c: [float(len(x)) for x in c], mask_truncated_completions=True, seed=5)
    s = t._sample(["AB:"] * 4 + ["X:"] * 4, with_ref=False)
    truncated = ~s.has_eos
    assert truncated.any() and (~truncated).any(), "the draw must hold both kinds"
    _, zero = group_advantages(s.batch.scores, 4)
    train = t._update_batch(s.batch, s.has_eos, zero)
    assert not train.response_mask[truncated].any()
    assert torch.equal(train.response_mask[~truncated], s.batch.response_mask[~truncated])
    assert s.batch.response_mask[truncated].any()  # the rollout itself is untouched (its metrics use it)


@pytest.mark.parametrize("flag,value,field", [("--loss-type", "ppo", "loss_type"), ("--dpo-loss", "kto", "dpo_loss"),
                                              ("--epsilon-high", "-1", "epsilon_high"),
                                              ("--std-ddof", "2", "std_ddof")])
def test_a_bad_loss_variant_flag_is_one_error_line_naming_the_field(flag, value, field, capsys):
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    from ppokit.cli import main

    rc = main(["lm", "grpo", "--model", "m", "--reward", "r:f", "--prompts", "p.jsonl", flag, value])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and field in err[0] and "Traceback" not in err[0]
