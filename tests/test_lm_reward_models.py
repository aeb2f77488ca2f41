"""Reward models: a sequence-classification model with its own tokenizer scores the decoded completion,
re-tokenized for it (its chat template when it has one), right-padded, so a row's score does not depend on the
rows beside it; GPT-2- and Llama-style models built from a config (no downloads). Several rewards with weights,
each logged as its own metric, from the API and the CLI."""

from __future__ import annotations

import csv
import math
import sys
import textwrap

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

import torch  # noqa: E402

from ppokit.lm.tiny import build_char_tokenizer, build_tiny  # noqa: E402

POLICY_ALPHABET = "ABX:"


def _reward_model(kind: str, tok, seed: int = 0, vocab: int | None = None):
    from transformers import GPT2Config, GPT2ForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    n = len(tok) if vocab is None else vocab
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=n, n_positions=64, n_embd=32, n_layer=2, n_head=2, num_labels=1,
                         pad_token_id=tok.pad_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2ForSequenceClassification(cfg)
    else:
        cfg = LlamaConfig(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, num_labels=1,
                          pad_token_id=tok.pad_token_id)
        model = LlamaForSequenceClassification(cfg)
    with torch.no_grad():  # a score head that is not ~0, so scores differ visibly between texts
        model.score.weight.normal_(0, 1.0)
    return model.eval()


def _direct(model, tok, text: str) -> float:
    """The score of one text alone, no padding: the reference every batched score must equal."""
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        return float(model(input_ids=ids).logits.reshape(-1)[0])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_sequence_scores_the_same_alone_and_beside_a_longer_one(kind):
    from ppokit.lm.reward_models import RewardModel

    tok = build_char_tokenizer(POLICY_ALPHABET)
    rm = RewardModel(_reward_model(kind, tok), tok)
    alone = rm(["AB:"], ["XA"])
    batch = rm(["AB:", "XXXXXAB:"], ["XA", "ABABABABABX"])
    assert float(alone[0]) == pytest.approx(_direct(rm.model, tok, "AB:XA"), abs=1e-5)
    assert float(batch[0]) == pytest.approx(float(alone[0]), abs=1e-5)
    assert float(batch[1]) == pytest.approx(_direct(rm.model, tok, "XXXXXAB:ABABABABABX"), abs=1e-5)
    assert abs(float(batch[0]) - float(batch[1])) > 1e-3  # the model tells texts apart


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_trainers_rollout_scores_each_completion_as_if_it_were_alone(kind):
    # Prompts of different lengths, so the rollout's rows are left-padded by different amounts; the reward model
    # shares the policy's tokenizer and is given bare, as reward=model.
    from ppokit.lm import GRPOTrainer, LMConfig

    policy, tok = build_tiny(POLICY_ALPHABET, seed=0)
    rm = _reward_model(kind, tok, seed=1)
    cfg = LMConfig(batch_prompts=2, group_size=3, max_new_tokens=6, beta=0.0, seed=4)
    t = GRPOTrainer(policy, tok, reward=rm, prompts=["A:", "XXXXXXAB:"], config=cfg)
    s = t._sample(["A:"] * 3 + ["XXXXXXAB:"] * 3, with_ref=False)
    for p, c, got in zip(s.prompts, s.completions, s.raw_scores.tolist()):
        assert got == pytest.approx(_direct(rm, tok, p + c), abs=1e-5), (p, c)


def test_a_reward_model_with_another_vocabulary_scores_the_re_tokenized_text():
    from ppokit.lm import GRPOTrainer, LMConfig

    policy, tok = build_tiny(POLICY_ALPHABET, seed=0)
    rm_tok = build_char_tokenizer(":XBAzyw")  # other ids for every character, a larger vocabulary
    rm = _reward_model("llama", rm_tok, seed=2)
    t = GRPOTrainer(policy, tok, reward=(rm, rm_tok), prompts=["A:", "XB:"],
                    config=LMConfig(batch_prompts=2, group_size=2, max_new_tokens=5, beta=0.0, seed=1))
    s = t._sample(["A:", "A:", "XB:", "XB:"], with_ref=False)
    for p, c, got in zip(s.prompts, s.completions, s.raw_scores.tolist()):
        assert got == pytest.approx(_direct(rm, rm_tok, p + c), abs=1e-5)
    assert math.isfinite(t.step()["charts/score_mean"])


def test_a_tokenizer_that_does_not_fit_the_reward_models_embedding_is_one_clear_line():
    from ppokit.lm.rewards import make_reward

    tok = build_char_tokenizer("ABCDEFGHIJKLMNOP")
    rm = _reward_model("gpt2", tok, vocab=8)  # 8 embedding rows for a 19-token vocabulary
    with pytest.raises(ValueError, match=r"^reward model GPT2ForSequenceClassification: its tokenizer has 19 tokens "
                                         r"but the model's embedding has 8 rows") as info:
        make_reward(rm, tok)
    assert "\n" not in str(info.value)


