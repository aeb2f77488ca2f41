"""``ppokit lm``: training a user's saved model directory with a reward imported from the cwd, and one clear line
(exit code 2, no traceback) for every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

from ppokit.cli import main  # noqa: E402

TINY_BUDGET = ["--iterations", "2", "--batch-prompts", "2", "--group-size", "2", "--max-new-tokens", "4",
               "--num-minibatches", "1", "--update-epochs", "1", "--no-console", "--no-tensorboard"]
REWARD_MODULE = textwrap.dedent("""
    def count_a(prompts, completions, **info):
        return [c.count("a") / 4 for c in completions]

    NOT_CALLABLE = 3
""")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from ppokit.lm.tiny import build_tiny, save_tiny

    return save_tiny(*build_tiny("ab:", seed=0), tmp_path_factory.mktemp("lm_cli") / "model")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A cwd holding the user's reward module, a prompts file and a pairs file."""
    (tmp_path / "myreward.py").write_text(REWARD_MODULE)
    (tmp_path / "boom.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a:"}\n{"prompt": "b:"}\n')
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"prompt": "a:", "chosen": "aa", "rejected": "bb"}) + "\n"
                                                  for _ in range(4)))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("myreward", None)


def _one_error_line(capsys, rc: int, *needles: str) -> str:
    out = capsys.readouterr()
    assert rc == 2, out
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.err
    assert "Traceback" not in out.err + out.out
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _grpo(model, reward="myreward:count_a", prompts="p.jsonl", *extra) -> list[str]:
    return ["lm", "grpo", "--model", str(model), "--reward", reward, "--prompts", prompts, *TINY_BUDGET, *extra]


# ---------------------------------------------------------------- bad input: one line, exit 2
def test_bad_model_dir(workdir, model_dir, capsys):
    _one_error_line(capsys, main(_grpo(workdir / "nope")), "--model", "no such directory")
    (workdir / "empty").mkdir()
    _one_error_line(capsys, main(_grpo(workdir / "empty")), "--model", "no config.json")
    broken = workdir / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    _one_error_line(capsys, main(_grpo(broken)), "--model", "has no tokenizer files")
    (broken / "tokenizer_config.json").write_text("{}")
    _one_error_line(capsys, main(_grpo(broken)), "--model", "cannot be loaded")


@pytest.mark.parametrize("spec, needle", [
    ("myreward", "expected MODULE:FUNCTION"),
    ("myreward.py:count_a", "name the module, not the file: myreward:count_a"),
    ("nosuchmod:f", "no module 'nosuchmod'"),
    ("myreward:missing", "has no attribute 'missing'"),
    ("myreward:NOT_CALLABLE", "not a function"),
    ("boom:f", "importing boom failed: RuntimeError: no GPU here"),
])
def test_bad_reward(workdir, model_dir, capsys, spec, needle):
    _one_error_line(capsys, main(_grpo(model_dir, spec)), "--reward", needle)


def test_bad_prompts(workdir, model_dir, capsys):
    _one_error_line(capsys, main(_grpo(model_dir, prompts="missing.jsonl")), "--prompts", "no such file")
    (workdir / "empty.jsonl").write_text("\n")
    _one_error_line(capsys, main(_grpo(model_dir, prompts="empty.jsonl")), "--prompts", "no prompts")
    (workdir / "bad.jsonl").write_text('{"prompt": "a:"}\n{oops\n')
    _one_error_line(capsys, main(_grpo(model_dir, prompts="bad.jsonl")), "--prompts", "line 2")


def test_bad_pairs(workdir, model_dir, capsys):
    def dpo(path):
        return main(["lm", "dpo", "--model", str(model_dir), "--pairs", path, *TINY_BUDGET])

    _one_error_line(capsys, dpo("missing.jsonl"), "--pairs", "no such file")
    (workdir / "bad.jsonl").write_text('{"prompt": "a:", "chosen": "a"}\n')
    _one_error_line(capsys, dpo("bad.jsonl"), "--pairs", "line 1", "rejected")


def test_bad_config_values_name_the_field(workdir, model_dir, capsys):
    _one_error_line(capsys, main(_grpo(model_dir, "myreward:count_a", "p.jsonl", "--kl-coef", "abc")), "kl_coef")
    _one_error_line(capsys, main(_grpo(model_dir, "myreward:count_a", "p.jsonl", "--clip-coef", "0.5")),
                    "clip_coef", "unsafe")
    _one_error_line(capsys, main(_grpo(model_dir, "myreward:count_a", "p.jsonl", "--scale-rewards", "z")),
                    "scale_rewards")
    _one_error_line(capsys, main(_grpo(model_dir, "myreward:count_a", "p.jsonl", "--iterations", "0")),
                    "--iterations")
    for flag, value, field in [("--micro-batch-size", "0", "micro_batch_size"), ("--dtype", "fp8", "dtype"),
                               ("--lr-scheduler", "step", "lr_scheduler"), ("--warmup-steps", "-1", "warmup_steps")]:
        _one_error_line(capsys, main(_grpo(model_dir, "myreward:count_a", "p.jsonl", flag, value)), field)


