"""The small things a new user meets on the command line: a total_timesteps that is not a whole number of batches
is said, an unknown flag gets one line with the closest flag, a bad TOML file is refused once with all of its
mistakes, and the end-of-run summary prints a long run dir whole on an 80-column terminal."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

import ppokit
from ppokit.cli import main
from ppokit.config.ppo_config import ConfigError, PPOConfig, load_preset


def _last_step(run_dir) -> int:
    with open(run_dir / "metrics.csv") as fh:
        return int(float(list(csv.DictReader(fh))[-1]["global_step"]))


# ------------------------------------------------------------------ total_timesteps rounded to whole batches
def test_a_total_that_is_not_a_whole_number_of_batches_is_said(tmp_path, capsys):
    # gridworld preset: 8 envs x 32 steps = 256 a batch; 600 steps train two of them.
    run_dir = tmp_path / "run"
    assert main(["train", "--preset", "gridworld", "--total-timesteps", "600", "--no-tensorboard", "--quiet",
                 "--run-dir", str(run_dir)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert ("warning: total_timesteps=600 is not a multiple of the batch (num_envs * num_steps = 256): the run "
            "trains 512 steps (2 updates); 768 would be 3 updates") in err
    assert _last_step(run_dir) == 512  # what the line says is what the run did
    assert main(["train", "--preset", "gridworld", "--total-timesteps", "512", "--no-tensorboard", "--quiet",
                 "--run-dir", str(tmp_path / "whole")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_length_from_a_toml_file_is_said_and_a_presets_own_is_not(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('env_id = "ppokit/GridWorld-v0"\nnum_envs = 2\nnum_steps = 32\ntotal_timesteps = 100\n'
                    "tensorboard = false\n")
    assert main(["train", "--config", str(path), "--quiet", "--run-dir", str(tmp_path / "toml")]) == 0
    assert "the run trains 64 steps (1 update)" in " ".join(capsys.readouterr().err.split())
    # The gridworld preset's 20,000 steps are 78.1 batches of 256: its length, not the user's, so no line (the
    # env refuses the kwarg at once: only the error is printed, as tests/test_custom_envs.py's real CLI run needs).
    assert load_preset("gridworld").rounding_note() is not None
    assert main(["train", "--preset", "gridworld", "--env-kwargs", '{"no_such_arg": 1}', "--quiet",
                 "--run-dir", str(tmp_path / "preset")]) == 2
    err = capsys.readouterr().err
    assert "no_such_arg" in err and "warning" not in err


def test_the_plan_says_it_too(capsys):
    assert main(["plan", "--env", "CartPole-v1", "--budget", "1000", "--no-probe"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "total_timesteps=1,000 is not a multiple of the batch (num_envs * num_steps = 256)" in out
    assert "trains 768 steps (3 updates)" in out


def test_data_parallel_ranks_count_in_the_batch():
    cfg = PPOConfig(num_envs=4, num_steps=64, total_timesteps=1024)
    assert cfg.rounding_note() is None and cfg.warnings() == []
    assert cfg.rounding_note(world_size=3) == (
        "total_timesteps=1,024 is not a multiple of the batch (num_envs * num_steps * 3 ranks = 768): the run "
        "trains 768 steps (1 update); 1,536 would be 2 updates")
    assert cfg.rounding_note(world_size=5) is None  # below one batch: warnings() says that instead
    assert cfg.warnings(world_size=5)[0].startswith("total_timesteps=1,024 is less than one batch")


# ------------------------------------------------------------------ unknown flags
def test_an_underscore_flag_gets_one_line_with_the_kebab_case_flag(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ppokit", "train", "--learning_rate", "1e-3"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 2
    assert proc.stderr == ("error: unknown flag --learning_rate for ppokit train; did you mean --learning-rate?\n")
    assert proc.stdout == "" and not (tmp_path / "runs").exists()  # nothing trained


@pytest.mark.parametrize("argv,line", [
    (["train", "--learning_rate=1e-3"], "unknown flag --learning_rate for ppokit train; did you mean --learning-rate?"),
    (["train", "--num-env", "4", "--lerning-rate", "1"],
     "unknown flag --lerning-rate for ppokit train; did you mean --learning-rate?"),
    (["train", "--qqqqqqqqqq"], "unknown flag --qqqqqqqqqq for ppokit train; ppokit train --help lists the flags"),
    (["eval", "runs/x", "--episods", "3"], "unknown flag --episods for ppokit eval; did you mean --episodes?"),
    (["train", "stray"], "unexpected argument 'stray' for ppokit train (ppokit train --help lists its arguments)"),
])
def test_unknown_arguments_name_the_closest_flag(argv, line, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {line}\n"


# ------------------------------------------------------------------ a bad TOML file: every mistake at once
BAD_TOML = """\
num_envs = "12"
gama = 0.9
learning_rate = 2.0
clip_coef = -1.0
seed = 3
"""


def test_every_mistake_of_a_toml_file_in_one_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(BAD_TOML)
    with pytest.raises(ConfigError) as e:
        PPOConfig.from_toml(path)
    problems = e.value.problems
    assert set(problems) == {"num_envs", "gama", "learning_rate", "clip_coef"}
    assert "expected an integer" in problems["num_envs"] and "did you mean gamma" in problems["gama"]
    assert "must be <= 1" in problems["learning_rate"] and "must be > 0" in problems["clip_coef"]
    message = str(e.value)
    assert message.startswith(f"{path} has 4 invalid keys: ") and "\n" not in message
    for name in problems:
        assert f"config field '{name}': {problems[name]}" in message


def test_the_cli_reports_them_on_one_line(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(BAD_TOML)
    assert main(["train", "--config", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    for name in ("num_envs", "gama", "learning_rate", "clip_coef"):
        assert f"'{name}'" in err
    assert not (tmp_path / "run").exists()


def test_range_errors_of_a_well_typed_file_come_together_too(tmp_path, capsys):
    path = tmp_path / "ranges.toml"
    path.write_text("gamma = 1.5\nent_coef = -1.0\nnum_minibatches = 0\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert all(f"config field '{name}'" in err for name in ("gamma", "ent_coef", "num_minibatches")), err


def test_one_mistake_reads_as_before(tmp_path):
    path = tmp_path / "one.toml"
    path.write_text("gamma = 1.5\n")
    with pytest.raises(ConfigError) as e:
        PPOConfig.from_toml(path).validate()
    assert str(e.value) == "config field 'gamma': must be in (0, 1], got 1.5" and e.value.field == "gamma"


# ------------------------------------------------------------------ the summary at 80 columns
def test_the_summary_prints_a_long_run_dir_whole_at_80_columns(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")  # rich reads it when the console is made (piped: no terminal size)
    run_dir = tmp_path / "a_rather_long_directory_name_for_this_run" / "and_one_more_level" / "GridWorld__ppo__s1"
    config = PPOConfig(env_id="ppokit/GridWorld-v0", num_envs=2, num_steps=32, total_timesteps=64,
                       tensorboard=False)
    ppokit.train(config, run_dir=run_dir, console_enabled=True)
    out = capsys.readouterr().out
    panel = out[out.index("╭"):out.rindex("╯") + 1].splitlines()
    assert all(len(line) <= 80 for line in panel)
    assert "…" not in "".join(panel) and "..." not in "".join(panel)
    # Folded over lines inside the panel when it does not fit, every character there in order.
    rows = panel[1:next(i for i, line in enumerate(panel) if "env steps" in line)]
    cells = "".join(line.strip("│ ").removeprefix("run dir").strip() for line in rows)
    assert cells == str(run_dir), panel
