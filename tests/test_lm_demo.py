"""The CPU language-model demo (ppokit.lm.demo): the task's definitions by hand, then the whole demo learning.

The task: prompt ``X:``, responses of the letters A-G and X; reward count(X) / max(len, 8), malformed -1. The
integration test runs ``ppokit lm demo --json`` once (SFT 300 steps, PPO and GRPO 40 iterations, DPO 60 steps, one
thread, seed 1) and checks the issue's thresholds on what it wrote.
"""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

from ppokit.lm import demo  # noqa: E402


# ---------------------------------------------------------------- the task, by hand
@pytest.mark.parametrize("text, expected", [
    ("XXXXXXXX", 1.0),            # 8 X's: the best answer
    ("XXXX", 4 / 8),              # short: the length floor of 8 divides (no reward for short answers)
    ("XAXBXCXD", 4 / 8),
    ("X" * 12 + "AB", 12 / 14),   # longer than 8: divided by its own length
    ("ABCDEFGA", 0.0),            # well formed, no X
    ("X" * 15, 1.0),              # the longest well-formed response (15 letters + EOS = 16 new tokens)
    ("X" * 16, -1.0),             # 16 letters: cut at max_new_tokens without EOS, malformed
    ("", -1.0),                   # empty
    ("XX:XX", -1.0),              # a character that is not a response letter
    ("XX XX", -1.0),
    ("XX<pad>", -1.0),            # a decoded special token
])
def test_score_by_hand(text, expected):
    assert demo.score(text) == pytest.approx(expected, abs=1e-12)
    assert demo.is_well_formed(text) == (expected != -1.0)


def test_reward_functions_have_the_trainers_signature():
    assert demo.reward(["X:"] * 2, ["XXXXXXXX", "X:"], completion_ids=None) == [1.0, -1.0]
    assert demo.length_reward(["X:"], ["ABCD"]) == [4 / demo.MAX_NEW_TOKENS]


def test_sft_data_is_the_weak_prior():
    texts = demo.sft_responses(4000, random.Random(0))
    assert all(demo.is_well_formed(t) and demo.SFT_LENGTHS[0] <= len(t) <= demo.SFT_LENGTHS[1] for t in texts)
    letters = "".join(texts)
    assert abs(letters.count("X") / len(letters) - demo.P_TARGET) < 0.01  # 0.35 within ~4 standard errors
    # Every other letter is drawn uniformly: each ~0.65 / 7.
    assert all(abs(letters.count(c) / len(letters) - 0.65 / 7) < 0.01 for c in "ABCDEFG")


def test_sft_batch_masks_the_prompt_and_the_padding():
    from ppokit.lm.tiny import build_char_tokenizer

    tok = build_char_tokenizer(demo.ALPHABET)
    batch = demo.sft_batch(tok, ["XA", "XABC"])
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == labels.shape == mask.shape == (2, 7)  # "X:" + 4 letters + EOS
    # Row 0: X : X A <eos> <pad> <pad>; the loss sees X A <eos> only.
    assert labels[0].tolist() == [-100, -100, ids[0, 2].item(), ids[0, 3].item(), tok.eos_token_id, -100, -100]
    assert mask[0].tolist() == [1, 1, 1, 1, 1, 0, 0]
    assert (labels[1, :2] == -100).all() and (labels[1, 2:] != -100).all()
    assert tok.decode(ids[1, :6].tolist()) == "X:XABC"


def test_preference_pairs_choose_the_higher_score_and_drop_near_ties():
    texts = ["XXXXXXXX", "ABABABAB", "XXAAAAAA", "XXAAAAAB", "AAAAAAAA", "XXXXAAAA"]
    pairs = demo.preference_pairs(texts)
    assert pairs == [("X:", "XXXXXXXX", "ABABABAB"), ("X:", "XXXXAAAA", "AAAAAAAA")]  # the tie (0.25, 0.25) dropped