def test_fsdp_refuses_fp16_and_offload_without_fsdp_in_one_line_and_runs_unsharded_in_one_process(workdir, model_dir,
                                                                                                 capsys):
    _one_error_line(capsys, main(_grpo(model_dir, "myreward:count_a", "p.jsonl", "--fsdp-offload")),
                    "fsdp_offload", "--fsdp")
    _one_error_line(capsys, main(_grpo(model_dir, "myreward:count_a", "p.jsonl", "--fsdp", "--dtype", "fp16")),
                    "fsdp", "bf16")
    assert main(_grpo(model_dir, "myreward:count_a", "p.jsonl", "--run-dir", "whole", "--fsdp")) == 0
    assert json.loads((workdir / "whole" / "lm_run.json").read_text())["config"]["fsdp"] is True


def test_grpo_trains_micro_batched_in_bf16_with_a_cosine_schedule(workdir, model_dir, capsys):
    assert main(_grpo(model_dir, "myreward:count_a", "p.jsonl", "--run-dir", "mixed", "--micro-batch-size", "1",
                      "--dtype", "bf16", "--lr-scheduler", "cosine", "--warmup-steps", "1")) == 0
    meta = json.loads((workdir / "mixed" / "lm_run.json").read_text())
    assert (meta["config"]["micro_batch_size"], meta["config"]["dtype"]) == (1, "bf16")
    header, *rows = (workdir / "mixed" / "metrics.csv").read_text().splitlines()
    lr = header.split(",").index("charts/learning_rate")
    assert [float(r.split(",")[lr]) for r in rows][0] == 0.0  # the warmup's first step


def test_lm_without_an_algo_prints_help_and_exit_2(capsys):
    assert main(["lm"]) == 2
    assert "ppo" in capsys.readouterr().out


def test_without_transformers_one_line_names_the_extra(tmp_path):
    # transformers made unimportable (None in sys.modules), as on a machine without the lm extra.
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from ppokit.cli import main\n"
            "sys.exit(main(['lm', 'grpo', '--model', 'm', '--reward', 'r:f', '--prompts', 'p.jsonl']))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: ppokit lm needs the language-model extra: "
                                                "pip install -e '.[lm]'"]


# ---------------------------------------------------------------- it trains
def test_grpo_trains_a_saved_model_and_saves_the_policy(workdir, model_dir, capsys):
    from transformers import AutoModelForCausalLM

    assert main(_grpo(model_dir, "myreward:count_a", "p.jsonl", "--run-dir", "run", "--seed", "3")) == 0
    out = capsys.readouterr().out
    assert "ppokit lm grpo: 2 iterations, score mean" in out
    rows = (workdir / "run" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3  # header + 2 iterations
    meta = json.loads((workdir / "run" / "lm_run.json").read_text())
    assert meta["algo"] == "grpo" and meta["config"]["seed"] == 3 and meta["config"]["group_size"] == 2
    AutoModelForCausalLM.from_pretrained(workdir / "run" / "policy")  # a model directory again
    assert (workdir / "run" / "trainer_state.pt").is_file()
    # A second run into the same directory would append its rows to the first one's metrics.csv: refused.
    assert main(_grpo(model_dir, "myreward:count_a", "p.jsonl", "--run-dir", "run")) == 2
    assert "already holds a run (metrics.csv, lm_run.json, trainer_state.pt)" in capsys.readouterr().err
    assert len((workdir / "run" / "metrics.csv").read_text().splitlines()) == 3


def test_ppo_dpo_and_lora_train(workdir, model_dir, capsys):
    pytest.importorskip("peft", reason="needs pip install -e '.[lora]'")
    assert main(["lm", "ppo", "--model", str(model_dir), "--reward", "myreward:count_a", "--prompts", "p.jsonl",
                 "--run-dir", "ppo", *TINY_BUDGET]) == 0
    assert main(["lm", "dpo", "--model", str(model_dir), "--pairs", "pairs.jsonl", "--run-dir", "dpo",
                 *TINY_BUDGET]) == 0
    assert "preference accuracy" in capsys.readouterr().out
    assert main(_grpo(model_dir, "myreward:count_a", "p.jsonl", "--run-dir", "lora", "--lora", "--lora-r", "2")) == 0
    assert (workdir / "lora" / "policy" / "adapter_config.json").is_file()  # peft saved the adapter only
    for run in ("ppo", "dpo", "lora"):
        assert len((workdir / run / "metrics.csv").read_text().splitlines()) == 3, run


@pytest.mark.slow  # a fresh interpreter: ~5 s
def test_reward_module_is_imported_from_the_cwd_without_python_m(workdir, model_dir):
    # `python -c` puts the cwd on sys.path as ''; removing it makes this the console script's situation, where the
    # user's module is found only because ppokit lm puts the cwd there itself.
    code = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
            "from ppokit.cli import main\n"
            f"sys.exit(main({_grpo(model_dir, 'myreward:count_a', 'p.jsonl', '--run-dir', 'sub')!r}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and Path(p).is_dir()))
    proc = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (workdir / "sub" / "policy" / "config.json").is_file()
