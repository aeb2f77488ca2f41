"""The sampling backends: ppokit's ``CachedSampler`` (the default) and ``HFGenerator`` (``model.generate``) sample
exactly the tempered full distribution of the model, with left padding, and stop and pad the same way.

Distribution checks: the sampled tokens' log-probabilities equal the learner's recomputation (< 1e-5, alone and in
a left-padded batch); first-token and first-two-token frequencies pass a chi-square test against the model's exact
probabilities (and the same test rejects the untempered distribution, so it can tell); with a near-greedy
temperature both backends return the same ids. One seed gives other samples per backend (they consume the RNG
differently), so they are compared in distribution, not sample by sample.
"""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

import torch  # noqa: E402

from ppokit.config.ppo_config import ConfigError  # noqa: E402
from ppokit.lm import GRPOTrainer, LMConfig  # noqa: E402
from ppokit.lm.fast_gpt2 import gpt2_decoder  # noqa: E402
from ppokit.lm.generation import HFGenerator, SamplingSettings  # noqa: E402
from ppokit.lm.logprobs import position_ids, response_mask, token_logprobs  # noqa: E402
from ppokit.lm.rollout import encode_prompts  # noqa: E402
from ppokit.lm.sampling import CachedSampler  # noqa: E402
from ppokit.lm.tiny import build_tiny  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def base():
    return build_tiny("ABX:", pad_is_eos=True, seed=0)


@pytest.fixture
def model(base):
    return copy.deepcopy(base[0]).eval()


