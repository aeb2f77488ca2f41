"""TRL's data conventions, the SFT and reward-model trainers, and the completions a run shows, on real tiny
Hugging Face models (``ppokit.lm.tiny``; nothing downloaded): datasets built in memory and on disk, a chat
template set on the tokenizer, extra columns reaching the reward, completion-only SFT loss checked against an
independent forward, a reward model that separates a toy preference set, completions.jsonl trimmed on resume."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

from ppokit.cli import main  # noqa: E402
from ppokit.lm import DPOTrainer, GRPOTrainer, LMConfig, RewardModelTrainer, SFTTrainer  # noqa: E402
from ppokit.lm.tiny import build_tiny, save_tiny  # noqa: E402

TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")
QUIET = {"console": False, "tensorboard": False}


def tiny(alphabet="ab:<>|"):
    model, tok = build_tiny(alphabet, seed=0)
    tok.chat_template = TEMPLATE
    return model, tok


def grpo_config(**kw):
    return LMConfig(**{"batch_prompts": 2, "group_size": 2, "max_new_tokens": 3, "num_minibatches": 1,
                       "update_epochs": 1, **QUIET, **kw})


def test_conversational_prompts_and_extra_columns_reach_the_reward():
    datasets = pytest.importorskip("datasets", reason="needs pip install -e '.[data]'")
    seen = []

    def reward(prompts, completions, answer, **kw):
        seen.append((list(prompts), list(answer), sorted(kw)))
        return [float(c.count("a")) for c in completions]

    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "ab"}], "answer": "x"},
                                     {"prompt": [{"role": "user", "content": "ba"}], "answer": "y"}])
    model, tok = tiny()
    trainer = GRPOTrainer(model, tok, reward=reward, prompts=datasets.DatasetDict({"train": ds}),
                          config=grpo_config())
    trainer.train(1)
    prompts, answers, rest = seen[0]
    # The chat template with the generation prompt; each completion's own row's answer, group by group.
    assert sorted(set(prompts)) == ["<u>ab<a>", "<u>ba<a>"]
    assert answers == [{"<u>ab<a>": "x", "<u>ba<a>": "y"}[p] for p in prompts]
    assert "completion_ids" in rest


def test_prompts_from_a_save_to_disk_directory_and_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets", reason="needs pip install -e '.[data]'")
    datasets.Dataset.from_list([{"prompt": "ab:", "k": 1}, {"prompt": "ba:", "k": 2}]).save_to_disk(tmp_path / "d")
    seen = []

    def reward(prompts, completions, k):
        seen.append(dict(zip(prompts, k)))
        return [0.0] * len(completions)

    model, tok = tiny()
    GRPOTrainer(model, tok, reward=reward, prompts=str(tmp_path / "d"), config=grpo_config()).train(1)
    assert seen[0] == {"ab:": 1, "ba:": 2}
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "ab:", "k": 3}\n{"prompt": "ba:", "k": 4}\n')
    GRPOTrainer(model, tok, reward=reward, prompts=str(jl), config=grpo_config()).train(1)
    assert seen[1] == {"ab:": 3, "ba:": 4}


@pytest.mark.parametrize("rows, words", [
    ([{"prompt": "a:", "k": 1}, {"prompt": "b:"}], "row 1 column k"),
    ([{"prompt": [{"role": "user"}]}], "row 0 column prompt: message 0"),
    ([{"question": "a:"}], 'row 0: has no "prompt" column'),
    ([{"prompt": "a:", "eos": 1}], "row 0 column eos"),
])
def test_bad_prompt_rows_are_named(rows, words):
    model, tok = tiny()
    with pytest.raises(ValueError, match=words):
        GRPOTrainer(model, tok, reward=lambda p, c: [0.0] * len(c), prompts=rows, config=grpo_config())


def test_conversational_prompt_without_a_chat_template_is_one_line():
    model, tok = build_tiny("ab:", seed=0)
    with pytest.raises(ValueError, match="row 0 column prompt: is conversational .* no chat_template"):
        GRPOTrainer(model, tok, reward=lambda p, c: [0.0] * len(c),
                    prompts=[{"prompt": [{"role": "user", "content": "a"}]}], config=grpo_config())


def test_dpo_pairs_conversational_and_as_a_dataset():
    datasets = pytest.importorskip("datasets", reason="needs pip install -e '.[data]'")
    model, tok = tiny()
    rows = [{"prompt": [{"role": "user", "content": "ab"}], "chosen": [{"role": "assistant", "content": "aa"}],
             "rejected": [{"role": "assistant", "content": "bb"}]}]
    trainer = DPOTrainer(model, tok, pairs=datasets.Dataset.from_list(rows), config=LMConfig(batch_prompts=1, **QUIET))
    # The prompt rendered for generation; the responses are what the template adds after it.
    assert trainer.pairs == [("<u>ab<a>", "aa", "bb")]


def test_sft_weighs_prompt_tokens_zero_and_raises_the_completion_likelihood():
    model, tok = build_tiny("ab:", seed=0)
    data = [{"prompt": "ab:", "completion": "bbb"}, {"prompt": "ba:", "completion": "aaa"}]
    trainer = SFTTrainer(model, tok, data, config=LMConfig(batch_prompts=2, learning_rate=3e-3, **QUIET))
    example = [("ab:", "bbb")]
    # An independent forward: the mean NLL of the completion tokens and EOS only, from the model's logits.
    ids = tok("ab:bbb")["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        targets = torch.tensor(ids[1:])
        token_nll = -logp[torch.arange(len(targets)), targets]
        n_prompt = len(tok("ab:")["input_ids"])
        want = float(token_nll[n_prompt - 1:].mean())  # the targets from the first completion token on
        assert float(trainer.loss(example)) == pytest.approx(want, rel=1e-4)
        assert float(token_nll.mean()) != pytest.approx(want, rel=1e-3)  # prompt tokens would change it
    before = want
    history = trainer.train(25)
    with torch.no_grad():
        after = float(trainer.loss(example))
    assert after < 0.5 * before
    assert history[-1]["sft/nll"] < history[0]["sft/nll"]


def test_sft_messages_rows():
    model, tok = tiny()
    rows = [{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}]
    trainer = SFTTrainer(model, tok, rows, config=LMConfig(batch_prompts=1, **QUIET))
    assert trainer.rows == [("<u>ab<a>", "ba")]


def separable_pairs(n=40):
    import random

    rng = random.Random(0)
    pairs = []
    for i in range(n):
        prompt = "".join(rng.choice("ab") for _ in range(3)) + ":"
        chosen, rejected = ("aaaa", "bbbb") if i % 2 else ("aaab", "bbba")
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs


def test_reward_model_separates_held_out_pairs_and_saves_a_sequence_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tok = build_tiny("ab:", seed=0)
    trainer = RewardModelTrainer(model, tok, separable_pairs(),
                                 config=LMConfig(batch_prompts=8, learning_rate=3e-3, **QUIET),
                                 run_dir=tmp_path / "rm", eval_frac=0.25)
    assert len(trainer.eval_rows) == 10
    history = trainer.train(30)
    trainer.close()
    assert history[-1]["rm/eval_accuracy"] >= 0.9
    assert history[-1]["rm/loss"] < history[0]["rm/loss"]
    rm_dir = tmp_path / "rm" / "reward_model"
    loaded = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id is not None
    rtok = AutoTokenizer.from_pretrained(rm_dir)
    with torch.no_grad():
        good = loaded(**rtok(["ab:aaaa"], return_tensors="pt")).logits.item()
        bad = loaded(**rtok(["ab:bbbb"], return_tensors="pt")).logits.item()
    assert good > bad
    header = (tmp_path / "rm" / "metrics.csv").read_text().splitlines()[0]
    assert "rm/eval_accuracy" in header


def test_cli_sft_then_rm(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    save_tiny(*build_tiny("ab:", seed=0), tmp_path / "model")
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": "aa"}) + "\n"
                                                for p in ("a:", "b:")))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in separable_pairs(12)))
    flags = ["--no-console", "--no-tensorboard", "--iterations", "2", "--batch-prompts", "2"]
    assert main(["lm", "sft", "--model", "model", "--data", "sft.jsonl", "--run-dir", "s", *flags]) == 0
    assert "completion NLL" in capsys.readouterr().out
    assert main(["lm", "rm", "--model", "s/policy", "--pairs", "pairs.jsonl", "--run-dir", "r", *flags]) == 0
    assert "held-out pair accuracy" in capsys.readouterr().out
    assert (tmp_path / "r" / "reward_model" / "config.json").is_file()
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "a:", "chosen": 3, "rejected": "b"}) + "\n")
    assert main(["lm", "rm", "--model", "model", "--pairs", "bad.jsonl", "--run-dir", "b", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pairs bad.jsonl line 1 column chosen" in err[0]


def test_completions_jsonl_rows_and_trim_on_resume(tmp_path):
    def reward(prompts, completions):
        return [float(c.count("a")) for c in completions]

    cfg = grpo_config(save_every=2)
    model, tok = build_tiny("ab:", seed=0)
    run = tmp_path / "run"
    trainer = GRPOTrainer(model, tok, reward=reward, prompts=["a:", "b:"], config=cfg, run_dir=run)
    trainer.train(3)
    trainer.close()
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert {r["iteration"] for r in rows} == {1, 2, 3}
    assert set(rows[0]) == {"iteration", "prompt", "completion", "reward"}
    # Special tokens kept: a completion that stopped shows its EOS.
    assert any(r["completion"].endswith(tok.eos_token) or len(r["completion"]) == 3 for r in rows)
    assert rows[0]["reward"] == reward([""], [rows[0]["completion"].replace(tok.eos_token, "")])[0]
    # A second run saved at iteration 2 and was killed after logging iteration 3: the resume drops that row and
    # logs iteration 3 again, as the unbroken run did.
    fresh, tok2 = build_tiny("ab:", seed=0)
    run2 = tmp_path / "run2"
    m2, t2 = build_tiny("ab:", seed=0)
    t = GRPOTrainer(m2, t2, reward=reward, prompts=["a:", "b:"], config=grpo_config(save_every=2), run_dir=run2)
    t.train(2)
    t.close()
    with open(run2 / "completions.jsonl", "a") as f:
        f.write(json.dumps({"iteration": 3, "prompt": "x", "completion": "stale", "reward": 0.0}) + "\n")
    r = GRPOTrainer.resume(run2, fresh, tok2, reward=reward, prompts=["a:", "b:"])
    r.train(1)
    r.close()
    rows2 = [json.loads(line) for line in (run2 / "completions.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in rows2].count(3) == len([x for x in rows if x["iteration"] == 3])
    assert all(x["completion"] != "stale" for x in rows2)
    assert rows2 == rows  # the resumed run's rows are the unbroken run's
    from ppokit.analysis.report import build_report

    page = build_report(run2)
    assert 'id="completions"' in page and f"<code>{rows[-1]['prompt']}</code>" in page


def test_doctor_too_short_threshold_is_the_schemas():
    from ppokit.analysis import diagnosis
    from ppokit.core import schema as S

    assert diagnosis.MIN_UPDATES_TO_JUDGE == S.MIN_UPDATES_TO_JUDGE


def test_completions_jsonl_has_one_field_per_reward_function(tmp_path):
    def count_a(prompts, completions):
        return [float(c.count("a")) for c in completions]

    def length(prompts, completions):
        return [float(len(c)) for c in completions]

    model, tok = build_tiny("ab:", seed=0)
    trainer = GRPOTrainer(model, tok, reward=[(count_a, 2.0), (length, 0.5)], prompts=["a:", "b:"],
                          config=grpo_config(), run_dir=tmp_path / "run")
    trainer.train(1)
    trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["reward"] == pytest.approx(2.0 * r["count_a"] + 0.5 * r["length"])


@pytest.mark.parametrize("kind", ["sft", "rm"])
def test_sft_and_rm_resume_as_if_unbroken(tmp_path, kind):
    def build(run_dir):
        model, tok = build_tiny("ab:", seed=0)
        cfg = LMConfig(batch_prompts=4, learning_rate=3e-3, save_every=2, **QUIET)
        if kind == "sft":
            rows = [{"prompt": p, "completion": "ab"} for p in ("a:", "b:", "ab:")]
            return SFTTrainer(model, tok, rows, config=cfg, run_dir=run_dir), (model, tok, {"data": rows})
        return (RewardModelTrainer(model, tok, separable_pairs(12), config=cfg, run_dir=run_dir),
                (model, tok, {"pairs": separable_pairs(12)}))

    whole, _ = build(tmp_path / "whole")
    want = whole.train(4)
    whole.close()
    part, _ = build(tmp_path / "part")
    part.train(2)
    part.close()
    _, (model, tok, data) = build(None)
    cls = SFTTrainer if kind == "sft" else RewardModelTrainer
    resumed = cls.resume(tmp_path / "part", model, tok, **data)
    got = resumed.train(2)
    resumed.close()
    key = "sft/nll" if kind == "sft" else "rm/loss"
    assert [m[key] for m in got] == [m[key] for m in want[2:]]
    for (n, a), (_, b) in zip(whole.policy.state_dict().items(), resumed.policy.state_dict().items()):
        assert torch.equal(a, b), n