def test_sampling_does_not_move_the_global_rng_and_is_seeded():
    import torch

    from ppokit.lm.tiny import build_tiny

    model, tok = build_tiny(demo.ALPHABET, seed=0)
    state = torch.random.get_rng_state()
    a = demo.sample(model, tok, 8, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert demo.sample(model, tok, 8, seed=3) == a and demo.sample(model, tok, 8, seed=4) != a
    model.train()
    demo.sample(model, tok, 2, seed=3)
    assert model.training  # the caller's mode is restored


def test_a_second_demo_run_rewrites_its_run_dirs(tmp_path):
    tiny = demo.DemoSettings(sft_steps=3, iterations=2, dpo_samples=64, dpo_steps=2, eval_samples=8)
    for _ in range(2):
        r = demo.run_demo(seed=2, out_dir=tmp_path, quiet=True, settings=tiny)
    for stage, rows in (("ppo", 2), ("grpo", 2), ("dpo", 2)):
        assert len((tmp_path / stage / "metrics.csv").read_text().splitlines()) == rows + 1, stage
    assert r["ppo"]["iterations"] == 2 and (tmp_path / "lm_demo.png").is_file()


# ---------------------------------------------------------------- the whole demo (one run, several checks)
@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    from ppokit.cli import main

    out = tmp_path_factory.mktemp("lm_demo")
    assert main(["lm", "demo", "--seed", "1", "--json", str(out / "demo.json"), "--out", str(out / "runs"),
                 "--quiet"]) == 0
    return out, json.loads((out / "demo.json").read_text())


@pytest.mark.slow  # the whole demo: ~25 s on one thread (more on a loaded machine); CI runs it
def test_demo_json_has_the_issue_schema(demo_run):
    out, r = demo_run
    assert {"sft", "ppo", "grpo", "dpo"} <= set(r)
    for stage in ("ppo", "grpo"):
        assert {"reward_before", "reward_after", "seconds", "iterations", "score_curve"} <= set(r[stage])
        assert len(r[stage]["score_curve"]) == r[stage]["iterations"] == 40
    assert {"pref_acc_before", "pref_acc_after", "seconds"} <= set(r["dpo"])
    assert {"reward", "well_formed", "mean_length", "seconds"} <= set(r["sft"])
    assert (out / "runs" / "lm_demo.png").stat().st_size > 10_000


@pytest.mark.slow
def test_demo_sft_learns_the_format(demo_run):
    sft = demo_run[1]["sft"]
    assert sft["well_formed"] >= 0.95
    assert 0.25 <= sft["reward"] <= 0.5  # the weak prior: ~0.35, nothing learnt beyond it


@pytest.mark.slow
def test_demo_ppo_and_grpo_raise_the_reward_and_keep_the_format(demo_run):
    r = demo_run[1]
    assert r["ppo"]["reward_after"] >= 0.6 and r["ppo"]["reward_after"] >= r["sft"]["reward"] + 0.25
    assert r["grpo"]["reward_after"] >= 0.75
    for stage in ("ppo", "grpo", "dpo"):
        assert r[stage]["well_formed_after"] >= 0.95, stage
        assert r[stage]["mean_length_after"] >= 8, stage  # the length floor held: no short-answer hack


@pytest.mark.slow
def test_demo_dpo_raises_preference_accuracy(demo_run):
    d = demo_run[1]["dpo"]
    assert d["pref_acc_after"] > d["pref_acc_before"]
    assert d["pref_acc_after"] >= 0.9 and d["pairs_held_out"] >= 20


@pytest.mark.slow
def test_doctor_finds_the_demo_runs_healthy(demo_run):
    from ppokit.analysis.doctor import diagnose

    out, _ = demo_run
    for stage in ("ppo", "grpo", "dpo"):
        d = diagnose(out / "runs" / stage)
        assert d.healthy, (stage, d.to_text())


# ---------------------------------------------------------------- the TRL benchmark still runs (smoke)
@pytest.mark.slow  # a subprocess with TRL: ~15 s
@pytest.mark.parametrize("hide_trl", [False, True])
def test_bench_vs_trl_smoke(hide_trl):
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not hide_trl:
        pytest.importorskip("trl", reason="needs pip install -e '.[bench-lm]'")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PPOKIT_BENCH_HIDE_TRL="1" if hide_trl else "0")
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_vs_trl.py"), "--smoke", "--sizes", "tiny"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratio = [ln for ln in proc.stdout.splitlines() if ln.startswith("RATIO")]
    assert ratio and ("ppokit side only" in ratio[0]) == hide_trl, proc.stdout[-2000:]
