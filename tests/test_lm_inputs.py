"""LM input checked before any work, each refused in ONE line naming what is wrong: reward outputs (a dict, a string,
a wrong length, a NaN, a nested list: the function's qualified name and what it returned), a reward that raises,
prompts and ``max_new_tokens`` beyond the model's context (the limit named), a model dir without tokenizer files,
and a batch too large for the machine's memory (refused at once)."""

from __future__ import annotations

import copy
import textwrap
import time

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

from ppokit.cli import main  # noqa: E402
from ppokit.config.ppo_config import ConfigError  # noqa: E402
from ppokit.lm import DPOTrainer, GRPOTrainer, LMConfig, PPOTrainer  # noqa: E402
from ppokit.lm.checks import PromptError, check_tokenizer  # noqa: E402
from ppokit.lm.rewards import RewardError, make_reward  # noqa: E402
from ppokit.lm.tiny import build_tiny, save_tiny  # noqa: E402

BUDGET = ["--iterations", "2", "--batch-prompts", "2", "--group-size", "2", "--max-new-tokens", "4",
          "--num-minibatches", "1", "--update-epochs", "1", "--no-console", "--no-tensorboard"]
BAD_REWARDS = textwrap.dedent("""
    def short(prompts, completions, **info):
        return [1.0] * (len(completions) - 1)

    def as_dict(prompts, completions, **info):
        return {i: 1.0 for i in range(len(completions))}

    def as_string(prompts, completions, **info):
        return "1" * len(completions)

    def nan(prompts, completions, **info):
        return [float("nan")] * len(completions)

    def nested(prompts, completions, **info):
        return [[1.0] for _ in completions]

    def boom(prompts, completions, **info):
        raise ZeroDivisionError("no score for an empty answer")

    def good(prompts, completions, **info):
        return [c.count("a") / 4 for c in completions]
""")
INFO = {"completion_ids": [[3], [4, 5]], "eos": [True, False]}


@pytest.fixture(scope="module")
def base():
    return build_tiny("ab:", seed=0)


@pytest.fixture(scope="module")
def model_dir(base, tmp_path_factory):
    return save_tiny(*base, tmp_path_factory.mktemp("lm_inputs") / "model")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "badrewards.py").write_text(BAD_REWARDS)
    (tmp_path / "p.txt").write_text("a:\nb:\n")
    (tmp_path / "long.txt").write_text("a:\n" + "ab" * 40 + "\n")  # 80 characters: 80 tokens > 64 positions
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    import sys

    sys.modules.pop("badrewards", None)


def _one_line(capsys, rc, code, *needles):
    out = capsys.readouterr()
    assert rc == code, out
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.err
    assert "Traceback" not in out.err + out.out
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _grpo(model, reward="badrewards:good", prompts="p.txt", *extra):
    return ["lm", "grpo", "--model", str(model), "--reward", reward, "--prompts", prompts, "--run-dir", "run",
            *BUDGET, *extra]


# ---------------------------------------------------------------- reward outputs
def _returning(value):
    def fixed(prompts, completions):
        return value

    return fixed


@pytest.mark.parametrize("value, needle", [
    ({0: 1.0, 1: 2.0}, "got dict of length 2"),  # would train on its keys
    ("11", "got str of length 2"),  # would train on its characters
    ([1.0], "returned 1 values for 2 completions (list of length 1)"),
    ([1.0, float("nan")], "non-finite value (nan) for completion 1"),
    ([[1.0], [2.0]], "whose element 0 is list of length 1"),
    (torch.ones(2, 1), "got Tensor of shape (2, 1)"),
    (np.ones((2, 2)), "got ndarray of shape (2, 2)"),
    ([True, False], "whose element 0 is bool"),
    (None, "got NoneType"),
])
def test_a_reward_output_that_is_not_one_finite_number_per_completion_is_refused(value, needle):
    with pytest.raises(RewardError) as info:
        make_reward(_returning(value))(["p", "p"], ["a", "b"], INFO)
    message = str(info.value)
    assert needle in message and "\n" not in message
    assert "reward test_lm_inputs._returning.<locals>.fixed" in message  # the qualified name


@pytest.mark.parametrize("value", [[1, 2], (1.0, 2.0), [np.float32(1), 2], torch.tensor([1.0, 2.0]),
                                   np.array([1, 2]), [torch.tensor(1.0), torch.tensor(2.0)]])
def test_lists_tuples_and_1d_arrays_of_numbers_are_scores(value):
    assert make_reward(_returning(value))(["p", "p"], ["a", "b"], INFO).tolist() == [1.0, 2.0]


@pytest.mark.parametrize("name, needle", [
    ("short", "reward badrewards.short returned 3 values for 4 completions"),
    ("as_dict", "reward badrewards.as_dict must return a list or 1-D array of 4 finite numbers"),
    ("as_string", "got str of length 4"),
    ("nan", "reward badrewards.nan returned a non-finite value (nan)"),
    ("nested", "whose element 0 is list of length 1"),
    ("boom", "reward badrewards.boom raised ZeroDivisionError: no score for an empty answer"),
])
def test_the_cli_names_the_reward_and_what_it_returned_and_leaves_a_reusable_run_dir(workdir, model_dir, capsys,
                                                                                      name, needle):
    _one_line(capsys, main(_grpo(model_dir, f"badrewards:{name}")), 1, needle,
              "no iteration had finished, so there is no checkpoint")
    assert not any((workdir / "run").iterdir())  # nothing half-written: the same --run-dir works once fixed
    assert main(_grpo(model_dir, "badrewards:good")) == 0


