"""Decoupled actors against the synchronous loop, whole process: ``ppokit train`` with ``--actors 0`` (the
synchronous loop), ``--actors 1`` and ``--actors 2``, side by side in one sitting.

For each task (CartPole-v1 with the cartpole preset, Hopper-v5 with the mujoco preset, Breakout with the atari
preset: 8 envs x 128 steps per actor, the Nature CNN) and each setting, one fresh ``python -m ppokit train`` process: its wall time from start to exit (interpreter, imports, worker start-up
and shutdown included), env steps per second over that wall time, and the mean training return of the last 10
updates (learning per env step: the runs take the same number of env steps). Ratios are against the synchronous
loop of the same task. Settings alternate within each repeat so that machine noise hits them alike.

    python benchmarks/bench_actors.py            # CartPole 50k steps, Hopper 50k, Breakout 20k, 1 repeat
    python benchmarks/bench_actors.py --smoke    # short runs: checks the script runs
    python benchmarks/bench_actors.py --curves --tasks Hopper-v5 --steps 300000 --seeds 1,2,3 --plot curves.png

``--curves``: learning per env step over whole runs (issue 20's "match the synchronous loop within noise"): the
mean training return in ten equal bins of env steps, per setting, averaged over the seeds, and the spread of the
seeds' final bins; ``--plot`` draws the curves (extra ``plot``: matplotlib).

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
    "Breakout": ("atari", 20_480, 2048),  # ALE/Breakout-v5 (extra atari); a CNN update is ~1 s of CPU here
}
BINS = 10
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
    curve = [(int(float(r["global_step"])), float(r["charts/episodic_return"] or "nan")) for r in rows]
    returns = [x for _, x in curve[-10:] if not math.isnan(x)]
    return {"wall": wall, "sps": trained / wall, "return": sum(returns) / len(returns) if returns else float("nan"),
            "lag": float(rows[-1].get("diag/policy_lag") or 0.0), "curve": curve, "steps": trained}


def binned(curve: list[tuple[int, float]], total: int) -> list[float]:
    """The mean training return of the updates that ended in each of ``BINS`` equal bins of env steps."""
    sums, counts = [0.0] * BINS, [0] * BINS
    for step, ret in curve:
        if not math.isnan(ret):
            b = min(BINS - 1, max(0, math.ceil(step * BINS / total) - 1))
            sums[b] += ret
            counts[b] += 1
    return [s / c if c else float("nan") for s, c in zip(sums, counts)]


def curves(task: str, preset: str, steps: int, seeds: list[int], plot: str | None) -> None:
    """Learning per env step of each setting over whole runs (see the module docstring)."""
    runs = {k: [] for k in SETTINGS}
    for seed in seeds:  # settings alternate within each seed, so that machine noise hits them alike
        for k in SETTINGS:
            runs[k].append(run(preset, steps, k, seed))
    means = {}
    for k, rs in runs.items():
        bins = [binned(r["curve"], steps) for r in rs]
        means[k] = [_mean([b[i] for b in bins]) for i in range(BINS)]
    names = {k: f"--actors {k}" if k else "synchronous" for k in SETTINGS}
    rows = [[f"{(i + 1) * steps // BINS:,}", *[f"{means[k][i]:.1f}" for k in SETTINGS]] for i in range(BINS)]
    finals = {k: [binned(r["curve"], steps)[-1] for r in runs[k]] for k in SETTINGS}
    rows.append(["last bin, per seed", *[" / ".join(f"{x:.0f}" for x in finals[k]) for k in SETTINGS]])
    rows.append(["wall s, per seed", *[" / ".join(f"{r['wall']:.0f}" for r in runs[k]) for k in SETTINGS]])
    print(f"\n{task} ({preset} preset, {steps:,} env steps, seeds {','.join(map(str, seeds))}): mean training "
          f"return by env step")
    print(C.table(["env steps up to", *[names[k] for k in SETTINGS]], rows))
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [(i + 1) * steps / BINS for i in range(BINS)]
        for k in SETTINGS:
            ax.plot(xs, means[k], marker="o", label=names[k])
        ax.set(xlabel="env steps", ylabel=f"mean training return ({len(seeds)} seeds)", title=f"{task}: {preset}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=100)
        print(f"wrote {plot}")


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="short runs (checks the script runs; ratios are noisy)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--curves", action="store_true", help="learning per env step over whole runs (no speed table)")
    p.add_argument("--steps", type=int, default=0, help="env steps per run (default: the task's)")
    p.add_argument("--seeds", default="1", help="--curves: comma-separated seeds")
    p.add_argument("--plot", default=None, help="--curves: write the curves to this PNG (one task)")
    args = p.parse_args(argv)
    C.header("decoupled actors vs the synchronous loop (whole process)")
    for task in args.tasks.split(","):
        if task not in TASKS:
            p.error(f"--tasks: {task!r} is not one of {', '.join(TASKS)}")
        preset, full, smoke = TASKS[task]
        steps = args.steps or (smoke if args.smoke else full)
        if args.curves:
            curves(task, preset, steps, [int(x) for x in args.seeds.split(",")], args.plot)
            continue
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
