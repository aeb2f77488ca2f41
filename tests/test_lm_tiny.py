"""The tiny GPT-2 and character tokenizer (ppokit.lm.tiny): a real HF tokenizer/model pair, no downloads."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

import torch  # noqa: E402

from ppokit.lm.tiny import (  # noqa: E402
    SIZES,
    build_char_tokenizer,
    build_tiny,
    build_tiny_model,
    count_parameters,
    load_tiny,
    save_tiny,
)


def test_one_token_per_character_and_decode_round_trips():
    tok = build_char_tokenizer("abcX:")
    ids = tok("X:abca").input_ids
    assert len(ids) == 6  # no merges, no BOS added
    assert ids[0] == tok.convert_tokens_to_ids("X") and ids[2] == ids[5]
    assert tok.decode(ids) == "X:abca"  # Fuse decoder: no spaces between characters
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "X:abca"
    assert tok("z").input_ids == [tok.unk_token_id]
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)


def test_left_padding_and_pad_is_eos_option():
    tok = build_char_tokenizer("ab")
    batch = tok(["ab", "a"], padding=True, return_tensors="pt")
    assert batch.attention_mask.tolist() == [[1, 1], [0, 1]]
    assert batch.input_ids[1, 0].item() == tok.pad_token_id
    same = build_char_tokenizer("ab", pad_is_eos=True)
    assert same.pad_token_id == same.eos_token_id == 1


def test_bad_alphabet_is_refused_by_name():
    with pytest.raises(ValueError, match="alphabet"):
        build_char_tokenizer("")
    with pytest.raises(ValueError, match="size"):
        build_tiny_model(build_char_tokenizer("ab"), "huge")


def test_model_is_seeded_leaves_global_rng_alone_and_has_no_dropout():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    m1, tok = build_tiny("abX:", seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    m2, _ = build_tiny("abX:", seed=7)
    m3, _ = build_tiny("abX:", seed=8)
    p1, p2, p3 = (next(m.parameters()) for m in (m1, m2, m3))
    assert torch.equal(p1, p2) and not torch.equal(p1, p3)
    ids = torch.tensor([tok("X:abab").input_ids])
    m1.train()
    train_logits = m1(ids).logits
    m1.eval()
    assert torch.equal(train_logits, m1(ids).logits)  # no dropout: train and eval forward agree exactly
    assert m1.config.eos_token_id == tok.eos_token_id and m1.config.pad_token_id == tok.pad_token_id
    gen = m1.generation_config
    assert gen.do_sample and gen.top_k == 0 and gen.top_p == 1.0


def test_save_load_round_trip_reads_back_the_same_model(tmp_path):
    model, tok = build_tiny(seed=3)
    save_tiny(model, tok, tmp_path / "m")
    loaded, tok2 = load_tiny(tmp_path / "m")
    assert tok2("X: hello").input_ids == tok("X: hello").input_ids
    assert (tok2.pad_token_id, tok2.eos_token_id, tok2.padding_side) == (0, 1, "left")
    ids = torch.tensor([tok("X: hello").input_ids])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, loaded.eval()(ids).logits)


def test_sizes():
    tok = build_char_tokenizer()
    assert 50_000 < count_parameters(build_tiny_model(tok, "tiny")) < 200_000
    assert SIZES["10m"].n_embd == 384  # ~10.7M parameters with this vocabulary (built in the benchmark)