# ---------------------------------------------------------------- the model's context
def test_max_new_tokens_beyond_the_models_positions_is_refused_with_the_limit(workdir, model_dir, capsys, base):
    _one_line(capsys, main(_grpo(model_dir, "badrewards:good", "p.txt", "--max-new-tokens", "100000")), 2,
              "max_new_tokens", "100,000", "64 positions", "config.max_position_embeddings", "at most 63")
    _one_line(capsys, main(_grpo(model_dir, "badrewards:good", "p.txt", "--max-new-tokens", "63")), 2,
              "max_new_tokens", "the longest prompt (prompts[", "2 tokens", "at most 62")
    with pytest.raises(ConfigError, match="max_new_tokens.*64 positions"):
        GRPOTrainer(copy.deepcopy(base[0]), base[1], reward=_returning([0.0] * 4), prompts=["a:"],
                    config=LMConfig(max_new_tokens=100_000, batch_prompts=2, group_size=2))


def test_a_prompt_longer_than_the_context_is_refused_before_any_work(workdir, model_dir, capsys, base):
    _one_line(capsys, main(_grpo(model_dir, "badrewards:good", "long.txt")), 2,
              "--prompts long.txt", "prompts[1] is 80 tokens", "64 positions", "at most 60")
    assert not (workdir / "run").exists()
    with pytest.raises(PromptError, match=r"prompts\[0\] is 80 tokens"):
        PPOTrainer(copy.deepcopy(base[0]), base[1], reward=_returning([0.0] * 4), prompts=["ab" * 40],
                   config=LMConfig(max_new_tokens=4, batch_prompts=2, group_size=2))
    with pytest.raises(PromptError, match=r"pairs\[1\]: prompt \+ response \+ EOS is 70 tokens.*64 positions"):
        DPOTrainer(copy.deepcopy(base[0]), base[1], pairs=[("a:", "a", "b"), ("a:", "a" * 67, "b")],
                   config=LMConfig(batch_prompts=2))


def test_a_one_shot_prompt_iterable_is_checked_batch_by_batch(base):
    def prompts():
        yield "a:"
        yield "a:"
        while True:
            yield "ab" * 40

    t = GRPOTrainer(copy.deepcopy(base[0]), base[1], reward=_returning([0.0] * 4), prompts=prompts(),
                    config=LMConfig(max_new_tokens=4, batch_prompts=2, group_size=2, num_minibatches=1))
    t.train(1)
    with pytest.raises(PromptError, match=r"this iteration's prompts\[0\] is 80 tokens.*64 positions"):
        t.train(1)


# ---------------------------------------------------------------- tokenizer
def test_a_model_dir_without_tokenizer_files_says_so(workdir, base, capsys):
    bare = workdir / "bare"
    base[0].save_pretrained(bare)  # config and weights, no tokenizer
    _one_line(capsys, main(_grpo(bare)), 2, f"--model {bare}: has no tokenizer files", "save_pretrained")
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="tokenizer: its vocabulary is empty"):
        check_tokenizer(AutoTokenizer.from_pretrained(bare, local_files_only=True))  # what transformers builds
    check_tokenizer(base[1])


# ---------------------------------------------------------------- memory
@pytest.mark.parametrize("algo", ["grpo", "dpo"])
def test_an_absurd_batch_is_refused_by_the_memory_check_at_once(workdir, model_dir, capsys, algo):
    (workdir / "pairs.jsonl").write_text('{"prompt": "a:", "chosen": "a", "rejected": "b"}\n')
    data = ["--pairs", "pairs.jsonl"] if algo == "dpo" else ["--reward", "badrewards:good", "--prompts", "p.txt"]
    started = time.monotonic()
    rc = main(["lm", algo, "--model", str(model_dir), *data, "--run-dir", "run", "--batch-prompts", "1e9",
               "--no-console", "--no-tensorboard"])
    line = _one_line(capsys, rc, 2, "batch_prompts", "1,000,000,000", "GiB available on cpu")
    assert time.monotonic() - started < 120  # refused, not run: the run took minutes before the check
    assert not (workdir / "run").exists()
    # DPO backpropagates through every pair at once: more minibatches would not help, so it does not suggest them.
    assert ("num_minibatches" in line) == (algo == "grpo"), line


def test_the_memory_estimate_counts_the_rows_one_backward_holds(base):
    from ppokit.lm import LMConfig
    from ppokit.lm.checks import estimate_lm_memory

    def update(num_minibatches, update_rows=None):
        return estimate_lm_memory(LMConfig(num_minibatches=num_minibatches), base[0], 64, 16, 16, extra_models=1,
                                  value_model=False, update_rows=update_rows)["update"]

    assert update(4) * 4 == update(1)  # a minibatch of the rollout: a quarter of the rows
    assert update(4, update_rows=64) == update(1)  # DPO: all rows in one backward, whatever num_minibatches says


def test_a_batch_that_fits_passes_the_memory_check(base):
    GRPOTrainer(copy.deepcopy(base[0]), base[1], reward=_returning([0.0] * 64), prompts=["a:"],
                config=LMConfig(batch_prompts=8, group_size=8))
