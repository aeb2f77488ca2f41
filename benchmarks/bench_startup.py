"""Whole-process start-up and teardown cost of ``ppokit train`` beyond ``import torch``.

Times, each in a fresh interpreter (subprocess, process start to exit), alternating between the two:

- ``python -c "import torch"``: the floor every torch program pays;
- ``python -m ppokit.cli train --env CartPole-v1 --total-timesteps 512 --num-envs 4 --num-steps 128 --quiet``:
  one update of CartPole, so nearly all of it is the other imports, env and logger set-up, the final checkpoint,
  the end-of-run figure and exit.

The overhead is median(train) - median(import torch); the target is < 1 s. One more run under
``python -X importtime`` attributes the import time of the train command to top-level packages (cumulative ms,
as the interpreter reports it; torch's share is the part the floor already pays).

    python benchmarks/bench_startup.py [--smoke] [--runs 7] [--train-args "--no-tensorboard"]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

TRAIN = ["-m", "ppokit.cli", "train", "--env", "CartPole-v1", "--total-timesteps", "512", "--num-envs", "4",
         "--num-steps", "128", "--quiet"]
TORCH = ["-c", "import torch"]
TARGET_S = 1.0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="0")
    return env


def timed(args: list[str], cwd: str) -> float:
    """Wall seconds of ``python *args`` from spawn to exit; raises if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): python {shlex.join(args)}\n{proc.stderr[-3000:]}")
    return wall


def import_breakdown(args: list[str], cwd: str) -> list[tuple[str, float]]:
    """Import ms of each top-level package (``torch``, ``matplotlib``, ...) under ``python -X importtime *args``,
    largest first: the cumulative time of every import of one of its modules from outside the package (so
    ``matplotlib.figure`` imported by ``ppokit.diagnostics.plots`` counts for matplotlib). Packages nest: numpy's time is also
    inside torch's."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True)
    entries = []  # (depth, root, cumulative ms); -X importtime prints a module after the modules it imported
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split(":", 1)[1].split("|")
        depth = (len(name) - len(name.lstrip())) // 2
        entries.append((depth, name.strip().split(".")[0], int(cumulative) / 1000.0))
    totals: dict[str, float] = {}
    for i, (depth, root, ms) in enumerate(entries):
        parent = next((r for d, r, _ in entries[i + 1:] if d < depth), None)
        if parent != root and not root.startswith("_"):
            totals[root] = totals.get(root, 0.0) + ms
    return sorted(totals.items(), key=lambda kv: -kv[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each command (default 7)")
    parser.add_argument("--smoke", action="store_true", help="one run of each: checks the script, not the numbers")
    parser.add_argument("--train-args", default="", help="extra flags for the train command, e.g. --no-tensorboard")
    args = parser.parse_args()
    runs = 1 if args.smoke else max(1, args.runs)
    train = TRAIN + shlex.split(args.train_args)

    print(f"# start-up and teardown beyond `import torch`\n\n{C.versions()}\nload before: {C.load()}\n")
    print(f"train command: python {shlex.join(train)}\n")
    rows, torch_s, train_s = [], [], []
    with tempfile.TemporaryDirectory(prefix="ppokit-startup-") as tmp:
        for i in range(runs):
            # Alternate the order so a drift in machine load hits both commands alike.
            order = ("torch", "train") if i % 2 == 0 else ("train", "torch")
            result = {}
            for which in order:
                if which == "torch":
                    result[which] = timed(TORCH, tmp)
                else:
                    run_dir = Path(tmp) / f"run{i}"
                    result[which] = timed(train + ["--run-dir", str(run_dir)], tmp)
                    missing = [f for f in ("checkpoint.pt", "metrics.csv", "config.toml") if not (run_dir / f).exists()]
                    if missing:
                        raise SystemExit(f"train run {i} did not write {missing}")
            torch_s.append(result["torch"])
            train_s.append(result["train"])
            rows.append([str(i + 1), f"{result['torch']:.2f}", f"{result['train']:.2f}",
                         f"{result['train'] - result['torch']:.2f}"])
        breakdown = import_breakdown(train + ["--run-dir", str(Path(tmp) / "importtime")], tmp)
    print(C.table(["run", "import torch s", "ppokit train s", "difference s"], rows))
    print("\nimports of the train command, top-level packages (cumulative ms under -X importtime, one run; nested "
          "packages count in their parents too):\n")
    print(C.table(["package", "ms"], [[name, f"{ms:,.0f}"] for name, ms in breakdown[:12]]))
    overhead = statistics.median(train_s) - statistics.median(torch_s)
    print(f"\nload after: {C.load()}")
    print(f"median import torch {statistics.median(torch_s):.2f} s, median train {statistics.median(train_s):.2f} s "
          f"over {runs} run(s)")
    print(f"RATIO overhead beyond import torch (median train - median import torch): {overhead:.2f} s "
          f"(target < {TARGET_S:g} s: {'met' if overhead < TARGET_S else 'missed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
