"""Start-up stays light: ``import ppokit`` and ``ppokit --help`` load neither torch nor matplotlib, TensorBoard or
rich; a quiet training run loads TensorBoard only when it writes events and rich's progress bar never; the public
API is importable from the package lazily (``ppokit.resume`` included); the start-up benchmark runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ppokit

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "matplotlib", "tensorboard", "rich", "PIL")


def loaded_after(code: str, cwd: Path) -> list[str]:
    """Which of HEAVY (and rich.progress) a fresh interpreter has imported after running ``code``."""
    probe = code + textwrap.dedent(f"""
        import json, sys
        print(json.dumps(sorted(m for m in {HEAVY + ("rich.progress",)!r} if m in sys.modules)))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_ppokit_and_the_parser_load_no_heavy_package(tmp_path):
    assert loaded_after("import ppokit", tmp_path) == []
    assert loaded_after("from ppokit.cli import build_parser; build_parser().format_help()", tmp_path) == []


@pytest.mark.slow  # two training processes: ~5 s
def test_a_quiet_run_loads_tensorboard_only_to_write_events_and_never_the_progress_bar(tmp_path):
    train = ("from ppokit.cli import main; assert main(['train', '--env', 'CartPole-v1', '--total-timesteps', "
             "'256', '--num-envs', '2', '--num-steps', '128', '--quiet', '--run-dir', {run!r}{extra}]) == 0\n")
    without = loaded_after(train.format(run=str(tmp_path / "a"), extra=", '--no-tensorboard'"), tmp_path)
    assert "tensorboard" not in without and "rich.progress" not in without and "torch" in without
    with_tb = loaded_after(train.format(run=str(tmp_path / "b"), extra=""), tmp_path)
    assert "tensorboard" in with_tb and "rich.progress" not in with_tb


def test_the_public_api_resolves_lazily_from_the_package():
    from ppokit.training import trainer

    assert ppokit.resume is trainer.resume and ppokit.train is trainer.train
    assert {"resume", "train", "load", "evaluate", "PPOConfig", "Run"} <= set(ppokit.__all__)
    with pytest.raises(AttributeError, match="no attribute 'resumee'"):
        ppokit.resumee  # noqa: B018


@pytest.mark.slow
def test_bench_startup_smoke(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_startup.py"), "--smoke"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RATIO overhead beyond import torch" in proc.stdout and "| torch " in proc.stdout
