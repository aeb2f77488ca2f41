"""A tiny GPT-2 and a character tokenizer, built locally (no downloads), for tests, the demo and the benchmark.

The tokenizer is a real ``transformers.PreTrainedTokenizerFast`` (so everything that takes "a Hugging Face
tokenizer" takes it, TRL included): one token per character, no merges, plus ``<pad>``, ``<eos>`` and ``<unk>``.
The model is ``GPT2LMHeadModel`` from a ``GPT2Config`` with dropout off: PPO's first minibatch must see a ratio of
exactly 1, and dropout would make pi_theta and pi_old differ on the same parameters.

``save_tiny(model, tokenizer, DIR)`` writes a model directory that ``AutoModelForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)`` read, which is how TRL wants a model (it rebuilds pi_ref from the path).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import torch

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Printable ASCII without the control whitespace (\t\n\r\x0b\x0c); the space stays.
DEFAULT_ALPHABET = "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c")


@dataclass(frozen=True)
class TinySize:
    """Shape of a tiny GPT-2: layers, width, heads and the longest sequence (prompt + response) it can see."""

    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int = 64


SIZES = {
    # The demo/test model: ~0.1M parameters, 40 RL iterations in seconds on one CPU thread.
    "tiny": TinySize(n_layer=2, n_embd=64, n_head=4, n_positions=64),
    # ~10.7M parameters: generation dominates an iteration (the benchmark's second config).
    "10m": TinySize(n_layer=6, n_embd=384, n_head=6, n_positions=64),
}


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, *, pad_is_eos: bool = False,
                         padding_side: str = "left"):
    """A character-level ``PreTrainedTokenizerFast``: ids 0..2 are pad, eos, unk, then one id per character.

    ``pad_is_eos=True`` makes pad the same token as eos (GPT-2's own convention, and the case in which a response
    mask must still include the first EOS; trl PR#6357). Padding is on the left by default, as generation with a
    decoder-only model needs; a character outside ``alphabet`` encodes as ``<unk>``."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # keep order, drop repeats
    if not chars:
        raise ValueError("alphabet: empty; give at least one character")
    specials = [PAD, EOS, UNK]  # multi-character, so no single character of the alphabet can clash
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    # BPE with an empty merge list splits any text into single characters; Fuse joins them back without spaces.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=EOS if pad_is_eos else PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side=padding_side,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(tokenizer, size: str | TinySize = "tiny", *, seed: int = 0):
    """A freshly initialised ``GPT2LMHeadModel`` for ``tokenizer`` (vocab, pad and eos ids taken from it).

    ``size`` is a name in ``SIZES`` or a ``TinySize``. Initialisation is drawn from a private generator seeded with
    ``seed``, so building a model does not move the global RNG and one seed gives one model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"size: unknown {size!r}; choose one of {sorted(SIZES)}")
        size = SIZES[size]
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=size.n_positions,
        n_embd=size.n_embd,
        n_layer=size.n_layer,
        n_head=size.n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: ratio == 1 on the first minibatch
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _seeded_model(GPT2LMHeadModel, config, tokenizer, seed)


def _seeded_model(model_class, config, tokenizer, seed: int):
    """``model_class(config)`` initialised from ``seed`` without touching the global RNG stream, set to plain
    ancestral sampling with ``tokenizer``'s special tokens unless the caller asks otherwise (top-k/top-p make the
    sampled KL biased; trl#235)."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_class(config)
    finally:
        torch.random.set_rng_state(state)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = (tokenizer.pad_token_id, tokenizer.eos_token_id,
                                                            tokenizer.eos_token_id)
    gen.do_sample, gen.top_k, gen.top_p, gen.temperature = True, 0, 1.0, 1.0
    return model


def build_tiny_llama(tokenizer, *, hidden: int = 32, layers: int = 2, heads: int = 2, mlp: int = 64,
                     vocab: int | None = None, positions: int = 256, seed: int = 0):
    """A freshly initialised ``LlamaForCausalLM`` for ``tokenizer`` (untied LM head, no dropout), drawn from a
    private generator seeded with ``seed``. ``vocab`` pads the embedding to that many rows (a real model's
    vocabulary size, for memory measurements); the tokenizer's own size by default."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=max(len(tokenizer), vocab or 0), hidden_size=hidden, intermediate_size=mlp,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=positions, tie_word_embeddings=False,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return _seeded_model(LlamaForCausalLM, config, tokenizer, seed)


def build_tiny(alphabet: str = DEFAULT_ALPHABET, size: str | TinySize = "tiny", *, seed: int = 0,
               pad_is_eos: bool = False):
    """``(model, tokenizer)``: ``build_char_tokenizer(alphabet)`` and a ``build_tiny_model`` for it."""
    tokenizer = build_char_tokenizer(alphabet, pad_is_eos=pad_is_eos)
    return build_tiny_model(tokenizer, size, seed=seed), tokenizer


def save_tiny(model, tokenizer, directory: str | Path) -> Path:
    """Write ``model`` and ``tokenizer`` as a model directory (safetensors weights, config, tokenizer files)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_tiny(directory: str | Path):
    """``(model, tokenizer)`` read back from a model directory with the Auto classes (no code executed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    return AutoModelForCausalLM.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)


def count_parameters(model) -> int:
    """Number of distinct parameters (GPT-2's output layer shares the embedding matrix)."""
    return sum(p.numel() for p in model.parameters())
