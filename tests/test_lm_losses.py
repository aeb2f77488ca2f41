"""The LM policy-loss registry (``ppokit.lm.losses``): each loss against a hand computation, its gradients, and
the registry's rules. Plain tensors: no model or tokenizer is needed."""

from __future__ import annotations

import math

import pytest
import torch

from ppokit.lm.losses import LOSSES, LossSettings, get_loss, register_loss

B, R = 3, 5


def _tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    logp = (logp_old + 0.3 * torch.randn(B, R, generator=g, dtype=torch.float64)).requires_grad_(True)
    logp_ref = logp_old + 0.2 * torch.randn(B, R, generator=g, dtype=torch.float64)
    adv = torch.randn(B, R, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    return logp, logp_old, logp_ref, adv, mask


def _hand_ppo(logp, logp_old, logp_ref, adv, mask, eps, beta):
    """Token by token with Python floats: -min(rA, clip(r)A) + beta * k3, averaged over the real tokens."""
    total, n = 0.0, 0
    logp = logp.detach()
    for b in range(B):
        for t in range(R):
            if not mask[b, t]:
                continue
            r = math.exp(float(logp[b, t]) - float(logp_old[b, t]))
            a = float(adv[b, t])
            term = -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            if beta:
                lr = float(logp_ref[b, t]) - float(logp[b, t])
                term += beta * (math.exp(lr) - 1 - lr)
            total, n = total + term, n + 1
    return total / n


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_the_ppo_loss_is_the_clipped_surrogate_plus_beta_k3_kl(beta):
    logp, logp_old, logp_ref, adv, mask = _tokens()
    s = LossSettings(clip_coef=0.2, beta=beta, reduction="token_mean")
    loss, stats = get_loss("ppo")(logp, logp_old, logp_ref, adv, mask, s)
    assert float(loss.detach()) == pytest.approx(_hand_ppo(logp, logp_old, logp_ref, adv, mask, 0.2, beta), rel=1e-12)
    assert ("kl_ref_token" in stats) == (beta > 0)
    loss.backward()
    assert torch.all(logp.grad[~mask] == 0) and torch.any(logp.grad[mask] != 0)


def test_at_ratio_one_the_ppo_loss_is_minus_the_mean_advantage_and_nothing_clips():
    _, logp_old, _, adv, mask = _tokens(1)
    logp = logp_old.clone().requires_grad_(True)
    loss, stats = get_loss("ppo")(logp, logp_old, None, adv, mask, LossSettings(clip_coef=0.2))
    assert float(loss.detach()) == pytest.approx(-float(adv[mask].mean()), rel=1e-12)
    assert float(stats["clipfrac"]) == 0.0 and float(stats["approx_kl"]) == 0.0


def test_the_kl_term_pulls_the_policy_back_to_the_reference():
    # Zero advantages: the loss is beta * KL alone, its gradient is nonzero, and one descent step lowers the KL.
    logp, logp_old, logp_ref, _, mask = _tokens(2)
    zero = torch.zeros(B, R, dtype=torch.float64)
    s = LossSettings(beta=0.5)
    loss, stats = get_loss("ppo")(logp, logp_old, logp_ref, zero, mask, s)
    assert float(loss.detach()) == pytest.approx(0.5 * float(stats["kl_ref_token"]), rel=1e-12) and float(loss.detach()) > 0
    loss.backward()
    assert float(logp.grad[mask].abs().sum()) > 0
    with torch.no_grad():
        stepped = logp - 1.0 * logp.grad
    after, _ = get_loss("ppo")(stepped, logp_old, logp_ref, zero, mask, s)
    assert float(after.detach()) < float(loss.detach())


def test_the_dpo_loss_matches_a_hand_computation():
    logp, _, logp_ref, _, _ = _tokens(3)
    logp = torch.cat([logp, logp.detach() - 0.5]).detach().requires_grad_(True)  # 3 chosen over 3 rejected
    logp_ref = torch.cat([logp_ref, logp_ref - 0.1])
    mask = torch.ones(2 * B, R, dtype=torch.bool)
    mask[1, 3:] = mask[4, 2:] = False
    beta = 0.1
    loss, stats = get_loss("dpo")(logp, None, logp_ref, None, mask, LossSettings(beta=beta))
    seq = [(sum(float(logp.detach()[i, t]) for t in range(R) if mask[i, t]),
            sum(float(logp_ref[i, t]) for t in range(R) if mask[i, t])) for i in range(2 * B)]
    z = [beta * (seq[i][0] - seq[i][1]) - beta * (seq[i + B][0] - seq[i + B][1]) for i in range(B)]
    hand = sum(math.log1p(math.exp(-x)) for x in z) / B
    assert float(loss.detach()) == pytest.approx(hand, rel=1e-12)
    assert float(stats["accuracy"]) == pytest.approx(sum(x > 0 for x in z) / B)
    loss.backward()
    assert torch.all(logp.grad[~mask] == 0)


def test_at_the_reference_every_dpo_reward_is_zero_and_a_tie_is_not_an_accurate_pair():
    """Before the first step pi_theta is pi_ref: each implicit reward is 0, so chosen and rejected tie, which
    counts as wrong (TRL's accuracy is ``chosen_rewards > rejected_rewards``), and the loss is log 2."""
    _, _, logp_ref, _, _ = _tokens(4)
    logp_ref = torch.cat([logp_ref, logp_ref - 0.3])
    mask = torch.ones(2 * B, R, dtype=torch.bool)
    loss, stats = get_loss("dpo")(logp_ref.clone(), None, logp_ref, None, mask, LossSettings(beta=0.1))
    assert float(stats["accuracy"]) == 0.0 and float(stats["margin"]) == 0.0
    assert float(stats["chosen_rewards"]) == 0.0 and float(stats["rejected_rewards"]) == 0.0
    assert float(loss) == pytest.approx(math.log(2), rel=1e-12)


def test_the_registry_refuses_a_taken_name_and_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown policy loss 'nope'; known: dpo, ppo"):
        get_loss("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_loss("ppo")(lambda *a: None)


def test_a_new_loss_is_one_function_and_one_registration():
    @register_loss("test_plain_pg")
    def plain_pg(logp, logp_old, logp_ref, advantages, mask, s):
        return -(logp * advantages)[mask].mean(), {}

    try:
        logp, logp_old, _, adv, mask = _tokens(4)
        loss, _ = get_loss("test_plain_pg")(logp, logp_old, None, adv, mask, LossSettings())
        assert float(loss.detach()) == pytest.approx(-float((logp * adv)[mask].mean()))
    finally:
        LOSSES.pop("test_plain_pg")


def test_a_registered_loss_is_what_a_trainer_trains_with_when_the_config_names_it():
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    from ppokit.core import schema as S
    from ppokit.lm import GRPOTrainer, LMConfig
    from ppokit.lm.tiny import build_tiny

    calls = []

    @register_loss("test_counted_ppo")
    def counted(logp, logp_old, logp_ref, advantages, mask, s):
        calls.append(tuple(logp.shape))
        loss, stats = get_loss("ppo")(logp, logp_old, logp_ref, advantages, mask, s)
        return 2.0 * loss, {**stats, "policy_loss": 2.0 * stats["policy_loss"]}

    try:
        model, tok = build_tiny("ABX:", pad_is_eos=True, seed=0)
        cfg = dict(learning_rate=3e-3, batch_prompts=2, group_size=4, max_new_tokens=6, update_epochs=1,
                   num_minibatches=2, tensorboard=False, console=False)
        t = GRPOTrainer(model, tok, reward=lambda p, c: [c_.count("X") / 4 for c_ in c], prompts=["X:", "AB:"],
                        config=LMConfig(**cfg, policy_loss="test_counted_ppo"))
        m = t.step()
        assert len(calls) == 2 and all(shape[0] == 4 for shape in calls)  # two minibatches of 4 completions
        assert math.isfinite(m[S.POLICY_LOSS])
    finally:
        LOSSES.pop("test_counted_ppo")


def test_the_ratio_diagnostics_are_means_over_the_real_tokens_only():
    # Padding positions have ratio 1 (k3 = k1 = 0, never clipped): counted in the denominator they would shrink
    # every diagnostic by the padding's share (here 6 of 15 positions).
    logp, logp_old, _, adv, mask = _tokens(5)
    eps = 0.2
    _, stats = get_loss("ppo")(logp, logp_old, None, adv, mask, LossSettings(clip_coef=eps))
    lr = (logp.detach() - logp_old)[mask]  # log-ratios of the real tokens, by hand
    k3 = float((lr.exp() - 1 - lr).mean())  # (r - 1) - log r, objectives.approx_kl_k3
    k1 = float((-lr).mean())
    clipped = float(((lr.exp() - 1).abs() > eps).double().mean())
    assert 0 < clipped < 1  # the case can tell a mean over real tokens from one over every position
    assert float(stats["approx_kl"]) == pytest.approx(k3, rel=1e-9)
    assert float(stats["approx_kl_k1"]) == pytest.approx(k1, rel=1e-9)
    assert float(stats["clipfrac"]) == pytest.approx(clipped, rel=1e-6)  # a float32 share


def test_settings_for_carries_each_lm_config_knob_into_the_loss():
    from ppokit.lm import LMConfig
    from ppokit.lm.losses import settings_for

    cfg = LMConfig(clip_coef=0.1, loss_reduction="seq_mean_token_sum_norm", max_new_tokens=7)
    assert settings_for(cfg, beta=0.3) == LossSettings(clip_coef=0.1, beta=0.3, reduction="seq_mean_token_sum_norm",
                                                       normalizer=7)
