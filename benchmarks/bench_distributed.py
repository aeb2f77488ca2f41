"""Data-parallel scaling on this machine: steps/s of 1 rank vs 2 ranks (torchrun) vs 1 rank with twice the envs.

Each configuration trains CartPole-v1 (fused update, 128 steps per env per rollout, 4 epochs of 4 minibatches,
TensorBoard off) for the same number of env steps, as a subprocess timed from process start to exit:

* ``1 rank``: one process, ``--num-envs E``;
* ``2 ranks``: ``ppokit train --nproc 2 --num-envs E`` (each rank steps E envs; global batch 2x);
* ``1 rank, 2E envs``: one process, ``--num-envs 2E`` (the same global batch as 2 ranks).

It prints, per configuration and repeat, the whole-process steps/s (steps / wall, start-up included), the
training loop's steps/s (rank 0's last ``perf/sps``, all ranks' steps) and the mean training return of the last
10 updates (the learning curve per env step should not change with the split), then the ratios to ``1 rank``.
The order of the configurations alternates between repeats; the load average is printed before and after.

    python benchmarks/bench_distributed.py [--steps 200000] [--envs 8] [--repeats 2] [--smoke]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

CONFIGS = {"1 rank": (1, 1), "2 ranks": (2, 1), "1 rank, 2E envs": (1, 2)}  # name -> (ranks, env multiplier)


def run_once(name: str, steps: int, envs: int, seed: int, workdir: Path) -> dict[str, float]:
    """Train one configuration in a subprocess; its whole-process and loop steps/s and final return."""
    ranks, mult = CONFIGS[name]
    run_dir = workdir / f"{name.replace(' ', '_').replace(',', '')}_s{seed}"
    cmd = [sys.executable, "-m", "ppokit", "train", "--env", "CartPole-v1", "--num-envs", str(envs * mult),
           "--num-steps", "128", "--num-minibatches", "4", "--update-epochs", "4", "--total-timesteps", str(steps),
           "--seed", str(seed), "--quiet", "--no-tensorboard", "--log-every", "1000000", "--run-dir", str(run_dir)]
    if ranks > 1:
        cmd[4:4] = ["--nproc", str(ranks)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    done = int(float(rows[-1]["global_step"]))
    # An update in which no episode ended logs an empty (NaN) return.
    returns = [float(r["charts/episodic_return"]) for r in rows[-10:] if r["charts/episodic_return"] not in ("", "nan")]
    return {"process_sps": done / wall, "loop_sps": float(rows[-1]["perf/sps"]), "wall": wall, "steps": done,
            "return": statistics.mean(returns) if returns else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200_000, help="env steps per run (all ranks together)")
    parser.add_argument("--envs", type=int, default=8, help="envs per rank (E)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a few seconds per run, to check the script")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeats = 4096, 1
    print(f"load average before: {C.load()}")
    print(C.versions())
    print(f"CartPole-v1, {args.steps:,} env steps per run, E = {args.envs} envs per rank, 128 steps per rollout")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = list(CONFIGS) if rep % 2 == 0 else list(reversed(CONFIGS))
            for name in order:
                r = run_once(name, args.steps, args.envs, seed=1 + rep, workdir=Path(tmp))
                results[name].append(r)
                print(f"  repeat {rep + 1} {name:>16}: {r['process_sps']:8,.0f} steps/s whole process "
                      f"({r['wall']:5.1f} s), {r['loop_sps']:8,.0f} steps/s loop, return {r['return']:6.1f}")
    print(f"load average after: {C.load()}")
    print("\n| configuration | whole process steps/s | loop steps/s | vs 1 rank (process / loop) | final return |")
    print("|---|---|---|---|---|")
    base = {k: statistics.median(r[k] for r in results["1 rank"]) for k in ("process_sps", "loop_sps")}
    for name, rs in results.items():
        p, loop = (statistics.median(r[k] for r in rs) for k in ("process_sps", "loop_sps"))
        ret = statistics.mean(r["return"] for r in rs)
        print(f"| {name} | {p:,.0f} | {loop:,.0f} | {p / base['process_sps']:.2f}x / {loop / base['loop_sps']:.2f}x "
              f"| {ret:.1f} |")


if __name__ == "__main__":
    main()
