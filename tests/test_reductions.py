"""Reference tests for ``ppokit.core.reductions.reduce``: hand-computed values for every mode on a ragged ``[B, T]``
batch, a brute-force Python loop over random ragged masks, exact gradients, and the empty-mask rule."""

from __future__ import annotations

import math

import pytest
import torch

from ppokit.core.reductions import REDUCTION_MODES, reduce

F64 = torch.float64
NAN, INF = float("nan"), float("inf")

# Three responses of lengths 4, 2 and 1, right-padded to T = 4; the padding holds garbage that must not count.
X = torch.tensor([[1.0, 2.0, 3.0, 4.0],
                  [5.0, 6.0, NAN, INF],
                  [7.0, -INF, 1e30, NAN]], dtype=F64)
MASK = torch.tensor([[1, 1, 1, 1],
                     [1, 1, 0, 0],
                     [1, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        # Every token weighs the same: (1+2+3+4 + 5+6 + 7) / 7 = 28 / 7 = 4.
        ("mean", {}, 4.0),
        ("token_mean", {}, 4.0),
        # Every sequence weighs the same: (10/4 + 11/2 + 7/1) / 3 = (2.5 + 5.5 + 7) / 3 = 5.
        ("seq_mean_token_mean", {}, 5.0),
        # Token sums over the constant T = 4: (10/4 + 11/4 + 7/4) / 3 = 7/3.
        ("seq_mean_token_sum_norm", {}, 7.0 / 3.0),
        # ... or over a generation budget of 8 tokens: (10/8 + 11/8 + 7/8) / 3 = 7/6.
        ("seq_mean_token_sum_norm", {"normalizer": 8}, 7.0 / 6.0),
    ],
)
def test_hand_values_ragged_mask_with_garbage_padding(mode, kwargs, expected):
    out = reduce(X, MASK, mode, **kwargs)
    assert out.shape == ()
    assert out.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("seq_mean_token_mean", {}, 2.75),  # (1.5 + 4) / 2
        ("seq_mean_token_sum_norm", {}, 2.75),  # T = 2: (3/2 + 8/2) / 2, the per-sequence mean when unpadded
        ("seq_mean_token_sum_norm", {"normalizer": 4.0}, 1.375),  # (3/4 + 8/4) / 2
    ],
)
def test_hand_values_unmasked_sequence_modes(mode, kwargs, expected):
    x = torch.tensor([[1.0, 2.0], [3.0, 5.0]], dtype=F64)
    assert reduce(x, None, mode, **kwargs).item() == pytest.approx(expected, abs=1e-12)


def test_a_float_mask_selects_like_a_bool_mask():
    for mode in REDUCTION_MODES:
        assert torch.equal(reduce(X, MASK.to(F64), mode), reduce(X, MASK, mode))
        assert torch.equal(reduce(X, MASK.long(), mode), reduce(X, MASK, mode))


@pytest.mark.parametrize("shape", [(7,), (5, 3), (2, 3, 4), (1,)])
@pytest.mark.parametrize("mode", ["mean", "token_mean"])
def test_unmasked_mean_is_exactly_x_mean(shape, mode):
    for seed in range(5):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(reduce(x, None, mode), x.mean())
        assert torch.equal(reduce(x), x.mean())


def _ragged(B: int, T: int, seed: int, p_empty: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[torch.rand(B, generator=g) < p_empty] = 0
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] right padding
    x = torch.randn(B, T, generator=g, dtype=F64)
    x[~mask] = torch.tensor([NAN, INF, -INF, 1e300], dtype=F64)[torch.randint(0, 4, (int((~mask).sum()),), generator=g)]
    return x, mask, lengths


def _loop_reference(x, lengths, mode, normalizer=None):
    """The three formulas written as plain Python sums over the valid tokens of each non-empty row."""
    rows = [x[b, : int(n)].tolist() for b, n in enumerate(lengths) if n > 0]
    if not rows:
        return 0.0
    if mode in ("mean", "token_mean"):
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    norm = x.shape[1] if normalizer is None else normalizer
    return sum(sum(r) / norm for r in rows) / len(rows)


