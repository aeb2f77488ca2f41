"""How the LM trainers assemble their losses, observed on the trainers' own path (``trainer.step()`` with the
trainer's ``_loss`` wrapped to record what each minibatch computed) on a real tiny GPT-2:

- GRPO with the policy a perturbed copy of pi_ref, beta > 0 and zero advantages: the loss is +beta * the k3
  KL(pi_theta || pi_ref) (computed here independently from the two models), its gradient is nonzero, and the one
  descent step lowers that KL. A flipped sign or a KL taken from pi_old's log-probs (no gradient) fails it.
- PPO-RLHF: ``loss = policy + vf_coef * value - ent_coef * entropy`` with both coefficients nonzero, against the
  statistics the loss returns and the trainer logs. A subtracted value loss or a flipped entropy sign fails it.
- PPO-RLHF: the advantages that reach the epoch loop have mean 0 and std 1 over the real tokens when whitening
  is on (and are far from it when it is off, so the test can tell).
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

import torch  # noqa: E402

from ppokit.core import schema as S  # noqa: E402
from ppokit.core.reductions import reduce  # noqa: E402
from ppokit.lm import GRPOTrainer, LMConfig, PPOTrainer  # noqa: E402
from ppokit.lm.logprobs import token_logprobs  # noqa: E402
from ppokit.lm.tiny import build_tiny  # noqa: E402

PROMPTS = ["X:", "AB:", "BXAX:", "A:"]
FAST = dict(learning_rate=3e-3, batch_prompts=2, group_size=4, max_new_tokens=6, tensorboard=False, console=False)


def offset_reward(prompts, completions):
    """Share of X's plus 3: scores far from zero mean, so unwhitened advantages are visibly not standardized."""
    return [3.0 + c.count("X") / max(len(c), 4) for c in completions]


@pytest.fixture(scope="module")
def base():
    return build_tiny("ABX:", pad_is_eos=True, seed=0)


def _record(trainer) -> list:
    """Wrap the trainer's own loss (what its ``TokenStep`` calls) to keep each minibatch, loss and stats."""
    seen = []
    loss_fn = trainer._loss

    def recorded(mb, *share):
        loss, stats = loss_fn(mb, *share)
        seen.append((mb, loss, {k: v.detach().clone() for k, v in stats.items()}))
        return loss, stats

    trainer._loss = recorded
    return seen


def _k3_to_ref(policy, ref, mb, temperature: float) -> torch.Tensor:
    """Token mean over the real tokens of the k3 estimate of KL(pi_theta || pi_ref), from the two models."""
    with torch.no_grad():
        logp, _ = token_logprobs(policy, mb.input_ids, mb.attention_mask, mb.n_response, temperature)
        logp_ref, _ = token_logprobs(ref, mb.input_ids, mb.attention_mask, mb.n_response, temperature)
    d = logp_ref - logp
    return reduce(d.exp() - d - 1.0, mb.response_mask, "token_mean")


def test_grpo_with_zero_advantages_is_plus_beta_k3_kl_to_ref_and_a_step_lowers_it(base):
    model, tok = base
    ref = copy.deepcopy(model)
    policy = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    beta = 0.5
    # Adam's first step moves every weight by ~lr whatever its gradient's size: at 3e-3 that overshoots this
    # small KL (measured: 0.033 -> 1.01), at 1e-4 it is a descent step (0.033 -> 0.022).
    cfg = LMConfig(**{**FAST, "learning_rate": 1e-4}, beta=beta, update_epochs=1, num_minibatches=1)
    t = GRPOTrainer(policy, tok, reward=lambda p, c: [1.0] * len(c), prompts=PROMPTS, config=cfg, ref_model=ref)
    seen = _record(t)
    grads = []
    loss_fn = t._loss

    def with_gradient(mb, *share):
        loss, stats = loss_fn(mb, *share)
        params = [p for p in t.policy.parameters() if p.requires_grad]
        g = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        grads.append(sum(float(x.abs().sum()) for x in g if x is not None))
        return loss, stats

    t._loss = with_gradient
    t.step()
    (mb, loss, stats), = seen
    assert torch.equal(mb.advantages, torch.zeros_like(mb.advantages))  # a constant reward: every group has A = 0
    assert float(_k3_to_ref(ref, ref, mb, cfg.temperature)) == 0.0  # the helper: pi_ref against itself is 0
    # KL before the step, from the minibatch's own log-probs (pi_theta == pi_old at the first minibatch).
    d_old = mb.logp_ref - mb.logp_old
    kl_old = reduce(d_old.exp() - d_old - 1.0, mb.response_mask, "token_mean")
    assert float(kl_old) > 1e-3  # the perturbation really moved the policy off pi_ref
    assert float(loss.detach()) == pytest.approx(beta * float(kl_old), rel=1e-4)  # + beta * KL: a flipped sign is negative
    assert grads[0] > 1e-6  # the KL term carries pi_theta's gradient (taken from pi_old it would carry none)
    kl_after = _k3_to_ref(t.policy, ref, mb, cfg.temperature)
    assert float(kl_after) < float(kl_old)  # one descent step on +beta * KL moves pi_theta towards pi_ref


