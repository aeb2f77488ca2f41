"""Reference tests for ``ppokit.core.advantages``.

The references are written here as plain per-env Python loops in float64, in a form different from the
implementation's recursion: the advantage is the explicit finite sum ``sum_l (gamma*lam)^l delta_{t+l}`` up to
the end of the episode (or of the rollout), and the lambda = 1 case is a discounted Monte-Carlo return.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from ppokit.core.advantages import SPREAD_ULPS, gae, normalize

F64 = torch.float64


def _random_rollout(T: int, N: int, seed: int, p_term: float = 0.15, p_trunc: float = 0.1):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(T, N, generator=g, dtype=F64)
    values = torch.randn(T, N, generator=g, dtype=F64)
    next_values = torch.randn(T, N, generator=g, dtype=F64)
    terminated = torch.rand(T, N, generator=g) < p_term
    truncated = torch.rand(T, N, generator=g) < p_trunc  # may coincide with terminated: termination wins
    return rewards, values, next_values, terminated, truncated


def _consistent_rollout(T: int, N: int, seed: int):
    """A random rollout as a real collector stores it: within an episode ``next_values[t] == values[t + 1]``;
    after a done step ``next_values[t]`` is V of that episode's final observation, unrelated to ``values[t + 1]``
    (the reset observation)."""
    rewards, values, next_values, terminated, truncated = _random_rollout(T, N, seed)
    done = terminated | truncated
    next_values[:-1] = torch.where(done[:-1], next_values[:-1], values[1:])
    return rewards, values, next_values, terminated, truncated


def _episode_end(term: list[bool], trunc: list[bool], t: int) -> int:
    """First step >= t at which the episode ends (terminated or truncated), else the last step of the rollout."""
    for k in range(t, len(term)):
        if term[k] or trunc[k]:
            return k
    return len(term) - 1


def _reference_gae(rewards, values, next_values, terminated, truncated, gamma, lam):
    """Explicit-sum GAE: A_t = sum_{k=t}^{end} (gamma*lam)^(k-t) * delta_k, delta_k bootstraps unless terminated."""
    T, N = rewards.shape
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        r = rewards[:, n].tolist()
        v = values[:, n].tolist()
        nv = next_values[:, n].tolist()
        term = terminated[:, n].tolist()
        trunc = truncated[:, n].tolist()
        deltas = [r[k] + (0.0 if term[k] else gamma * nv[k]) - v[k] for k in range(T)]
        for t in range(T):
            end = _episode_end(term, trunc, t)
            adv[t][n] = sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, end + 1))
    return torch.tensor(adv, dtype=F64)


def _reference_monte_carlo(rewards, values, next_values, terminated, truncated, gamma):
    """lambda = 1: discounted reward sum to the episode end, plus gamma^len * V(next) unless it terminated, minus V."""
    T, N = rewards.shape
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        term = terminated[:, n].tolist()
        trunc = truncated[:, n].tolist()
        for t in range(T):
            end = _episode_end(term, trunc, t)
            ret = sum(gamma ** (k - t) * rewards[k, n].item() for k in range(t, end + 1))
            if not term[end]:  # truncated, or the rollout ran out mid-episode: bootstrap
                ret += gamma ** (end - t + 1) * next_values[end, n].item()
            adv[t][n] = ret - values[t, n].item()
    return torch.tensor(adv, dtype=F64)


SHAPES = [(T, N) for T in (1, 5, 64) for N in (1, 3, 8)]


@pytest.mark.parametrize(("T", "N"), SHAPES)
@pytest.mark.parametrize(("gamma", "lam"), [(0.99, 0.95), (0.9, 0.5), (1.0, 1.0), (0.5, 0.0)])
def test_gae_matches_explicit_sum_reference(T, N, gamma, lam):
    rollout = _random_rollout(T, N, seed=100 * T + N)
    adv, ret = gae(*rollout, gamma=gamma, gae_lambda=lam)
    expected = _reference_gae(*rollout, gamma, lam)
    assert adv.shape == (T, N) and ret.shape == (T, N)
    torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret, expected + rollout[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("T", "N"), [(5, 3), (64, 8)])
def test_gae_float32_close_to_float64_reference(T, N):
    rollout = _random_rollout(T, N, seed=7)
    r, v, nv, term, trunc = rollout
    adv, _ = gae(r.float(), v.float(), nv.float(), term, trunc, gamma=0.99, gae_lambda=0.95)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), _reference_gae(*rollout, 0.99, 0.95), rtol=1e-5, atol=1e-5)


def test_bfloat16_and_mixed_precision_rollouts_match_the_float64_reference():
    # bf16 has no numpy dtype: such a rollout must take the torch loop, not the host (numpy) one. A bf16 reward
    # with float32 values gives float32 deltas but a bf16 decay. Tolerances: bf16 keeps 8 bits (eps 2^-8).
    rollout = _random_rollout(5, 3, seed=11)
    r, v, nv, term, trunc = rollout
    bf = torch.bfloat16
    adv, ret = gae(r.to(bf), v.to(bf), nv.to(bf), term, trunc, gamma=0.99, gae_lambda=0.95)
    assert adv.dtype == bf and ret.dtype == bf
    rounded = (r.to(bf).double(), v.to(bf).double(), nv.to(bf).double(), term, trunc)
    torch.testing.assert_close(adv.double(), _reference_gae(*rounded, 0.99, 0.95), rtol=2e-2, atol=5e-2)
    adv, _ = gae(r.to(bf), v.float(), nv.float(), term, trunc, gamma=0.99, gae_lambda=0.95)
    assert adv.dtype == torch.float32
    expected = _reference_gae(r.to(bf).double(), v, nv, term, trunc, 0.99, 0.95)
    torch.testing.assert_close(adv.double(), expected, rtol=1e-2, atol=1e-2)


def test_gradients_flow_from_the_advantages_to_the_rewards():
    # Autograd through gae (e.g. a learned reward): sum_t A_t is linear in r, and r[s] enters A_t with weight
    # (gamma * lam)^(s - t) for every t <= s of the same episode. Only the deltas require grad here, the decay not.
    r, v, nv, term, trunc = _random_rollout(6, 3, seed=12)
    r.requires_grad_(True)
    gamma, lam = 0.9, 0.8
    adv, _ = gae(r, v, nv, term, trunc, gamma=gamma, gae_lambda=lam)
    adv.sum().backward()
    expected = torch.zeros(6, 3, dtype=F64)
    for n in range(3):
        t_term, t_trunc = term[:, n].tolist(), trunc[:, n].tolist()
        for s in range(6):
            expected[s, n] = sum((gamma * lam) ** (s - t) for t in range(s + 1)
                                 if _episode_end(t_term, t_trunc, t) >= s)
    torch.testing.assert_close(r.grad, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("N", [1, 3])
def test_a_nonfinite_reward_propagates_without_a_numpy_warning(N):
    # An Inf reward right after an episode end makes the host loop compute 0 * Inf: numpy would warn ("invalid
    # value encountered") on every rollout that holds one; torch does not, and the update's guard handles it.
    r, v, nv, _, trunc = _random_rollout(4, N, seed=13)
    r[1] = float("inf")
    term = torch.zeros(4, N, dtype=torch.bool)
    term[0] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adv, _ = gae(r, v, nv, term, torch.zeros_like(trunc), gamma=0.99, gae_lambda=0.95)
    assert not torch.isfinite(adv[:2]).any() and torch.isfinite(adv[2:]).all()


@pytest.mark.parametrize(("T", "N"), SHAPES)
def test_lambda_zero_gamma_one_is_td0(T, N):
    r, v, nv, term, trunc = _random_rollout(T, N, seed=T * 7 + N)
    adv, _ = gae(r, v, nv, term, trunc, gamma=1.0, gae_lambda=0.0)
    for t in range(T):
        for n in range(N):
            expected = r[t, n].item() + (0.0 if term[t, n] else nv[t, n].item()) - v[t, n].item()
            assert adv[t, n].item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("T", "N"), SHAPES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_lambda_one_is_monte_carlo_with_bootstrap_at_truncation(T, N, gamma):
    # With lambda = 1 the sum of deltas telescopes to the Monte-Carlo return only when the stored next values
    # chain with the values, so the rollout is built the way a collector stores it.
    rollout = _consistent_rollout(T, N, seed=T * 11 + N)
    adv, _ = gae(*rollout, gamma=gamma, gae_lambda=1.0)
    torch.testing.assert_close(adv, _reference_monte_carlo(*rollout, gamma), rtol=1e-10, atol=1e-10)


def test_hand_computed_two_step_episode():
    # One env, T = 3, gamma = 0.9, lam = 0.8; step 1 terminates, step 2 starts a new episode (rollout end).
    # deltas: d0 = 1 + 0.9*2 - 1 = 1.8; d1 = 2 + 0 - 0.5 = 1.5 (terminated); d2 = 0 + 0.9*4 - 3 = 0.6
    # A2 = 0.6; A1 = d1 = 1.5 (no bootstrap, no recursion into step 2); A0 = 1.8 + 0.72 * 1.5 = 2.88
    r = torch.tensor([[1.0], [2.0], [0.0]], dtype=F64)
    v = torch.tensor([[1.0], [0.5], [3.0]], dtype=F64)
    nv = torch.tensor([[2.0], [9.0], [4.0]], dtype=F64)
    term = torch.tensor([[False], [True], [False]])
    trunc = torch.zeros(3, 1, dtype=torch.bool)
    adv, ret = gae(r, v, nv, term, trunc, gamma=0.9, gae_lambda=0.8)
    torch.testing.assert_close(adv, torch.tensor([[2.88], [1.5], [0.6]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[3.88], [2.0], [3.6]], dtype=F64))


def test_truncation_bootstraps_and_termination_does_not():
    # Same step, r = 1, V = 0.5, V(next) = 2, gamma = 0.9:
    # truncated: 1 + 0.9*2 - 0.5 = 2.3; terminated: 1 - 0.5 = 0.5; both flags: termination wins -> 0.5
    r = torch.ones(1, 3, dtype=F64)
    v = torch.full((1, 3), 0.5, dtype=F64)
    nv = torch.full((1, 3), 2.0, dtype=F64)
    term = torch.tensor([[False, True, True]])
    trunc = torch.tensor([[True, False, True]])
    adv, _ = gae(r, v, nv, term, trunc, gamma=0.9, gae_lambda=0.95)
    torch.testing.assert_close(adv, torch.tensor([[2.3, 0.5, 0.5]], dtype=F64))


@pytest.mark.parametrize("flag", ["terminated", "truncated"])
def test_recursion_never_crosses_an_episode_boundary(flag):
    T, N, boundary = 6, 2, 2
    r, v, nv, _, _ = _random_rollout(T, N, seed=3)
    term = torch.zeros(T, N, dtype=torch.bool)
    trunc = torch.zeros(T, N, dtype=torch.bool)
    (term if flag == "terminated" else trunc)[boundary] = True
    adv, _ = gae(r, v, nv, term, trunc, gamma=0.99, gae_lambda=0.95)
    # Perturb everything after the boundary: the advantages up to and including it must not move.
    g = torch.Generator().manual_seed(4)
    r2, v2, nv2 = r.clone(), v.clone(), nv.clone()
    for x in (r2, v2, nv2):
        x[boundary + 1 :] += torch.randn(T - boundary - 1, N, generator=g, dtype=F64) * 10
    adv2, _ = gae(r2, v2, nv2, term, trunc, gamma=0.99, gae_lambda=0.95)
    torch.testing.assert_close(adv2[: boundary + 1], adv[: boundary + 1], rtol=0, atol=0)
    assert not torch.allclose(adv2[boundary + 1 :], adv[boundary + 1 :])
    # ...while without the boundary, step 0 does depend on later steps.
    none = torch.zeros(T, N, dtype=torch.bool)
    a, _ = gae(r, v, nv, none, none, gamma=0.99, gae_lambda=0.95)
    b, _ = gae(r2, v2, nv2, none, none, gamma=0.99, gae_lambda=0.95)
    assert not torch.allclose(a[0], b[0])


def test_envs_are_independent():
    # Column n of a [T, N] call equals a [T, 1] call on that column alone.
    rollout = _random_rollout(16, 4, seed=21)
    adv, _ = gae(*rollout, gamma=0.97, gae_lambda=0.9)
    for n in range(4):
        single = [x[:, n : n + 1] for x in rollout]
        adv_n, _ = gae(*single, gamma=0.97, gae_lambda=0.9)
        torch.testing.assert_close(adv[:, n : n + 1], adv_n, rtol=0, atol=0)


def test_gae_rejects_bad_shapes():
    r, v, nv, term, trunc = _random_rollout(4, 2, seed=0)
    # The message names the input of the wrong shape (one line, no traceback to read).
    rollout = {"values": v, "next_values": nv, "terminated": term, "truncated": trunc}
    for name in rollout:
        bad = dict(rollout, **{name: rollout[name][:, :1]})
        with pytest.raises(ValueError, match=rf"^gae: {name} has shape \(4, 1\), rewards has \(4, 2\)"):
            gae(r, **bad, gamma=0.99, gae_lambda=0.95)
    with pytest.raises(ValueError, match=r"^gae: expected \[T, N\] tensors, got 1 dims$"):
        gae(r.reshape(-1), v.reshape(-1), nv.reshape(-1), term.reshape(-1), trunc.reshape(-1), 0.99, 0.95)
    with pytest.raises(ValueError):
        gae(r, v, nv, term.unsqueeze(-1), trunc, gamma=0.99, gae_lambda=0.95)


@pytest.mark.parametrize("shape", [(1000,), (64, 8), (3, 5, 7)])
def test_normalize_mean_zero_std_one(shape):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g, dtype=F64) * 7.0 + 3.0
    y = normalize(x)
    assert y.shape == x.shape
    values = y.reshape(-1).tolist()
    mean = sum(values) / len(values)
    std = math.sqrt(sum((u - mean) ** 2 for u in values) / len(values))
    assert mean == pytest.approx(0.0, abs=1e-9)
    assert std == pytest.approx(1.0, abs=1e-6)
    # an affine map of the input: order is preserved
    assert torch.equal(torch.argsort(y.reshape(-1)), torch.argsort(x.reshape(-1)))


def test_normalize_constant_input_is_finite_zero():
    # 0.1 is inexact in binary: the rounded mean of seven float32 copies is off by an ulp, and dividing that
    # rounding error by an equally tiny std once gave -0.427 for every element.
    x = torch.full((7,), 0.1)
    assert x.mean() != x[0]
    y = normalize(x)
    assert torch.equal(y, torch.zeros(7))


CONSTANT_LENGTHS = [2, 3, 5, 7, 11, 13, 64, 100, 255, 1000, 4097, 100_003]
CONSTANT_VALUES = [0.1, 0.3, 1 / 3, -0.7, 2.5, 123.456, 1e-20, -3e30, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_normalize_of_any_constant_vector_is_exactly_zero_in_both_paths(dtype):
    from ppokit.kernels.fused_step import _normalize_rows

    for n in CONSTANT_LENGTHS:
        for v in CONSTANT_VALUES:
            x = torch.full((n,), v, dtype=dtype)
            assert torch.equal(normalize(x), torch.zeros_like(x)), (n, v)
            # The fused update normalizes equal-sized minibatches as rows, uneven ones chunk by chunk.
            for sizes in ([n], [n, n, n], [n + 1, n, n]):
                rows = torch.full((sum(sizes),), v, dtype=dtype)
                assert torch.equal(_normalize_rows(rows, sizes), torch.zeros_like(rows)), (sizes, v)


@pytest.mark.parametrize("mean", [1.0, 4.0, 0.25])
@pytest.mark.parametrize("masked", [False, True])
def test_a_spread_of_exactly_spread_ulps_of_the_mean_is_noise_and_twice_that_is_not(masked, mean):
    # float64: SPREAD_ULPS * eps * |mean| = 32 * 2^-52 * mean = 2^-47 * mean. [mean -+ 2^-47 * mean] (powers of
    # two, so every number here is exact) has population std 2^-47 * mean: the rule is std <= tol * |mean|, so it
    # is noise (0). Twice the spread is kept: (x - mean) / (std + 1e-8) = +-std / (std + 1e-8).
    assert SPREAD_ULPS * torch.finfo(F64).eps == 2.0 ** -47
    mask = torch.ones(2, dtype=torch.bool) if masked else None
    h = 2.0 ** -47 * mean
    edge = torch.tensor([mean - h, mean + h], dtype=F64)
    assert torch.equal(normalize(edge, mask=mask), torch.zeros(2, dtype=F64))
    above = torch.tensor([mean - 2 * h, mean + 2 * h], dtype=F64)
    step = 2 * h / (2 * h + 1e-8)
    torch.testing.assert_close(normalize(above, mask=mask), torch.tensor([-step, step], dtype=F64), rtol=1e-12, atol=0)


def test_normalize_keeps_real_spread_and_nonfinite_input():
    # A small but real spread is still normalized (one element 1e-3 above the rest).
    x = torch.full((7,), 0.1)
    x[3] += 1e-3
    y = normalize(x)
    assert float(y.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(y.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
    assert int(y.argmax()) == 3
    # NaN is not hidden as a "constant": the update's non-finite guard must still see it.
    x[0] = float("nan")
    assert torch.isnan(normalize(x)).all()


# ---------------------------------------------------------------------------------------------------------------
# Masks: padded sequences (a token trainer's [B, T] responses, passed time-major as [T, B]).
# ---------------------------------------------------------------------------------------------------------------


def _old_gae(rewards, values, next_values, terminated, truncated, gamma, gae_lambda):
    """The body of ``gae`` before it took a mask, verbatim: the unmasked call must give the same bits."""
    not_terminated = 1.0 - terminated.to(rewards.dtype)
    not_done = 1.0 - (terminated | truncated).to(rewards.dtype)
    deltas = rewards + gamma * not_terminated * next_values - values
    decay = (gamma * gae_lambda) * not_done
    advantages = torch.empty_like(rewards)
    last = torch.zeros_like(rewards[0])
    for t in range(rewards.shape[0] - 1, -1, -1):
        last = deltas[t] + decay[t] * last
        advantages[t] = last
    return advantages, advantages + values


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_unmasked_gae_is_bit_identical_to_the_unmasked_version(dtype):
    for seed in range(10):
        r, v, nv, term, trunc = _random_rollout(3 + seed, 1 + seed % 4, seed)
        r, v, nv = r.to(dtype), v.to(dtype), nv.to(dtype)
        adv, ret = gae(r, v, nv, term, trunc, 0.99, 0.95)
        old_adv, old_ret = _old_gae(r, v, nv, term, trunc, 0.99, 0.95)
        assert torch.equal(adv, old_adv) and torch.equal(ret, old_ret)


def _padded_rollout(T: int, N: int, seed: int):
    """A [T, N] rollout of N right-padded sequences of random lengths 1..T; the padding holds garbage (NaN, Inf,
    huge values) in every input, and random terminated/truncated flags, none of which may leak."""
    r, v, nv, term, trunc = _random_rollout(T, N, seed, p_term=0.1, p_trunc=0.1)
    g = torch.Generator().manual_seed(seed + 1000)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = torch.arange(T)[:, None] < lengths[None, :]  # [T, N]
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e300], dtype=F64)
    for x in (r, v, nv):
        x[~mask] = junk[torch.randint(0, 4, (int((~mask).sum()),), generator=g)]
    return (r, v, nv, term, trunc), mask, lengths


@pytest.mark.parametrize(("gamma", "lam"), [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0)])
def test_masked_gae_equals_gae_on_each_sequence_alone(gamma, lam):
    for seed in range(60):
        T, N = 1 + seed % 9, 1 + seed % 5
        (r, v, nv, term, trunc), mask, lengths = _padded_rollout(T, N, seed)
        adv, ret = gae(r, v, nv, term, trunc, gamma, lam, mask=mask)
        assert torch.equal(adv[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
        assert torch.equal(ret[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
        for n, L in enumerate(lengths.tolist()):
            one = [x[:L, n : n + 1].clone() for x in (r, v, nv, term, trunc)]
            # The sequence ends at its last token: terminal unless that step asks for a bootstrap (truncated).
            one[3][L - 1] |= ~one[4][L - 1]
            adv_n, ret_n = gae(*one, gamma, lam)
            assert torch.equal(adv[:L, n : n + 1], adv_n), (seed, n)
            assert torch.equal(ret[:L, n : n + 1], ret_n), (seed, n)


def test_masked_gae_hand_computed_ragged_pair():
    # Two sequences, gamma = 0.5, lam = 1, no flags; lengths 3 and 1, padding is NaN. Token trainers chain
    # next_values[t] = values[t + 1], so the last real step would read the padding's value: it must read 0.
    # seq 0: r = [1, 0, 2], v = [1, 2, 3], nv = [2, 3, NaN]; d = [1 + 1 - 1, 0 + 1.5 - 2, 2 + 0 - 3] = [1, -0.5, -1]
    #        A2 = -1; A1 = -0.5 + 0.5 * -1 = -1; A0 = 1 + 0.5 * -1 = 0.5; returns = A + v = [1.5, 1, 2]
    # seq 1: r = [4], v = [1], nv = [NaN]: A0 = 4 - 1 = 3, return 4.
    nan = float("nan")
    r = torch.tensor([[1.0, 4.0], [0.0, nan], [2.0, nan]], dtype=F64)
    v = torch.tensor([[1.0, 1.0], [2.0, nan], [3.0, nan]], dtype=F64)
    nv = torch.tensor([[2.0, nan], [3.0, nan], [nan, nan]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    flags = torch.zeros(3, 2, dtype=torch.bool)
    adv, ret = gae(r, v, nv, flags, flags, 0.5, 1.0, mask=mask)
    assert torch.equal(adv, torch.tensor([[0.5, 3.0], [-1.0, 0.0], [-1.0, 0.0]], dtype=F64))
    assert torch.equal(ret, torch.tensor([[1.5, 4.0], [1.0, 0.0], [2.0, 0.0]], dtype=F64))
    # Truncated at the last real step: the caller asks for a bootstrap there, from next_values.
    nv[2, 0], trunc = 4.0, flags.clone()
    trunc[2, 0] = True
    adv, _ = gae(r, v, nv, flags, trunc, 0.5, 1.0, mask=mask)
    assert adv[2, 0].item() == 2.0 + 0.5 * 4.0 - 3.0


def test_masked_gae_all_ones_mask_ends_every_column_at_T():
    r, v, nv, term, trunc = _random_rollout(6, 3, seed=5)
    adv, ret = gae(r, v, nv, term, trunc, 0.99, 0.95, mask=torch.ones(6, 3, dtype=torch.bool))
    term_end = term.clone()
    term_end[-1] |= ~trunc[-1]
    ref_adv, ref_ret = gae(r, v, nv, term_end, trunc, 0.99, 0.95)
    assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)


def test_masked_gae_left_padding_and_gaps_split_sequences():
    # Any run of real steps is one sequence: a left-padded column, and a column with a gap (two sequences).
    r, v, nv, term, trunc = _random_rollout(7, 2, seed=8, p_term=0.0, p_trunc=0.0)
    mask = torch.tensor([[0, 1], [0, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 0]], dtype=torch.bool)
    adv, _ = gae(r, v, nv, term, trunc, 0.9, 0.8, mask=mask)
    end = torch.ones(1, 1, dtype=torch.bool)  # each piece alone, terminated at its last step
    for n, lo, hi in ((0, 2, 7), (1, 0, 2), (1, 3, 6)):
        piece = [x[lo:hi, n : n + 1] for x in (r, v, nv)]
        flags = torch.zeros(hi - lo, 1, dtype=torch.bool)
        term_p = torch.cat([flags[:-1], end])
        adv_p, _ = gae(*piece, term_p, flags, 0.9, 0.8)
        assert torch.equal(adv[lo:hi, n : n + 1], adv_p), (n, lo, hi)
    assert torch.equal(adv[~mask], torch.zeros(int((~mask).sum()), dtype=F64))


def test_masked_gae_rejects_a_mask_of_another_shape():
    r, v, nv, term, trunc = _random_rollout(4, 3, seed=0)
    with pytest.raises(ValueError, match=r"gae: mask has shape \(3, 4\).*\[T, N\]"):
        gae(r, v, nv, term, trunc, 0.99, 0.95, mask=torch.ones(3, 4, dtype=torch.bool))


def test_masked_normalize_uses_only_the_counted_entries():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 8, generator=g, dtype=F64) * 3 + 1
    mask = torch.arange(8)[None, :] < torch.tensor([8, 3, 1, 5, 6])[:, None]
    garbage = torch.where(mask, x, float("nan"))
    y = normalize(garbage, mask=mask)
    assert torch.equal(y[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
    torch.testing.assert_close(y[mask], normalize(x[mask]), rtol=1e-12, atol=1e-12)
    valid = y[mask].tolist()
    mean = sum(valid) / len(valid)
    assert mean == pytest.approx(0.0, abs=1e-12)
    assert math.sqrt(sum((u - mean) ** 2 for u in valid) / len(valid)) == pytest.approx(1.0, abs=1e-6)  # eps
    # Per row (dim=1, per-sequence whitening): each row's counted entries alone; row 2 has one entry -> 0.
    rows = normalize(garbage, dim=1, mask=mask.float())
    for b in range(5):
        expected = normalize(x[b][mask[b]]) if mask[b].sum() > 1 else torch.zeros(1, dtype=F64)
        torch.testing.assert_close(rows[b][mask[b]], expected, rtol=1e-12, atol=1e-12)
        assert torch.equal(rows[b][~mask[b]], torch.zeros(int((~mask[b]).sum()), dtype=F64))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_masked_normalize_constant_counted_entries_are_exactly_zero(dtype):
    for n in (2, 3, 7, 100, 4097):
        for value in CONSTANT_VALUES:
            x = torch.full((n + 3,), value, dtype=dtype)
            x[n:] = torch.tensor([5.0, -1e6, float("inf")], dtype=dtype)  # padding that varies
            mask = torch.arange(n + 3) < n
            assert torch.equal(normalize(x, mask=mask), torch.zeros_like(x)), (n, value)
    # Nothing counted, or one entry: zeros, never NaN.
    x = torch.randn(4, 3, dtype=dtype)
    assert torch.equal(normalize(x, mask=torch.zeros(4, 3, dtype=torch.bool)), torch.zeros_like(x))
    assert torch.equal(normalize(x, dim=1, mask=torch.eye(4, 3, dtype=torch.bool)), torch.zeros_like(x))


def test_masked_normalize_keeps_a_counted_nan_and_checks_the_shape():
    x = torch.tensor([1.0, float("nan"), 3.0, 4.0])
    y = normalize(x, mask=torch.tensor([1, 1, 1, 0]))
    assert torch.isnan(y[:3]).all() and y[3].item() == 0.0  # the update's non-finite guard still sees it
    with pytest.raises(ValueError, match=r"normalize: mask has shape \(3,\), x has \(4,\)"):
        normalize(x, mask=torch.ones(3))