@pytest.fixture
def tok(base):
    return base[1]


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of ``counts`` to ``probs``; cells expected < 5 are pooled into one.
    The p-value is the chi-square survival function, ``Q(df / 2, x / 2)`` (regularized upper incomplete gamma)."""
    n = counts.sum().double()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts.double()[~small], counts.double()[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _next_token_probs(model, tok, text: str, temperature: float) -> torch.Tensor:
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].float()
    return torch.softmax(logits / temperature, -1)


def _generic():
    return CachedSampler(fast=False)


# The cached sampler on the tiny GPT-2 takes the lean GPT-2 step (fast_gpt2); fast=False goes through the model's
# own forward and cache (what any other causal LM gets); HFGenerator is transformers' generate.
BACKENDS = [CachedSampler, _generic, HFGenerator]


# ---------------------------------------------------------------- log-probs of the sampled tokens
@pytest.mark.parametrize("fast", [True, False])
def test_cached_sampler_logprobs_equal_recomputed_ones_with_left_padding_alone_and_in_a_batch(fast, model, tok):
    torch.manual_seed(0)
    settings = SamplingSettings(6, 0.7, tok.eos_token_id, tok.pad_token_id)
    prompts = ["X:", "ABXBA:", "B:", "AX:"] * 4
    prompt_ids, prompt_mask = encode_prompts(tok, prompts, tok.pad_token_id, CPU)
    assert (prompt_mask == 0).any()  # the batch really is left-padded
    response, gen_logp = CachedSampler(fast=fast).sample(model, prompt_ids, prompt_mask, settings)
    R = response.shape[1]
    mask = response_mask(response, tok.eos_token_id)
    ids = torch.cat([prompt_ids, torch.where(mask, response, tok.pad_token_id)], 1)
    attn = torch.cat([prompt_mask, mask.long()], 1)
    with torch.no_grad():
        batch_logp, _ = token_logprobs(model, ids, attn, R, 0.7)
        assert (batch_logp - gen_logp)[mask].abs().max() < 1e-5
        for b in range(len(prompts)):  # each row alone, without any padding
            n = int(mask[b].sum())
            row = torch.cat([prompt_ids[b][prompt_mask[b].bool()], response[b, :n]])[None]
            alone, _ = token_logprobs(model, row, torch.ones_like(row), n, 0.7)
            assert (alone[0] - gen_logp[b, :n]).abs().max() < 1e-5
    assert (gen_logp[~mask] == 0).all()  # nothing is counted after a row's EOS


# ---------------------------------------------------------------- frequencies against exact probabilities
@pytest.mark.parametrize("backend", BACKENDS)
def test_first_token_frequencies_follow_the_tempered_distribution(backend, model, tok):
    temperature, n = 0.6, 4000
    probs = _next_token_probs(model, tok, "X:", temperature)
    prompt_ids, prompt_mask = encode_prompts(tok, ["X:"] * n, tok.pad_token_id, CPU)
    torch.manual_seed(1)
    first = backend().generate(model, prompt_ids, prompt_mask,
                               SamplingSettings(1, temperature, tok.eos_token_id, tok.pad_token_id))[:, 0]
    counts = torch.bincount(first, minlength=probs.numel())
    assert _chi2_pvalue(counts, probs) > 1e-3
    # The test has the power to tell: the same samples against the untempered distribution are rejected.
    assert _chi2_pvalue(counts, _next_token_probs(model, tok, "X:", 1.0)) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_token_frequencies_of_a_left_padded_row_follow_the_model(backend, model, tok):
    # The second token goes through the KV cache and the decode-step positions of a left-padded row.
    temperature, n = 0.8, 3000
    V, eos = model.config.vocab_size, tok.eos_token_id
    p1 = _next_token_probs(model, tok, "X:", temperature)
    joint = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        if a == eos:  # a row that ended: its second column is padding
            joint[a, tok.pad_token_id] = p1[a]
            continue
        text = "X:" + tok.decode([a])
        ids = torch.tensor([tok("X:")["input_ids"] + [a]])
        assert tok.decode(ids[0]) == text
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1].float()
        joint[a] = p1[a] * torch.softmax(logits / temperature, -1)
    prompts = ["ABXBA:", "X:"] * n  # every "X:" row is left-padded by 4
    prompt_ids, prompt_mask = encode_prompts(tok, prompts, tok.pad_token_id, CPU)
    torch.manual_seed(2)
    out = backend().generate(model, prompt_ids, prompt_mask,
                             SamplingSettings(2, temperature, eos, tok.pad_token_id))[1::2]
    assert out.shape[1] == 2
    cells = out[:, 0] * V + out[:, 1]
    counts = torch.bincount(cells, minlength=V * V)
    assert _chi2_pvalue(counts, joint.reshape(-1)) > 1e-3


# ---------------------------------------------------------------- stopping, padding, agreement
def test_with_a_near_greedy_temperature_the_backends_return_the_same_ids(model, tok):
    prompts = ["X:", "ABXBA:", "B:", "AXXB:"]
    prompt_ids, prompt_mask = encode_prompts(tok, prompts, tok.pad_token_id, CPU)
    settings = SamplingSettings(8, 1e-4, tok.eos_token_id, tok.pad_token_id)
    outs = []
    for seed, backend in enumerate(BACKENDS):
        torch.manual_seed(seed)
        outs.append(backend().generate(model, prompt_ids, prompt_mask, settings))
    for other in outs[1:]:
        assert torch.equal(outs[0], other)
        assert torch.equal(response_mask(outs[0], tok.eos_token_id), response_mask(other, tok.eos_token_id))


def test_the_lean_gpt2_step_matches_the_models_forward_and_is_refused_when_it_would_not(model, tok):
    prompt_ids, prompt_mask = encode_prompts(tok, ["X:", "ABXBA:"], tok.pad_token_id, CPU)
    positions = position_ids(prompt_mask)
    with torch.no_grad():
        decoder, logits = gpt2_decoder(model, prompt_ids, prompt_mask, positions, capacity=prompt_ids.shape[1] + 2)
        # One more token through the preallocated cache against the model's forward over the whole sequence.
        token = torch.tensor([3, 4])
        mask = torch.cat([prompt_mask, torch.ones(2, 1, dtype=torch.long)], 1)
        step = decoder.step(token, prompt_mask.sum(-1), mask.bool()[:, None, None, :])
        full = model(input_ids=torch.cat([prompt_ids, token[:, None]], 1), attention_mask=mask,
                     position_ids=position_ids(mask)).logits
        assert (logits - full[:, -2]).abs().max() < 1e-5 and (step - full[:, -1]).abs().max() < 1e-5
        # A model that computes something else than plain GPT-2 is left to its own forward.
        odd = copy.deepcopy(model)
        plain = odd.forward
        odd.forward = lambda **kw: SimpleNamespace(logits=plain(**kw).logits + 1e-2 * torch.arange(float(model.config.vocab_size)))
        assert gpt2_decoder(odd, prompt_ids, prompt_mask, positions, capacity=8) is None
        odd = copy.deepcopy(model)
        odd.config.reorder_and_upcast_attn = True
        assert gpt2_decoder(odd, prompt_ids, prompt_mask, positions, capacity=8) is None


class Countdown(torch.nn.Module):
    """A fake causal LM with a KV "cache": the token at position ``q`` of row ``b`` is EOS (id 1) when
    ``q >= stop[b]`` and 3 before, deterministically. It checks that every decode step feeds one token per row at
    that row's own next position, with an attention mask one column longer than the last."""

    def __init__(self, stop: list[int], vocab: int = 5):
        super().__init__()
        self.stop, self.vocab = torch.tensor(stop), vocab
        self.calls = 0

    def forward(self, input_ids, attention_mask, position_ids, use_cache, cache=None, logits_to_keep=0):
        self.calls += 1
        B, L = input_ids.shape
        if cache is not None:
            assert L == 1 and torch.equal(position_ids[:, 0], cache["next"])  # one new token at its own position
            assert attention_mask.shape[1] == cache["length"] + 1
        pos = position_ids[:, -1]
        token = torch.where(pos + 1 >= self.stop, 1, 3)
        logits = torch.full((B, 1, self.vocab), -float("inf"))
        logits[torch.arange(B), 0, token] = 0.0
        length = attention_mask.shape[1]
        return SimpleNamespace(logits=logits, cache={"next": pos + 1, "length": length})


