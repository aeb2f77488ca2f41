"""Reference tests for ``ppokit.core.objectives``: every expected number is computed by hand (in the comments) or by a
brute-force loop / an independent library path (``torch.distributions``) written here, never by the function
under test."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from ppokit.core.objectives import (
    approx_kl_k1,
    approx_kl_k3,
    categorical_entropy,
    categorical_kl,
    clip_fraction,
    clipped_surrogate,
    entropy_loss,
    explained_variance,
    gaussian_entropy,
    gaussian_kl,
    kl_penalty_loss,
    kl_penalty_objective,
    policy_loss,
    ppo_objective,
    value_loss,
)

F64 = torch.float64


# ---------------------------------------------------------------------------------------------------------------
# Scalar objective: L^CLIP (Schulman et al. 2017, eq. 7) on the three worked cases, then hand-computed cases at
# other eps.
# ---------------------------------------------------------------------------------------------------------------


def test_clipped_objective_on_scalars():
    assert abs(ppo_objective(math.log(1.4), 0.0, 2.0, .2) - 2.4) < 1e-9
    assert abs(ppo_objective(math.log(.6), 0.0, -2.0, .2) - (-1.6)) < 1e-9

    # Out of the clip range but not in the improving direction: the unclipped surrogate is used.
    assert abs(ppo_objective(math.log(.6), 0., 2., .2) - 1.2) < 1e-9
    assert abs(ppo_objective(math.log(1.4), 0., -2., .2) + 2.8) < 1e-9
    assert ppo_objective(0., 0., 0., .2) == 0.


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected"),
    [
        # Case 1, A > 0 and r past 1+eps: min(1.4*2 = 2.8, 1.2*2 = 2.4) = 2.4 (clipped, zero gradient).
        (1.4, 2.0, 2.4),
        # Case 2, A < 0 and r below 1-eps: min(0.6*-2 = -1.2, 0.8*-2 = -1.6) = -1.6 (clipped, zero gradient).
        (0.6, -2.0, -1.6),
        # Case 3, A < 0 but r pushed up: min(1.4*-2 = -2.8, 1.2*-2 = -2.4) = -2.8 (unclipped, full gradient).
        (1.4, -2.0, -2.8),
    ],
)
def test_worked_cases_eps_0_2(ratio, advantage, expected):
    assert ppo_objective(math.log(ratio), 0.0, advantage, 0.2) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("ratio", "advantage", "eps", "expected"),
    [
        # eps = 0.1, clip range [0.9, 1.1]
        (1.4, 2.0, 0.1, 2.2),  # min(2.8, 1.1*2 = 2.2) = 2.2
        (0.6, -2.0, 0.1, -1.8),  # min(-1.2, 0.9*-2 = -1.8) = -1.8
        (1.4, -2.0, 0.1, -2.8),  # min(-2.8, 1.1*-2 = -2.2) = -2.8
        (0.6, 2.0, 0.1, 1.2),  # min(1.2, 0.9*2 = 1.8) = 1.2
        (1.05, 3.0, 0.1, 3.15),  # inside: 1.05*3 = 3.15 both ways
        (0.95, -4.0, 0.1, -3.8),  # inside: 0.95*-4 = -3.8 both ways
        # eps = 0.3, clip range [0.7, 1.3]
        (1.4, 2.0, 0.3, 2.6),  # min(2.8, 1.3*2 = 2.6) = 2.6
        (0.6, -2.0, 0.3, -1.4),  # min(-1.2, 0.7*-2 = -1.4) = -1.4
        (1.4, -2.0, 0.3, -2.8),  # min(-2.8, 1.3*-2 = -2.6) = -2.8
        (0.6, 2.0, 0.3, 1.2),  # min(1.2, 0.7*2 = 1.4) = 1.2
        (1.2, 0.5, 0.3, 0.6),  # inside: 1.2*0.5 = 0.6
        (0.8, -1.5, 0.3, -1.2),  # inside: 0.8*-1.5 = -1.2
        (2.0, 4.0, 0.3, 5.2),  # min(8.0, 1.3*4 = 5.2) = 5.2
        (0.5, -1.0, 0.3, -0.7),  # min(-0.5, 0.7*-1 = -0.7) = -0.7
    ],
)
def test_hand_cases_other_eps(ratio, advantage, eps, expected):
    assert ppo_objective(math.log(ratio), 0.0, advantage, eps) == pytest.approx(expected, abs=1e-12)


def test_ratio_uses_log_difference_not_absolute_logp():
    # Only logp_new - logp_old matters: shifting both by -3.7 gives the same value as case 1.
    assert ppo_objective(math.log(1.4) - 3.7, -3.7, 2.0, 0.2) == pytest.approx(2.4, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Tensor surrogate and policy loss.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [0.1, 0.2, 0.3])
def test_clipped_surrogate_matches_scalar_elementwise(eps):
    g = torch.Generator().manual_seed(1)
    logp_old = -torch.rand(4, 7, generator=g, dtype=F64) * 3
    logp_new = logp_old + (torch.rand(4, 7, generator=g, dtype=F64) - 0.5) * 1.5  # ratios ~ [0.47, 2.1]
    adv = torch.randn(4, 7, generator=g, dtype=F64)
    out = clipped_surrogate(logp_new, logp_old, adv, eps)
    assert out.shape == (4, 7)
    for i in range(4):
        for j in range(7):
            ref = ppo_objective(logp_new[i, j].item(), logp_old[i, j].item(), adv[i, j].item(), eps)
            assert out[i, j].item() == pytest.approx(ref, rel=1e-12, abs=1e-12)


def _grad_wrt_logp_new(ratio: float, advantage: float, eps: float) -> float:
    logp_new = torch.tensor([math.log(ratio)], dtype=F64, requires_grad=True)
    logp_old = torch.zeros(1, dtype=F64)
    adv = torch.tensor([advantage], dtype=F64)
    clipped_surrogate(logp_new, logp_old, adv, eps).sum().backward()
    return logp_new.grad.item()


@pytest.mark.parametrize(
    ("ratio", "advantage"),
    [(1.4, 2.0), (1.25, 0.7), (0.6, -2.0), (0.75, -0.3)],
    ids=["A>0,r>1+eps", "A>0,r>1+eps(b)", "A<0,r<1-eps", "A<0,r<1-eps(b)"],
)
def test_gradient_zero_where_clip_is_active(ratio, advantage):
    assert _grad_wrt_logp_new(ratio, advantage, 0.2) == 0.0


@pytest.mark.parametrize(
    ("ratio", "advantage"),
    [
        (0.6, 2.0),  # A > 0, r < 1-eps: unclipped branch chosen, d(r*A)/dlogp = r*A = 1.2
        (1.4, -2.0),  # A < 0, r > 1+eps: unclipped, gradient r*A = -2.8
        (1.1, 2.0),  # inside, A > 0: 2.2
        (0.9, -2.0),  # inside, A < 0: -1.8
        (1.0, 1.5),  # r == 1: gradient = A
    ],
)
def test_gradient_is_ratio_times_advantage_elsewhere(ratio, advantage):
    assert _grad_wrt_logp_new(ratio, advantage, 0.2) == pytest.approx(ratio * advantage, rel=1e-12)


def test_gradient_regions_vectorized_batch():
    # One batch with all four outside regions and the inside one; d(sum)/dlogp_new is per-element.
    ratios = torch.tensor([1.4, 0.6, 0.6, 1.4, 1.05], dtype=F64)
    adv = torch.tensor([2.0, -2.0, 2.0, -2.0, -1.0], dtype=F64)
    expected = torch.tensor([0.0, 0.0, 1.2, -2.8, -1.05], dtype=F64)
    logp_new = ratios.log().requires_grad_(True)
    clipped_surrogate(logp_new, torch.zeros(5, dtype=F64), adv, 0.2).sum().backward()
    torch.testing.assert_close(logp_new.grad, expected, rtol=1e-12, atol=1e-12)


def test_advantages_and_logp_old_get_no_gradient():
    logp_new = torch.tensor([-0.5, -1.0, -2.0], dtype=F64, requires_grad=True)
    logp_old = torch.tensor([-0.7, -0.9, -2.5], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=F64, requires_grad=True)
    policy_loss(logp_new, logp_old, adv, 0.2).backward()
    assert logp_new.grad is not None
    assert logp_old.grad is None
    assert adv.grad is None


def test_policy_loss_is_negative_mean_of_surrogate():
    # ratios 1.4, 0.6, 1.1 with A = 2, -2, 1 at eps 0.2: surrogates 2.4, -1.6, 1.1 -> mean 1.9/3.
    logp_new = torch.tensor([1.4, 0.6, 1.1], dtype=F64).log()
    adv = torch.tensor([2.0, -2.0, 1.0], dtype=F64)
    loss = policy_loss(logp_new, torch.zeros(3, dtype=F64), adv, 0.2)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(-(2.4 - 1.6 + 1.1) / 3, abs=1e-12)


def test_ratio_one_gives_minus_mean_advantage_and_no_clipping():
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(64, generator=g, dtype=F64) * 4
    adv = torch.randn(64, generator=g, dtype=F64)
    loss = policy_loss(logp.clone(), logp.clone(), adv, 0.2)
    assert loss.item() == pytest.approx(-sum(adv.tolist()) / 64, abs=1e-12)
    ratio = torch.exp(logp - logp)
    assert clip_fraction(ratio, 0.2).item() == 0.0


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: clipped_surrogate(a, b, b.clone(), 0.2),
        lambda a, b: clipped_surrogate(a, a.clone(), b, 0.2),
        lambda a, b: policy_loss(a, b, a.clone(), 0.2),
        lambda a, b: value_loss(a, b),
        lambda a, b: value_loss(a, a.clone(), b, 0.2),
        lambda a, b: approx_kl_k1(a, b),
        lambda a, b: approx_kl_k3(a, b),
        lambda a, b: kl_penalty_objective(a, b, a.clone(), 0.1),
        lambda a, b: explained_variance(a, b),
    ],
)
def test_shape_mismatch_b_vs_b1_raises(fn):
    a = torch.zeros(8)
    b = torch.zeros(8, 1)
    with pytest.raises(ValueError, match="shape"):
        fn(a, b)


# Each checked argument of each function in turn gets the wrong shape: one that would broadcast silently
# ([4, 1, 3] against [4, 3]) and one that would not ([5, 3], where torch would raise its own RuntimeError first
# from the arithmetic). Both must be the function's one-line ValueError. gaussian_kl checks the means only (a
# state-independent log-std of shape [D] broadcasts on purpose).
_CHECKED_ARGS = {
    "kl_penalty_objective": (lambda *t: kl_penalty_objective(*t, 0.1), 3, (0, 1, 2)),
    "categorical_kl": (categorical_kl, 2, (0, 1)),
    "gaussian_kl": (gaussian_kl, 4, (0, 2)),
}


@pytest.mark.parametrize("wrong", [(4, 1, 3), (5, 3)])
@pytest.mark.parametrize(
    "name, position", [(name, pos) for name, (_, _, positions) in _CHECKED_ARGS.items() for pos in positions]
)
def test_each_checked_argument_of_a_wrong_shape_raises_the_shape_error(name, position, wrong):
    fn, n_args, _ = _CHECKED_ARGS[name]
    args = [torch.zeros(4, 3) for _ in range(n_args)]
    args[position] = torch.zeros(wrong)
    with pytest.raises(ValueError, match="shape mismatch"):
        fn(*args)


# ---------------------------------------------------------------------------------------------------------------
# Value loss.
# ---------------------------------------------------------------------------------------------------------------


def test_value_loss_unclipped_hand():
    # V = [1, 2, 3], R = [0, 2, 5]: errors 1, 0, -2 -> squares 1, 0, 4 -> mean 5/3 -> 0.5 * mean = 5/6.
    values = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    returns = torch.tensor([0.0, 2.0, 5.0], dtype=F64)
    assert value_loss(values, returns).item() == pytest.approx(5.0 / 6.0, abs=1e-12)


def test_value_loss_clipped_hand_case():
    # old = 0, V = 1, R = 1, clip 0.2: unclipped error 0; V clipped to 0.2 -> (0.2 - 1)^2 = 0.64;
    # max(0, 0.64) = 0.64 -> 0.5 * 0.64 = 0.32, and the clipped branch gives V no gradient.
    values = torch.tensor([1.0], dtype=F64, requires_grad=True)
    loss = value_loss(values, torch.tensor([1.0], dtype=F64), torch.tensor([0.0], dtype=F64), 0.2)
    assert loss.item() == pytest.approx(0.32, abs=1e-12)
    loss.backward()
    assert values.grad.item() == 0.0


def test_value_loss_clipped_against_loop():
    g = torch.Generator().manual_seed(5)
    values = torch.randn(50, generator=g, dtype=F64)
    old_values = values + torch.randn(50, generator=g, dtype=F64) * 0.4
    returns = torch.randn(50, generator=g, dtype=F64)
    clip = 0.2
    total = 0.0
    for v, o, r in zip(values.tolist(), old_values.tolist(), returns.tolist()):
        delta = v - o
        delta = clip if delta > clip else (-clip if delta < -clip else delta)
        total += max((v - r) ** 2, (o + delta - r) ** 2)
    expected = 0.5 * total / 50
    assert value_loss(values, returns, old_values, clip).item() == pytest.approx(expected, rel=1e-12)
    # Without clip_coef (or without old values) it is the plain 0.5 * MSE.
    plain = 0.5 * sum((v - r) ** 2 for v, r in zip(values.tolist(), returns.tolist())) / 50
    assert value_loss(values, returns, old_values, None).item() == pytest.approx(plain, rel=1e-12)
    assert value_loss(values, returns).item() == pytest.approx(plain, rel=1e-12)


def test_value_loss_returns_are_detached():
    values = torch.tensor([0.5, 1.5], requires_grad=True)
    returns = torch.tensor([1.0, 1.0], requires_grad=True)
    value_loss(values, returns).backward()
    assert returns.grad is None
    # d/dV 0.5 * mean((V - R)^2) = (V - R) / n = [-0.25, 0.25]
    torch.testing.assert_close(values.grad, torch.tensor([-0.25, 0.25]))


# ---------------------------------------------------------------------------------------------------------------
# Entropies and KL.
# ---------------------------------------------------------------------------------------------------------------


def test_categorical_entropy_against_torch_distributions():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 5, 4, generator=g, dtype=F64) * 2
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(categorical_entropy(logits), expected, rtol=1e-12, atol=1e-12)
    # Uniform over K actions has entropy log K.
    assert categorical_entropy(torch.zeros(5, dtype=F64)).item() == pytest.approx(math.log(5), abs=1e-12)


def test_gaussian_entropy_against_torch_distributions():
    g = torch.Generator().manual_seed(8)
    log_std = torch.randn(10, 3, generator=g, dtype=F64)
    expected = torch.distributions.Normal(torch.zeros_like(log_std), log_std.exp()).entropy().sum(-1)
    torch.testing.assert_close(gaussian_entropy(log_std), expected, rtol=1e-12, atol=1e-12)
    # [T, N, D]: the sum runs over the last (action) axis only, whatever the batch rank.
    log_std = torch.randn(5, 4, 3, generator=g, dtype=F64)
    expected = torch.distributions.Normal(torch.zeros_like(log_std), log_std.exp()).entropy().sum(-1)
    torch.testing.assert_close(gaussian_entropy(log_std), expected, rtol=1e-12, atol=1e-12)


def test_entropy_loss_is_negative_mean():
    # entropies 0.5, 1.0, 1.5 -> mean 1.0 -> loss -1.0
    assert entropy_loss(torch.tensor([0.5, 1.0, 1.5])).item() == pytest.approx(-1.0)


def test_categorical_kl_against_brute_force_sum():
    g = torch.Generator().manual_seed(9)
    logits_p = torch.randn(5, 6, generator=g, dtype=F64)
    logits_q = torch.randn(5, 6, generator=g, dtype=F64)
    out = categorical_kl(logits_p, logits_q)
    assert out.shape == (5,)
    for row in range(5):
        zp = sum(math.exp(x) for x in logits_p[row].tolist())
        zq = sum(math.exp(x) for x in logits_q[row].tolist())
        kl = 0.0
        for lp, lq in zip(logits_p[row].tolist(), logits_q[row].tolist()):
            p, q = math.exp(lp) / zp, math.exp(lq) / zq
            kl += p * math.log(p / q)
        assert out[row].item() == pytest.approx(kl, rel=1e-10, abs=1e-12)
    # KL(p || p) = 0
    torch.testing.assert_close(categorical_kl(logits_p, logits_p), torch.zeros(5, dtype=F64), atol=1e-12, rtol=0)


def test_gaussian_kl_against_torch_distributions():
    g = torch.Generator().manual_seed(10)
    mean_p, mean_q = torch.randn(2, 7, 3, generator=g, dtype=F64)
    log_std_p, log_std_q = torch.randn(2, 7, 3, generator=g, dtype=F64) * 0.5
    p = torch.distributions.Normal(mean_p, log_std_p.exp())
    q = torch.distributions.Normal(mean_q, log_std_q.exp())
    expected = torch.distributions.kl_divergence(p, q).sum(-1)
    torch.testing.assert_close(gaussian_kl(mean_p, log_std_p, mean_q, log_std_q), expected, rtol=1e-12, atol=1e-12)
    # [T, N, D]: summed over the action axis only.
    mean_p, mean_q, log_std_p, log_std_q = torch.randn(4, 5, 4, 3, generator=g, dtype=F64)
    p = torch.distributions.Normal(mean_p, log_std_p.exp())
    q = torch.distributions.Normal(mean_q, log_std_q.exp())
    expected = torch.distributions.kl_divergence(p, q).sum(-1)
    torch.testing.assert_close(gaussian_kl(mean_p, log_std_p, mean_q, log_std_q), expected, rtol=1e-12, atol=1e-12)


def test_k1_and_k3_are_unbiased_estimates_of_categorical_kl():
    # KL(pi_old || pi_new) estimated from 200k actions drawn from pi_old; the tolerance is 5 standard errors.
    torch.manual_seed(0)
    logits_old = torch.tensor([0.3, -0.2, 1.0, 0.0, -1.1], dtype=F64)
    logits_new = torch.tensor([0.1, 0.4, 0.6, -0.3, -0.5], dtype=F64)
    actions = torch.distributions.Categorical(logits=logits_old).sample((200_000,))
    logp_old = torch.log_softmax(logits_old, -1)[actions]
    logp_new = torch.log_softmax(logits_new, -1)[actions]
    exact = categorical_kl(logits_old, logits_new).item()
    assert exact > 0.05  # the two policies really differ

    k1_terms = logp_old - logp_new
    logr = logp_new - logp_old
    k3_terms = logr.exp() - 1 - logr
    for estimate, terms in ((approx_kl_k1(logp_new, logp_old), k1_terms), (approx_kl_k3(logp_new, logp_old), k3_terms)):
        se = terms.std().item() / math.sqrt(terms.numel())
        assert estimate.item() == pytest.approx(terms.mean().item(), rel=1e-9)
        assert abs(estimate.item() - exact) < 5 * se


def test_k3_is_never_negative_and_k1_can_be():
    g = torch.Generator().manual_seed(11)
    for size in (1, 2, 5, 100):
        for _ in range(200):
            logp_old = -torch.rand(size, generator=g) * 5
            logp_new = logp_old + torch.randn(size, generator=g) * torch.rand(1, generator=g) * 3
            assert approx_kl_k3(logp_new, logp_old).item() >= 0.0
    # tiny log-ratios (where cancellation could bite) also stay >= 0
    small = torch.tensor([1e-9, -1e-9, 3e-6, -3e-6, 0.0])
    assert approx_kl_k3(small, torch.zeros(5)).item() >= 0.0
    # k1 on a single sample where pi_new gave the action more mass: log(0.5) - log(0.8) < 0
    assert approx_kl_k1(torch.tensor([math.log(0.8)]), torch.tensor([math.log(0.5)])).item() < 0


def test_kl_estimators_hand_values():
    # logp_old = 0, ratios r = 1.5, 0.5:
    # k1 = mean(-log r) = (-0.405465 + 0.693147) / 2 = 0.143841
    # k3 = mean(r - 1 - log r) = ((0.5 - 0.405465) + (-0.5 + 0.693147)) / 2 = 0.143841 (the r - 1 terms cancel)
    logp_new = torch.tensor([math.log(1.5), math.log(0.5)], dtype=F64)
    expected = (-math.log(1.5) - math.log(0.5)) / 2
    assert approx_kl_k1(logp_new, torch.zeros(2, dtype=F64)).item() == pytest.approx(expected, abs=1e-12)
    assert approx_kl_k3(logp_new, torch.zeros(2, dtype=F64)).item() == pytest.approx(expected, abs=1e-12)
    # one sample, r = 2: k1 = -log 2 = -0.693147, k3 = 1 - log 2 = 0.306853
    one = torch.tensor([math.log(2.0)], dtype=F64)
    assert approx_kl_k1(one, torch.zeros(1, dtype=F64)).item() == pytest.approx(-math.log(2), abs=1e-12)
    assert approx_kl_k3(one, torch.zeros(1, dtype=F64)).item() == pytest.approx(1 - math.log(2), abs=1e-12)


def test_kl_penalty_objective_hand():
    # logp_old = 0, r = [1.5, 0.5], A = [1, -2], beta = 0.5
    # surrogate mean(r*A) = (1.5 - 1.0) / 2 = 0.25
    # k3 = ((1.5 - 1 - log 1.5) + (0.5 - 1 - log 0.5)) / 2 = (0.094535 + 0.193147) / 2 = 0.143841
    # objective = 0.25 - 0.5 * 0.143841 = 0.178080
    logp_new = torch.tensor([math.log(1.5), math.log(0.5)], dtype=F64, requires_grad=True)
    logp_old = torch.zeros(2, dtype=F64)
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    k3 = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 2
    expected = 0.25 - 0.5 * k3
    obj = kl_penalty_objective(logp_new, logp_old, adv, 0.5)
    assert obj.item() == pytest.approx(expected, abs=1e-12)
    assert obj.item() == pytest.approx(0.178080, abs=1e-6)
    assert kl_penalty_loss(logp_new, logp_old, adv, 0.5).item() == pytest.approx(-expected, abs=1e-12)
    # d/dlogp_i of [r_i A_i - beta (r_i - 1 - log r_i)] / n = (r_i A_i - beta (r_i - 1)) / n
    obj.backward()
    expected_grad = [(1.5 * 1.0 - 0.5 * 0.5) / 2, (0.5 * -2.0 - 0.5 * -0.5) / 2]  # [0.625, -0.375]
    torch.testing.assert_close(logp_new.grad, torch.tensor(expected_grad, dtype=F64), rtol=1e-12, atol=1e-12)


def test_kl_penalty_beta_zero_is_plain_importance_sampled_surrogate():
    # r = 2, 0.25, A = 3, 4 -> mean(6, 1) = 3.5
    logp_new = torch.tensor([math.log(2.0), math.log(0.25)], dtype=F64)
    adv = torch.tensor([3.0, 4.0], dtype=F64)
    assert kl_penalty_objective(logp_new, torch.zeros(2, dtype=F64), adv, 0.0).item() == pytest.approx(3.5)


# ---------------------------------------------------------------------------------------------------------------
# Diagnostics.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("eps", "expected"),
    [
        (0.2, 3 / 6),  # |r - 1| = 0, .05, .25, .25, .15, 1 -> > .2: 1.25, 0.75, 2.0
        (0.1, 4 / 6),  # > .1: 1.25, 0.75, 0.85, 2.0
        (0.3, 1 / 6),  # > .3: 2.0
        # |r - 1| exactly eps (1.25 and 0.75 are exact in float32) is still inside the trust region, as in the
        # clamp (past_clip): > .25 is 2.0 alone.
        (0.25, 1 / 6),
        (1.5, 0.0),
    ],
)
def test_clip_fraction_hand(eps, expected):
    ratio = torch.tensor([1.0, 1.05, 1.25, 0.75, 0.85, 2.0])
    out = clip_fraction(ratio, eps)
    assert out.dtype.is_floating_point
    assert out.item() == pytest.approx(expected)


def test_explained_variance_perfect_mean_and_hand():
    target = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64)
    assert explained_variance(target.clone(), target).item() == pytest.approx(1.0)
    # predicting the mean (2.5) leaves Var(resid) == Var(target)
    assert explained_variance(torch.full_like(target, 2.5), target).item() == pytest.approx(0.0, abs=1e-12)
    # pred [1, 2, 3, 5]: resid [0, 0, 0, -1], Var = 1/4 - 1/16 = 0.1875; Var(target) = 1.25 -> 1 - 0.15 = 0.85
    pred = torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=F64)
    assert explained_variance(pred, target).item() == pytest.approx(0.85, abs=1e-12)
    # predicting -target is worse than the mean: resid = 2*target, Var(2t) = 4 Var(t) -> 1 - 4 = -3
    assert explained_variance(-target, target).item() == pytest.approx(-3.0, abs=1e-12)
    # Var(target) exactly 1 is an ordinary target: [-1, 1] (population variance 1), pred [-0.5, 0.5] leaves
    # resid [-0.5, 0.5], Var 0.25 -> 0.75.
    target = torch.tensor([-1.0, 1.0], dtype=F64)
    assert explained_variance(torch.tensor([-0.5, 0.5], dtype=F64), target).item() == pytest.approx(0.75, abs=1e-12)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 7.77, -3.3])
@pytest.mark.parametrize("n", [1, 3, 7, 100])
def test_explained_variance_constant_target_is_nan(value, n):
    # float32 copies of 0.1 have a rounded mean one ulp off, so Var computes to ~1e-17, not 0: still NaN.
    target = torch.full((n,), value)
    pred = torch.linspace(-1.0, 1.0, n)
    assert math.isnan(explained_variance(pred, target).item())


# ---------------------------------------------------------------------------------------------------------------
# Masks and reduction modes (``reductions.reduce``). Unmasked calls must compute exactly what the functions did
# before they took a mask: the bodies of that version are kept here, verbatim but for the names.
# ---------------------------------------------------------------------------------------------------------------


def _old_clipped_surrogate(logp_new, logp_old, advantages, clip_coef):
    advantages = advantages.detach()
    ratio = torch.exp(logp_new - logp_old.detach())
    ratio_clipped = torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef)
    past = (ratio.detach() - ratio_clipped.detach()).mul_(advantages) > 0
    return torch.where(past, ratio_clipped * advantages, ratio * advantages)


def _old_policy_loss(logp_new, logp_old, advantages, clip_coef):
    return -_old_clipped_surrogate(logp_new, logp_old, advantages, clip_coef).mean()


def _old_value_loss(values, returns, old_values=None, clip_coef=None):
    returns = returns.detach()
    unclipped = (values - returns) ** 2
    if old_values is None or clip_coef is None:
        return 0.5 * unclipped.mean()
    old_values = old_values.detach()
    values_clipped = old_values + torch.clamp(values - old_values, -clip_coef, clip_coef)
    clipped = (values_clipped - returns) ** 2
    return 0.5 * torch.where(clipped > unclipped, clipped, unclipped).mean()


def _old_entropy_loss(entropy):
    return -entropy.mean()


def _old_k1(logp_new, logp_old):
    return (logp_old - logp_new).mean()


def _old_k3(logp_new, logp_old):
    logratio = logp_new - logp_old
    return (torch.expm1(logratio) - logratio).mean()


def _old_kl_penalty_loss(logp_new, logp_old, advantages, beta):
    ratio = torch.exp(logp_new - logp_old.detach())
    surrogate = (ratio * advantages.detach()).mean()
    return -(surrogate - beta * _old_k3(logp_new, logp_old.detach()))


def _old_clip_fraction(ratio, clip_coef):
    return ((ratio - 1.0).abs() > clip_coef).float().mean()


def _old_explained_variance(predicted, target):
    var_target = target.var(unbiased=False)
    var_resid = (target - predicted).var(unbiased=False)
    constant = (target == target.reshape(-1)[:1]).all() | (var_target == 0)
    nan = torch.full_like(var_target, float("nan"))
    return torch.where(constant, nan, 1.0 - var_resid / var_target)


def _pairs():
    """(new, old) pairs of scalar functions of (a, b, c) with a the differentiated input."""
    return [
        (lambda a, b, c: policy_loss(a, b, c, 0.2), lambda a, b, c: _old_policy_loss(a, b, c, 0.2)),
        (lambda a, b, c: value_loss(a, b), lambda a, b, c: _old_value_loss(a, b)),
        (lambda a, b, c: value_loss(a, b, c, 0.2), lambda a, b, c: _old_value_loss(a, b, c, 0.2)),
        (lambda a, b, c: entropy_loss(a), lambda a, b, c: _old_entropy_loss(a)),
        (lambda a, b, c: approx_kl_k1(a, b), lambda a, b, c: _old_k1(a, b)),
        (lambda a, b, c: approx_kl_k3(a, b), lambda a, b, c: _old_k3(a, b)),
        (lambda a, b, c: kl_penalty_loss(a, b, c, 0.3), lambda a, b, c: _old_kl_penalty_loss(a, b, c, 0.3)),
        (lambda a, b, c: clip_fraction(a.exp(), 0.2), lambda a, b, c: _old_clip_fraction(a.exp(), 0.2)),
        (lambda a, b, c: explained_variance(a, b), lambda a, b, c: _old_explained_variance(a, b)),
    ]


@pytest.mark.parametrize("pair", range(len(_pairs())))
@pytest.mark.parametrize("shape", [(64,), (16, 8), (1,)])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_unmasked_results_and_gradients_are_bit_identical_to_the_unmasked_version(pair, shape, dtype):
    new, old = _pairs()[pair]
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        a, b, c = (torch.randn(*shape, generator=g, dtype=dtype) * 0.3 for _ in range(3))
        a_new, a_old = a.clone().requires_grad_(True), a.clone().requires_grad_(True)
        out_new, out_old = new(a_new, b, c), old(a_old, b, c)
        # rtol = atol = 0: equal bits (NaN where the old one was NaN, e.g. the explained variance of one sample).
        torch.testing.assert_close(out_new, out_old, rtol=0, atol=0, equal_nan=True)
        if out_new.requires_grad:
            out_new.backward()
            out_old.backward()
            torch.testing.assert_close(a_new.grad, a_old.grad, rtol=0, atol=0, equal_nan=True)


def _token_batch(seed: int, B: int = 5, T: int = 7):
    """A right-padded [B, T] batch: finite but large garbage in the padding (the ratio there is exp(+-20))."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp_old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    logp_new = logp_old + 0.4 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    garbage = 20.0 * torch.randn(B, T, generator=g, dtype=F64)
    logp_new = torch.where(mask, logp_new, garbage)
    adv = torch.where(mask, adv, -garbage)
    return logp_new, logp_old, adv, mask, lengths


