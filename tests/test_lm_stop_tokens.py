"""Stop tokens: a completion ends at the first of the tokenizer's EOS and every id of the model's
``generation_config.eos_token_id`` (an int or a list, as instruct models ship it), in both sampling backends; the
response mask ends there, and the text the reward sees stops before it."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")


from ppokit.lm import GRPOTrainer, LMConfig  # noqa: E402
from ppokit.lm.generation import stop_token_ids  # noqa: E402
from ppokit.lm.tiny import build_tiny  # noqa: E402


def _trainer(sampler: str, second_stop: bool):
    model, tok = build_tiny("ABX:", seed=0)
    x = tok.convert_tokens_to_ids("X")
    if second_stop:
        model.generation_config.eos_token_id = [tok.eos_token_id, x]
    cfg = LMConfig(batch_prompts=1, group_size=24, max_new_tokens=12, sampler=sampler, beta=0.0, seed=3)
    trainer = GRPOTrainer(model, tok, reward=lambda prompts, completions: [0.0] * len(completions),
                          prompts=["AB:"], config=cfg)
    return trainer, tok, x


def test_the_stop_ids_are_the_union_of_the_tokenizers_eos_and_the_generation_configs_int_or_list():
    model, tok = build_tiny("ABX:", seed=0)
    a, x = tok.convert_tokens_to_ids("A"), tok.convert_tokens_to_ids("X")
    model.generation_config.eos_token_id = x
    assert stop_token_ids(tok, model) == (tok.eos_token_id, x)
    model.generation_config.eos_token_id = [x, tok.eos_token_id, a]
    assert stop_token_ids(tok, model) == (tok.eos_token_id, x, a)
    model.generation_config.eos_token_id = None
    assert stop_token_ids(tok, model) == (tok.eos_token_id,)


@pytest.mark.parametrize("sampler", ["cached", "hf"])
def test_completions_stop_at_the_second_stop_id_of_the_generation_config_and_are_masked_after_it(sampler):
    trainer, tok, x = _trainer(sampler, second_stop=True)
    s = trainer._sample(["AB:"] * 24, with_ref=False)
    b = s.batch
    response = b.input_ids[:, -b.n_response:]
    hit = 0
    for row, mask, text, eos in zip(response.tolist(), b.response_mask.tolist(), s.completions, s.has_eos.tolist()):
        n = sum(mask)
        assert mask == [True] * n + [False] * (len(mask) - n)  # one real block, then padding
        real = row[:n]
        stops = [i for i, t in enumerate(real) if t in (x, tok.eos_token_id)]
        if x in real:
            hit += 1
            assert stops == [n - 1] and real[-1] == x and eos  # the X ends the completion and is its last token
        assert "X" not in text  # the stop token is not part of the text the reward scores
        assert stops in ([], [n - 1])
    assert hit >= 3, f"only {hit} of 24 completions emitted X: the test does not exercise the second stop id"


def test_without_the_second_stop_id_x_is_an_ordinary_token():
    # The control: the same seed and model run past X when the generation config does not list it.
    trainer, tok, x = _trainer("cached", second_stop=False)
    s = trainer._sample(["AB:"] * 24, with_ref=False)
    assert any("X" in text for text in s.completions)