def test_rows_stop_at_their_first_eos_are_padded_after_it_and_decoding_ends_with_the_last_row():
    prompt_ids = torch.tensor([[0, 0, 7], [7, 7, 7], [0, 7, 7]])
    prompt_mask = (prompt_ids != 0).long()
    # The rows' first response positions are 1, 3 and 2 (their real-token counts); the token at position 3 is EOS.
    model = Countdown(stop=[3, 3, 3])
    settings = SamplingSettings(10, 1.0, eos_token_id=1, pad_token_id=0)
    out = CachedSampler().generate(model, prompt_ids, prompt_mask, settings)
    assert out.tolist() == [[3, 3, 1], [1, 0, 0], [3, 1, 0]]
    assert model.calls == 3  # stopped when every row had ended, not at max_new_tokens
    assert response_mask(out, 1).tolist() == [[True, True, True], [True, False, False], [True, True, False]]


def test_at_max_new_tokens_a_row_without_eos_is_cut():
    prompt_ids = torch.tensor([[7, 7]])
    model = Countdown(stop=[100])
    out = CachedSampler().generate(model, prompt_ids, torch.ones_like(prompt_ids),
                                   SamplingSettings(4, 1.0, eos_token_id=1, pad_token_id=0))
    assert out.tolist() == [[3, 3, 3, 3]] and model.calls == 4


def test_the_cached_sampler_ignores_the_models_generation_config_and_warns_once(model, tok):
    model.generation_config.top_k = 1  # greedy if it were applied
    model.generation_config.repetition_penalty = 5.0
    prompt_ids, prompt_mask = encode_prompts(tok, ["X:"] * 32, tok.pad_token_id, CPU)
    sampler, settings = CachedSampler(), SamplingSettings(5, 1.0, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="top_k=1.*repetition_penalty=5.0"):
        out = sampler.generate(model, prompt_ids, prompt_mask, settings)
    assert len({tuple(r) for r in out.tolist()}) > 1  # sampled, not greedy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.generate(model, prompt_ids, prompt_mask, settings)


# ---------------------------------------------------------------- choosing the backend
def test_the_trainers_sample_with_the_cached_sampler_unless_told_hf(base):
    reward = lambda prompts, completions: [float(c.count("X")) for c in completions]  # noqa: E731
    small = dict(batch_prompts=1, group_size=2, max_new_tokens=3)
    t = GRPOTrainer(copy.deepcopy(base[0]), base[1], reward=reward, prompts=["X:"], config=LMConfig(**small))
    assert isinstance(t.backend, CachedSampler)
    t = GRPOTrainer(copy.deepcopy(base[0]), base[1], reward=reward, prompts=["X:"],
                    config=LMConfig(sampler="hf", **small))
    assert isinstance(t.backend, HFGenerator)
    assert t.step()  # trains with it
    with pytest.raises(ConfigError, match="sampler"):
        LMConfig(sampler="vllm").validate()


# ---------------------------------------------------------------- fused activations
def test_fused_activations_compute_the_models_gelu_and_are_applied_unless_turned_off(base, tok):
    from ppokit.lm.kernels import FusedTanhGELU, fuse_activations

    plain = copy.deepcopy(base[0]).eval()
    fused = copy.deepcopy(base[0]).eval()
    assert fuse_activations(fused) == plain.config.n_layer
    ids = torch.randint(3, plain.config.vocab_size, (4, 9))
    with torch.no_grad():
        assert (fused(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max() < 1e-5
    reward = lambda prompts, completions: [0.0] * len(completions)  # noqa: E731
    small = dict(batch_prompts=1, group_size=2, max_new_tokens=3)

    def acts(m):
        return {type(x).__name__ for x in m.modules() if "GELU" in type(x).__name__}

    t = GRPOTrainer(copy.deepcopy(base[0]), tok, reward=reward, prompts=["X:"], config=LMConfig(**small))
    assert acts(t.policy) == acts(t.ref_model) == {FusedTanhGELU.__name__}
    t = GRPOTrainer(copy.deepcopy(base[0]), tok, reward=reward, prompts=["X:"],
                    config=LMConfig(fused_activations=False, **small))
    assert acts(t.policy) == {"NewGELUActivation"}