def test_ppo_rlhf_loss_is_policy_plus_vf_coef_value_minus_ent_coef_entropy(base):
    model, tok = base
    vf_coef, ent_coef = 0.5, 0.05
    cfg = LMConfig(**FAST, vf_coef=vf_coef, ent_coef=ent_coef, update_epochs=2, num_minibatches=2,
                   loss_reduction="token_mean")
    t = PPOTrainer(copy.deepcopy(model), tok, reward=offset_reward, prompts=PROMPTS, config=cfg)
    seen = _record(t)
    metrics = t.step()
    assert len(seen) == 4  # 2 epochs x 2 minibatches, none skipped or stopped
    for _, loss, stats in seen:
        value, entropy = float(stats["value_loss"]), float(stats["entropy"])
        assert vf_coef * value > 1e-3 and ent_coef * entropy > 1e-3  # both terms move the total measurably
        expected = float(stats["policy_loss"]) + vf_coef * value - ent_coef * entropy
        assert float(loss.detach()) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # The logged update statistics are those same per-minibatch statistics, averaged.
    for name, key in ((S.VALUE_LOSS, "value_loss"), (S.ENTROPY, "entropy"), (S.POLICY_LOSS, "policy_loss")):
        mean = sum(float(s[key]) for _, _, s in seen) / len(seen)
        assert metrics[name] == pytest.approx(mean, rel=1e-4, abs=1e-6), name


@pytest.mark.parametrize("whiten", [True, False])
def test_the_advantages_reaching_the_epoch_loop_are_whitened_over_real_tokens(whiten, base):
    model, tok = base
    cfg = LMConfig(**FAST, update_epochs=1, num_minibatches=2, whiten_advantages=whiten, unsafe=not whiten)
    t = PPOTrainer(copy.deepcopy(model), tok, reward=offset_reward, prompts=PROMPTS, config=cfg)
    seen = _record(t)
    t.step()
    assert len(seen) == 2  # one epoch: the two minibatches together are the whole rollout, each row once
    adv = torch.cat([mb.advantages for mb, _, _ in seen]).double()
    mask = torch.cat([mb.response_mask for mb, _, _ in seen])
    real = adv[mask]
    assert real.numel() > 8
    std, mean = torch.std_mean(real, unbiased=False)
    if whiten:
        assert abs(float(mean)) < 1e-5 and float(std) == pytest.approx(1.0, abs=1e-4)
        assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))  # padding carries no advantage
    else:
        assert abs(float(mean)) > 0.5  # the scores' offset of 3 is still in them: the whitened check can tell