@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_against_loop_reference_on_random_ragged_batches(mode):
    for seed in range(40):
        x, mask, lengths = _ragged(B=1 + seed % 7, T=1 + seed % 9, seed=seed, p_empty=0.2)
        expected = _loop_reference(x, lengths, mode)
        assert reduce(x, mask, mode).item() == pytest.approx(expected, rel=1e-12, abs=1e-12), seed
    x, mask, lengths = _ragged(B=5, T=6, seed=99)
    assert reduce(x, mask, "seq_mean_token_sum_norm", normalizer=32).item() == pytest.approx(
        _loop_reference(x, lengths, "seq_mean_token_sum_norm", normalizer=32), rel=1e-12)


@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_all_ones_mask_equals_unmasked(mode):
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(3), dtype=F64)
    assert torch.allclose(reduce(x, torch.ones_like(x, dtype=torch.bool), mode), reduce(x, None, mode),
                          rtol=1e-14, atol=0)


@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_padding_rows_to_a_fixed_batch_shape_changes_nothing(mode):
    # A trainer padding its batch with empty rows (fixed shapes for compile) gets the same loss.
    x, mask, _ = _ragged(B=4, T=5, seed=11)
    x_more = torch.cat([x, torch.full((3, 5), NAN, dtype=F64)])
    mask_more = torch.cat([mask, torch.zeros(3, 5, dtype=torch.bool)])
    assert reduce(x_more, mask_more, mode).item() == pytest.approx(reduce(x, mask, mode).item(), rel=1e-14)


@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_empty_mask_gives_zero_with_zero_gradient(mode):
    x = torch.tensor([[1.0, NAN, 3.0], [INF, 5.0, 6.0]], dtype=F64, requires_grad=True)
    out = reduce(x, torch.zeros(2, 3, dtype=torch.bool), mode)
    assert out.item() == 0.0 and not math.isnan(out.item())
    out.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_gradient_is_exactly_zero_on_masked_entries_and_the_weight_elsewhere(mode):
    x = X.clone().requires_grad_(True)
    reduce(x, MASK, mode).backward()
    lengths = MASK.sum(1, keepdim=True).to(F64)  # [[4], [2], [1]]
    weight = {
        "mean": torch.full_like(X, 1 / 7),  # each of the 7 tokens: 1/7
        "token_mean": torch.full_like(X, 1 / 7),
        "seq_mean_token_mean": (1.0 / (3 * lengths)).expand_as(X),  # 1 / (n_sequences * length)
        "seq_mean_token_sum_norm": torch.full_like(X, 1 / (3 * 4)),  # 1 / (n_sequences * T)
    }[mode]
    assert torch.equal(x.grad[~MASK], torch.zeros(int((~MASK).sum()), dtype=F64))
    assert torch.allclose(x.grad[MASK], weight[MASK], rtol=1e-15, atol=0)


def test_bad_input_names_what_is_wrong():
    x = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="unknown mode 'sum'; choose one of mean, token_mean, seq_mean_token_mean, "
                                         "seq_mean_token_sum_norm$"):
        reduce(x, None, "sum")
    with pytest.raises(ValueError, match=r"mask has shape \(4, 3\).*\(3, 4\)"):
        reduce(x, torch.ones(4, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask has shape \(3, 1\)"):
        reduce(x, torch.ones(3, 1, dtype=torch.bool))  # would broadcast; refused
    with pytest.raises(ValueError, match=r"'seq_mean_token_mean' needs a \[B, T\] tensor"):
        reduce(torch.zeros(12), None, "seq_mean_token_mean")
    with pytest.raises(ValueError, match=r"'seq_mean_token_sum_norm' needs a \[B, T\] tensor"):
        reduce(torch.zeros(2, 3, 4), None, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        reduce(x, None, "seq_mean_token_sum_norm", normalizer=0)