_MASKED_LOSSES = {
    "policy_loss": lambda a, b, c, m, mode: policy_loss(a, b, c, 0.2, m, mode),
    "value_loss": lambda a, b, c, m, mode: value_loss(a, b, None, None, m, mode),
    "value_loss_clipped": lambda a, b, c, m, mode: value_loss(a, b, c, 0.2, m, mode),
    "entropy_loss": lambda a, b, c, m, mode: entropy_loss(a, m, mode),
    "approx_kl_k1": lambda a, b, c, m, mode: approx_kl_k1(a, b, m, mode),
    "approx_kl_k3": lambda a, b, c, m, mode: approx_kl_k3(a, b, m, mode),
    "kl_penalty_loss": lambda a, b, c, m, mode: kl_penalty_loss(a, b, c, 0.3, m, mode),
    "kl_penalty_objective": lambda a, b, c, m, mode: kl_penalty_objective(a, b, c, 0.3, m, mode),
    "clip_fraction": lambda a, b, c, m, mode: clip_fraction((a - b).exp(), 0.2, m, mode),
}


@pytest.mark.parametrize("name", list(_MASKED_LOSSES))
def test_masked_token_mean_equals_the_loss_on_the_valid_tokens_alone(name):
    fn = _MASKED_LOSSES[name]
    rel = 1e-6 if name == "clip_fraction" else 1e-12  # the clip fraction is a float32 share
    for seed in range(6):
        a, b, c, mask, _ = _token_batch(seed)
        flat = fn(a[mask], b[mask], c[mask], None, "mean")  # the unmasked loss on a flat [n_valid] batch
        for mode in ("mean", "token_mean"):
            assert fn(a, b, c, mask, mode).item() == pytest.approx(flat.item(), rel=rel, abs=1e-12)