def test_grpo_loss_is_the_policy_loss_minus_ent_coef_entropy_at_the_configs_temperature_and_dapo_count(base):
    """GRPO's ``_loss`` with an entropy bonus (0 < ent_coef < 1), a temperature other than 1 and loss_type dapo:
    value and gradient equal ``policy loss - ent_coef * entropy``, both recomputed here from the model at that
    temperature and reduced over the rollout's tokens per minibatch. An entropy without gradient, the
    temperature left out or dapo's count not passed each fail it."""
    model, tok = base
    policy = copy.deepcopy(model)
    ent_coef, temperature = 0.5, 0.7
    cfg = LMConfig(**FAST, beta=0.0, update_epochs=1, num_minibatches=1, ent_coef=ent_coef,
                   temperature=temperature, loss_type="dapo")
    t = GRPOTrainer(policy, tok, reward=offset_reward, prompts=PROMPTS, config=cfg)
    seen = _record(t)
    t.step()
    mb = seen[0][0]
    params = [p for p in t.policy.parameters() if p.requires_grad]
    loss, stats = t._loss(mb)
    got = torch.autograd.grad(loss, params)
    logp, entropy = token_logprobs(t.policy, mb.input_ids, mb.attention_mask, mb.n_response, temperature,
                                   with_entropy=True)
    mask, n = mb.response_mask, t._tokens_per_minibatch
    ratio = (logp - mb.logp_old).exp()
    surrogate = torch.min(ratio * mb.advantages, ratio.clamp(0.8, 1.2) * mb.advantages)
    want = (torch.where(mask, -surrogate - ent_coef * entropy, 0.0)).sum() / n
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    # The logged entropy is the mean over the real tokens (some completions end early: padding is left out).
    assert not mask.all() and float(stats["entropy"]) == pytest.approx(float(entropy[mask].mean()), rel=1e-5)
    ref = torch.autograd.grad(want, params, retain_graph=True)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(got, ref))
    # The entropy's share of the gradient is not negligible here, so a detached entropy would show.
    no_bonus = torch.autograd.grad(torch.where(mask, -surrogate, 0.0).sum() / n, params)
    assert max(float((a - b).abs().max()) for a, b in zip(ref, no_bonus)) > 1e-4


def _ppo_minibatch(t, R: int, lengths: list[int]):
    """A hand-made PPO minibatch for ``t``: random prompts and responses of ``lengths`` real tokens (one empty row),
    pi_old a perturbed copy of the policy's log-probs (ratios away from 1, some clipped), random advantages and
    returns, and rollout values far enough from the critic's (> cliprange_value) that the value clip matters."""
    from ppokit.lm.rollout import TokenBatch

    g = torch.Generator().manual_seed(7)
    rows, P = len(lengths), 3
    ids = torch.randint(3, t.policy.config.vocab_size, (rows, P + R), generator=g)
    resp = torch.arange(R)[None] < torch.tensor(lengths)[:, None]
    attn = torch.cat([torch.ones(rows, P, dtype=torch.long), resp.long()], 1)
    ids[:, P:] = torch.where(resp, ids[:, P:], 1)  # pad (= EOS) after the response
    with torch.no_grad():
        logp, _ = token_logprobs(t.policy, ids, attn, R, t.config.temperature)
    noise = lambda scale: scale * torch.randn(rows, R, generator=g)  # noqa: E731
    return TokenBatch(ids, attn, resp, scores=torch.zeros(rows), logp_old=logp + noise(0.3),
                      logp_ref=logp + noise(0.3), advantages=noise(1.0), values=noise(1.0), returns=noise(1.0))