def test_the_reward_models_chat_template_frames_the_prompt_and_the_completion():
    from ppokit.lm.reward_models import RewardModel

    tok = build_char_tokenizer(POLICY_ALPHABET)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}:{% endfor %}"
    rm = RewardModel(_reward_model("gpt2", tok), tok)
    assert rm.texts(["AB"], ["XA"]) == ["AB:XA:"]
    assert float(rm(["AB"], ["XA"])[0]) == pytest.approx(_direct(rm.model, tok, "AB:XA:"), abs=1e-5)


def test_weighted_rewards_log_each_term_under_its_own_name():
    from ppokit.core import schema as S
    from ppokit.lm import GRPOTrainer, LMConfig

    policy, tok = build_tiny(POLICY_ALPHABET, seed=0)
    rm = _reward_model("gpt2", tok, seed=3)

    def count_x(prompts, completions):
        return [c.count("X") for c in completions]

    t = GRPOTrainer(policy, tok, reward=[(count_x, 2.0), ((rm, tok), -0.5)], prompts=["A:"],
                    config=LMConfig(batch_prompts=1, group_size=4, max_new_tokens=5, beta=0.0))
    m = t.step()
    x, r = m[S.reward_term("count_x")], m[S.reward_term("GPT2ForSequenceClassification")]
    assert m[S.LM_REWARD_MEAN] == pytest.approx(2.0 * x - 0.5 * r, abs=1e-5)


# ---------------------------------------------------------------- the CLI
def test_the_cli_trains_against_a_reward_model_directory_and_a_function_with_weights(tmp_path, monkeypatch):
    from ppokit.cli import main
    from ppokit.lm.tiny import save_tiny

    policy, tok = build_tiny(POLICY_ALPHABET, seed=0)
    save_tiny(policy, tok, tmp_path / "policy")
    rm_tok = build_char_tokenizer("AXB:q")
    rm = _reward_model("llama", rm_tok, seed=5)
    rm.save_pretrained(tmp_path / "rm")
    rm_tok.save_pretrained(tmp_path / "rm")
    (tmp_path / "myrew.py").write_text(textwrap.dedent("""
        def count_a(prompts, completions):
            return [c.count("A") for c in completions]
    """))
    (tmp_path / "p.txt").write_text("A:\nXB:\n")
    monkeypatch.chdir(tmp_path)
    try:
        rc = main(["lm", "grpo", "--model", "policy", "--reward", "myrew:count_a", "--reward-model", "rm",
                   "--reward-weights", "1,0.25", "--prompts", "p.txt", "--run-dir", "run", "--iterations", "1",
                   "--batch-prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--num-minibatches", "1",
                   "--update-epochs", "1", "--no-console", "--no-tensorboard"])
    finally:
        sys.modules.pop("myrew", None)
    assert rc == 0
    row = next(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    a, r = float(row["lm/reward/count_a"]), float(row["lm/reward/rm"])
    assert float(row["lm/reward_mean"]) == pytest.approx(a + 0.25 * r, abs=1e-4)


def test_the_cli_refuses_a_weight_count_that_does_not_match_the_rewards_in_one_line(tmp_path, monkeypatch, capsys):
    from ppokit.cli import main
    from ppokit.lm.tiny import save_tiny

    save_tiny(*build_tiny(POLICY_ALPHABET, seed=0), tmp_path / "policy")
    (tmp_path / "myrew2.py").write_text("def f(prompts, completions):\n    return [0.0] * len(completions)\n")
    (tmp_path / "p.txt").write_text("A:\n")
    monkeypatch.chdir(tmp_path)
    try:
        rc = main(["lm", "grpo", "--model", "policy", "--reward", "myrew2:f", "--reward", "myrew2:f",
                   "--reward-weights", "1", "--prompts", "p.txt", "--run-dir", "run"])
    finally:
        sys.modules.pop("myrew2", None)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--reward-weights 1: 1 weights for 2 rewards" in err[0]


def test_a_run_against_a_reward_model_alone_resumes_without_naming_a_function(tmp_path, monkeypatch, capsys):
    from ppokit.cli import main
    from ppokit.lm.tiny import save_tiny

    policy, tok = build_tiny(POLICY_ALPHABET, seed=0)
    save_tiny(policy, tok, tmp_path / "policy")
    rm = _reward_model("gpt2", tok, seed=6)
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    (tmp_path / "p.txt").write_text("A:\nXB:\n")
    monkeypatch.chdir(tmp_path)
    budget = ["--batch-prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--num-minibatches", "1",
              "--update-epochs", "1", "--no-console", "--no-tensorboard"]
    assert main(["lm", "grpo", "--model", "policy", "--reward-model", "rm", "--prompts", "p.txt", "--run-dir", "run",
                 "--iterations", "1", *budget]) == 0
    assert main(["lm", "grpo", "--resume", "run", "--iterations", "2"]) == 0
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert len(rows) == 2 and all(math.isfinite(float(r["lm/reward_mean"])) for r in rows)
    capsys.readouterr()
    assert main(["lm", "grpo", "--model", "policy", "--reward-model", "nowhere", "--prompts", "p.txt",
                 "--run-dir", "run2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --reward-model ") and "nowhere: not a model directory" in err[0]