@pytest.mark.parametrize("name", list(_MASKED_LOSSES))
def test_masked_sequence_modes_average_the_per_sequence_losses(name):
    # seq_mean_token_mean = mean over sequences of the loss on that sequence alone; the Dr. GRPO mode scales each
    # sequence's loss by its length / T instead.
    fn = _MASKED_LOSSES[name]
    rel = 1e-6 if name == "clip_fraction" else 1e-12  # the clip fraction is a float32 share
    a, b, c, mask, lengths = _token_batch(seed=7, T=7)
    per_seq = [fn(a[i, :n], b[i, :n], c[i, :n], None, "mean").item() for i, n in enumerate(lengths.tolist())]
    expected_mean = sum(per_seq) / len(per_seq)
    expected_norm = sum(v * n / 7 for v, n in zip(per_seq, lengths.tolist())) / len(per_seq)
    assert fn(a, b, c, mask, "seq_mean_token_mean").item() == pytest.approx(expected_mean, rel=rel, abs=1e-12)
    assert fn(a, b, c, mask, "seq_mean_token_sum_norm").item() == pytest.approx(expected_norm, rel=rel, abs=1e-12)


@pytest.mark.parametrize("name", [n for n in _MASKED_LOSSES if n != "clip_fraction"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_padded_tokens_get_exactly_zero_gradient(name, mode):
    a, b, c, mask, _ = _token_batch(seed=2)
    a = a.clone().requires_grad_(True)
    _MASKED_LOSSES[name](a, b, c, mask, mode).backward()
    assert torch.equal(a.grad[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
    assert a.grad[mask].abs().sum() > 0  # and the valid ones do get one


def test_clip_fraction_ignores_padded_ratios():
    # Valid ratios 1.0, 1.3 (clipped at eps 0.2), 0.9; padded ratios 5.0 and 0.1 would be clipped but do not count.
    ratio = torch.tensor([[1.0, 1.3, 5.0], [0.9, 0.1, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert clip_fraction(ratio, 0.2, mask).item() == pytest.approx(1 / 3)
    assert clip_fraction(ratio, 0.2, mask, "seq_mean_token_mean").item() == pytest.approx((1 / 2 + 0) / 2)
    with pytest.raises(ValueError, match="shape"):
        clip_fraction(ratio, 0.2, mask[:, :2])


def test_masked_explained_variance_is_that_of_the_valid_tokens():
    g = torch.Generator().manual_seed(5)
    target = torch.randn(4, 6, generator=g)
    pred = target + 0.5 * torch.randn(4, 6, generator=g)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 3, 1, 4])[:, None]
    garbage_pred = torch.where(mask, pred, float("nan"))
    assert torch.equal(explained_variance(garbage_pred, target, mask), explained_variance(pred[mask], target[mask]))
    assert torch.equal(explained_variance(pred, target, mask.float()), explained_variance(pred[mask], target[mask]))
    # Constant valid targets (the padding varies) and no valid token at all: undefined, NaN.
    const = torch.where(mask, torch.tensor(0.1), torch.randn(4, 6, generator=g))
    assert math.isnan(explained_variance(pred, const, mask).item())
    assert math.isnan(explained_variance(pred, target, torch.zeros_like(mask)).item())
    # No valid token is NaN of the target's dtype, without computing (and warning about) the variance of nothing:
    # the diagnostic runs every update, a warning there would repeat all run long.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        none_valid = explained_variance(pred.double(), target.double(), torch.zeros_like(mask))
    assert none_valid.dtype == F64 and none_valid.shape == () and math.isnan(none_valid.item())
    with pytest.raises(ValueError, match="shape"):
        explained_variance(pred, target, mask.T)
    # The no-token NaN is on the target's device, not torch's default one (a run with the default device set to
    # CUDA that computes diagnostics on CPU tensors; "meta" stands in for CUDA on a CPU-only machine).
    with torch.device("meta"):
        none_valid = explained_variance(pred, target, torch.zeros_like(mask))
    assert none_valid.device == target.device and math.isnan(none_valid.item())