@pytest.mark.parametrize("reduction", ["dapo", "seq_mean_token_sum_norm"])
def test_ppo_rlhf_loss_and_gradient_against_a_hand_recomputation(reduction, base):
    """PPO-RLHF's ``_loss`` on a hand-made minibatch against the loss recomputed here from the two models: the
    clipped surrogate at the config's temperature reduced by dapo (over the rollout's tokens per minibatch) or Dr.
    GRPO's sum norm (over max_new_tokens, longer than this minibatch's responses), plus vf_coef x the clipped
    value loss (rollout values far from the critic's, so the clip is active), minus ent_coef x the entropy reduced
    the same way (loss_type dapo replaces loss_reduction for the entropy too). Value and gradient (policy and
    critic) must agree. The temperature left out, the entropy without gradient or reduced by loss_reduction under
    dapo, dapo's count or the budget not passed, or the value clip dropped each fail it."""
    model, tok = base
    R, max_new, n_dapo, temperature, clip_v = 5, 8, 9.0, 0.7, 0.2
    vf_coef, ent_coef = 0.5, 0.5
    knob = dict(loss_type="dapo") if reduction == "dapo" else dict(loss_reduction=reduction)
    cfg = LMConfig(**{**FAST, "max_new_tokens": max_new}, vf_coef=vf_coef, ent_coef=ent_coef,
                   temperature=temperature, cliprange_value=clip_v, **knob)
    t = PPOTrainer(copy.deepcopy(model), tok, reward=offset_reward, prompts=PROMPTS, config=cfg)
    with torch.no_grad():  # a critic whose values vary (the default head starts at exactly 0)
        t.value_model.head.weight.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    t._tokens_per_minibatch = n_dapo  # what step() sets: the rollout's tokens / num_minibatches
    mb = _ppo_minibatch(t, R, [5, 1, 0, 3, 5, 2])
    mask = mb.response_mask
    params = [p for p in t.policy.parameters() if p.requires_grad] + list(t.value_model.head.parameters())
    loss, stats = t._loss(mb)
    got = torch.autograd.grad(loss, params)

    def reduced(x):
        kept = torch.where(mask, x, 0.0)
        if reduction == "dapo":
            return kept.sum() / n_dapo
        return (kept.sum(-1) / max_new)[mask.any(-1)].mean()  # mean over the non-empty rows

    logp, entropy = token_logprobs(t.policy, mb.input_ids, mb.attention_mask, R, temperature, with_entropy=True)
    ratio = (logp - mb.logp_old).exp()
    surrogate = torch.min(ratio * mb.advantages, ratio.clamp(0.8, 1.2) * mb.advantages)
    values = t.value_model(mb.input_ids[:, :-1], mb.attention_mask[:, :-1])[:, -R:]
    clipped = mb.values + (values - mb.values).clamp(-clip_v, clip_v)
    unclipped_sq, clipped_sq = (values - mb.returns) ** 2, (clipped - mb.returns) ** 2
    value = 0.5 * torch.where(mask, torch.maximum(unclipped_sq, clipped_sq), 0.0).sum() / mask.sum()
    want = reduced(-surrogate) + vf_coef * value - ent_coef * reduced(entropy)
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert float(stats["value_loss"]) == pytest.approx(float(value.detach()), rel=1e-5)
    assert float(stats["entropy"]) == pytest.approx(float(entropy[mask].mean().detach()), rel=1e-5)
    unclipped_value = 0.5 * torch.where(mask, unclipped_sq, 0.0).sum() / mask.sum()
    assert float(value.detach()) > 1.5 * float(unclipped_value.detach())  # the clip matters here (1.31 vs 0.60)
    ref = torch.autograd.grad(want, params, retain_graph=True)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(got, ref))
    # The entropy's share of the gradient is not negligible, so a detached entropy would show.
    no_bonus = torch.autograd.grad(reduced(-surrogate) + vf_coef * value, params)
    assert max(float((a - b).abs().max()) for a, b in zip(ref, no_bonus)) > 1e-4


def test_ppo_rlhf_logs_the_rollouts_kl_to_ref_per_completion_and_the_raw_advantages_std_over_real_tokens(base):
    """With the policy a perturbed copy of pi_ref, the logged ``kl_ref`` is the mean over completions of the summed
    k1 log-ratio log pi_old - log pi_ref over each one's real tokens (what the adaptive controller reads), and
    ``advantage_std`` the population std of the unwhitened advantages over the real tokens, both recomputed here
    from the minibatches of one epoch (together the whole rollout, each row once)."""
    model, tok = base
    ref, policy = copy.deepcopy(model), copy.deepcopy(model)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    cfg = LMConfig(**FAST, update_epochs=1, num_minibatches=2, whiten_advantages=False, unsafe=True)
    t = PPOTrainer(policy, tok, reward=offset_reward, prompts=PROMPTS, config=cfg, ref_model=ref)
    seen = _record(t)
    metrics = t.step()
    mbs = [mb for mb, _, _ in seen]
    mask = torch.cat([mb.response_mask for mb in mbs])
    log_ratio = torch.cat([mb.logp_old - mb.logp_ref for mb in mbs]).double()
    assert mask.shape[0] != mask.shape[1] and not mask.all()  # rows != tokens, and some padding
    per_completion = [float(log_ratio[i][mask[i]].sum()) for i in range(mask.shape[0])]
    assert abs(sum(per_completion)) > 1e-3  # pi_old really differs from pi_ref
    assert metrics[S.KL_REF] == pytest.approx(sum(per_completion) / len(per_completion), rel=1e-5)
    real = torch.cat([mb.advantages for mb in mbs])[mask].double()
    assert metrics[S.ADVANTAGE_STD] == pytest.approx(float(real.std(unbiased=False)), rel=1e-5)
