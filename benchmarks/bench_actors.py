"""Decoupled actors against the synchronous loop, whole process: ``ppokit train`` with ``--actors 0`` (the
synchronous loop), ``--actors 1`` and ``--actors 2``, side by side in one sitting.

For each task (CartPole-v1 with the cartpole preset, Hopper-v5 with the mujoco preset) and each setting, one
fresh ``python -m ppokit train`` process: its wall time from start to exit (interpreter, imports, worker start-up
and shutdown included), env steps per second over that wall time, and the mean training return of the last 10
updates (learning per env step: the runs take the same number of env steps). Ratios are against the synchronous
loop of the same task. Settings alternate within each repeat so that machine noise hits them alike.

    python benchmarks/bench_actors.py            # CartPole 50k steps, Hopper 50k steps, 1 repeat
    python benchmarks/bench_actors.py --smoke    # CartPole 10k, Hopper 4096 steps: checks the script runs

What limits it on a 2-core machine: K actors and the learner share 2 cores, so the speed-up is bounded by how
much of the synchronous loop is env stepping (the learner then trains while the envs step); CartPole's envs are
so cheap that the process start-up and the chunk transfer dominate.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")
TASKS = {  # name: (preset, full steps, smoke steps)
    "CartPole-v1": ("cartpole", 50_000, 10_000),
    "Hopper-v5": ("mujoco", 50_000, 4096),
}
SETTINGS = (0, 1, 2)


def run(preset: str, steps: int, actors: int, seed: int) -> dict:
    """One whole ``ppokit train`` process: wall seconds, env steps/s, mean return of the last 10 updates."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "ppokit", "train", "--preset", preset, "--total-timesteps", str(steps),
               "--seed", str(seed), "--actors", str(actors), "--run-dir", str(run_dir), "--quiet",
               "--no-tensorboard"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-1500:]}")
        with open(run_dir / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
    trained = int(float(rows[-1]["global_step"]))
    returns = [float(r["charts/episodic_return"] or "nan") for r in rows[-10:]]
    returns = [x for x in returns if not math.isnan(x)]
    return {"wall": wall, "sps": trained / wall, "return": sum(returns) / len(returns) if returns else float("nan"),
            "lag": float(rows[-1].get("diag/policy_lag") or 0.0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="short runs (checks the script runs; ratios are noisy)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    C.header("decoupled actors vs the synchronous loop (whole process)")
    for task in args.tasks.split(","):
        preset, full, smoke = TASKS[task]
        steps = smoke if args.smoke else full
        results: dict[int, list[dict]] = {k: [] for k in SETTINGS}
        for _ in range(args.repeats):
            for actors in SETTINGS:
                results[actors].append(run(preset, steps, actors, args.seed))
        base = C.median([r["wall"] for r in results[0]])
        rows = []
        for actors in SETTINGS:
            wall = C.median([r["wall"] for r in results[actors]])
            rows.append([f"--actors {actors}" if actors else "synchronous", f"{wall:.1f}",
                         f"{C.median([r['sps'] for r in results[actors]]):,.0f}", f"{base / wall:.2f}x",
                         f"{C.median([r['return'] for r in results[actors]]):.1f}",
                         f"{C.median([r['lag'] for r in results[actors]]):g}"])
        print(f"\n{task} ({preset} preset, {steps:,} env steps, median of {args.repeats})")
        print(C.table(["setting", "wall s", "env steps/s", "speed-up", "return (last 10)", "lag"], rows))
    print(f"\n{C.versions()}; load {C.load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
