"""Memory of the log-prob passes, measured without a peak-memory counter (the CPU allocator has none):

* the update's forward with the entropy only logged (``ent_coef = 0``) keeps ONE full-vocabulary tensor for the
  backward (counted with ``torch.autograd.graph.saved_tensors_hooks``: the distinct saved ``[B, R, V]`` storages),
  where the entropy inside the graph kept at least two;
* the no-gradient passes (pi_old, pi_ref) run the selective log-softmax (``logit[token] - logsumexp``) over row
  chunks: the largest tensor any op creates from the logits is one chunk, not ``[B, R, V]`` (every op's output
  recorded by a ``TorchDispatchMode``), with the same numbers as one pass."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

import torch  # noqa: E402

from ppokit.lm import logprobs as L  # noqa: E402
from ppokit.lm.tiny import build_tiny  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    model, tok = build_tiny("ABCDEFGHIJKLMNOPQRSTUVWXYZ:", seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok), (6, 12), generator=g)
    attn = torch.ones_like(ids)
    return model.train(False), ids, attn, len(tok)


def _full_vocab_saved(fn, rows, R, V):
    """Distinct storages of the saved tensors that hold a full-vocabulary row per response position."""
    seen = set()

    def pack(t):
        # [rows, R, V] or [rows * R, V] (not the LM head's [H, V] weight, which the model saves anyway)
        if t.dim() >= 2 and t.shape[-1] == V and t.shape[0] in (rows, rows * R) and t.numel() >= rows * R * V:
            seen.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return len(seen), out


def test_the_update_forward_saves_only_the_logits_when_the_entropy_is_only_logged(setup):
    model, ids, attn, V = setup
    R = 5
    n, (logp, ent) = _full_vocab_saved(lambda: L.token_logprobs(model, ids, attn, R, 0.7, with_entropy=True,
                                                                entropy_grad=False), ids.shape[0], R, V)
    assert n == 1, f"{n} full-vocabulary tensors saved for the backward (the logits alone expected)"
    assert logp.requires_grad and not ent.requires_grad
    # The textbook form keeps log_softmax's [B, R, V] output as well: this is the count the change removed.
    def textbook():
        logits = L.sequence_forward(model, ids, attn, R) / 0.7
        lsm = torch.log_softmax(logits.float(), -1)
        return lsm.gather(-1, ids[:, -R:, None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)

    n_textbook, (ref_logp, ref_ent) = _full_vocab_saved(textbook, ids.shape[0], R, V)
    assert n_textbook >= 2
    assert torch.allclose(logp, ref_logp, atol=1e-6) and torch.allclose(ent, ref_ent, atol=1e-5)


def test_an_entropy_bonus_keeps_the_entropy_in_the_graph(setup):
    model, ids, attn, V = setup
    logp, ent = L.token_logprobs(model, ids, attn, 4, 1.0, with_entropy=True, entropy_grad=True)
    assert ent.requires_grad
    ent.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_the_chunked_no_gradient_pass_equals_one_pass(setup, monkeypatch):
    model, ids, attn, V = setup
    with torch.no_grad():
        whole, whole_ent = L.token_logprobs(model, ids, attn, 6, 0.9, with_entropy=True)
        monkeypatch.setattr(L, "_CHUNK_ELEMENTS", 6 * V * 2)  # two rows per chunk: three chunks
        chunked, chunked_ent = L.token_logprobs(model, ids, attn, 6, 0.9, with_entropy=True)
    assert torch.equal(whole, chunked) and torch.equal(whole_ent, chunked_ent)


def test_the_no_gradient_log_softmax_creates_nothing_larger_than_a_chunk(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    B, R, V = 8, 6, 50
    logits = torch.randn(B, R, V)
    tokens = torch.randint(0, V, (B, R))
    reference = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", 2 * R * V)
    with Largest() as mode:
        logp = L.selective_logprobs(logits, tokens)
    assert mode.largest <= 2 * R * V < B * R * V
    assert torch.allclose(logp, reference, atol=1e-6)


def test_a_half_precision_policy_is_warned_about_and_a_float32_one_is_not():
    import warnings

    from ppokit.lm import GRPOTrainer, LMConfig

    cfg = LMConfig(batch_prompts=1, group_size=2, max_new_tokens=2, beta=0.0)
    for dtype, warned in [(torch.bfloat16, True), (torch.float32, False)]:
        model, tok = build_tiny("AB:", seed=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            GRPOTrainer(model.to(dtype), tok, reward=lambda p, c: [0.0] * len(c), prompts=["A:"], config=cfg)
        half = [w for w in caught if "half precision" in str(w.message)]
        assert bool(half) == warned, [str(w.message) for w in caught]
        if warned:
            assert "bfloat16" in str(half[0].message)
