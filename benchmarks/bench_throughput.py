"""ppokit throughput on gymnasium's batched (native) CartPole, and wall-clock seconds to solve CartPole.

Part 1: for 8 ... 4096 envs, the env's raw random-action throughput (``envs.step`` alone, actions drawn up front)
against ppokit's steps/s during the rollout (acting + stepping + buffer writes; rollout phases only) and over
the whole training loop (with the updates), as a fraction of the raw throughput; and the microseconds of acting
per rollout step (the trainer's inference timer).

Part 2: whole-process seconds of ``python -m ppokit.cli train --preset cartpole-fast --quiet`` (process start to
exit, measured around a subprocess) over 5 seeds; the preset stops once 16 deterministic evaluation episodes
average >= 475. Also the env steps used and the final evaluation return read from the run's metrics.csv.

    python benchmarks/bench_throughput.py [--smoke] [--device cpu] [--seeds 5]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import _common as C  # noqa: E402


def raw_env_sps(num_envs: int, steps: int) -> float:
    """Random-action env steps/s of native CartPole (the hardware limit the rollout is measured against)."""
    import gymnasium as gym

    envs = gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="vector_entry_point")
    envs.reset(seed=0)
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 2, size=(steps, num_envs))
    t0 = time.perf_counter()
    for a in actions:
        envs.step(a)
    dt = time.perf_counter() - t0
    envs.close()
    return steps * num_envs / dt


def ppokit_sps(num_envs: int, updates: int, device: str) -> tuple[float, float, float]:
    """(rollout-only steps/s, whole-loop steps/s, microseconds of acting per rollout step) of ppokit training on
    native CartPole with ``num_envs`` envs. Acting is the trainer's "inference" timer: the policy call, the buffer
    writes of its outputs and the actions' hand-over to the env."""
    from ppokit.config.ppo_config import load_preset
    from ppokit.training.trainer import Trainer

    cfg = load_preset("cartpole-fast")
    cfg.num_envs, cfg.num_steps = num_envs, 16
    cfg.total_timesteps = num_envs * 16 * updates
    cfg.eval_every, cfg.eval_threshold = 0, None  # pure throughput: no early stop
    cfg.device, cfg.torch_threads = device, 1
    with tempfile.TemporaryDirectory(prefix="ppokit-tp-") as tmp:
        tr = Trainer(cfg, run_dir=Path(tmp) / "run", console_enabled=False)
        run = tr.run()
    last = run.metrics[-1]
    rollout = last["perf/time_env"] + last["perf/time_inference"]
    act_us = last["perf/time_inference"] / (run.global_step / num_envs) * 1e6
    return run.global_step / rollout, last["perf/sps"], act_us


def solve_times(seeds: list[int], preset: str, extra: list[str]) -> list[dict]:
    """Whole-process wall seconds of the CLI training run per seed, with the steps used and the final eval return."""
    out = []
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="ppokit-solve-") as tmp:
            run_dir = Path(tmp) / "run"
            cmd = [sys.executable, "-m", "ppokit.cli", "train", "--preset", preset, "--quiet", "--seed", str(seed),
                   "--run-dir", str(run_dir), *extra]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
            with open(run_dir / "metrics.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            evals = [float(r["charts/eval_return"]) for r in rows if r.get("charts/eval_return") not in (None, "")]
            out.append({"seed": seed, "wall": wall, "steps": int(float(rows[-1]["global_step"])),
                        "eval": evals[-1] if evals else float("nan")})
        print(f"  seed {seed}: {wall:.2f} s, {out[-1]['steps']} steps, final eval {out[-1]['eval']:.1f}", flush=True)
    return out


def import_time() -> float:
    """Seconds for a fresh interpreter to import torch and gymnasium (a floor under any whole-process time)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, gymnasium"], check=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny budgets (checks the script runs; numbers meaningless)")
    p.add_argument("--device", default="cpu", help="torch device for ppokit (default cpu)")
    p.add_argument("--seeds", type=int, default=5, help="seeds for the time-to-solve part (default 5)")
    p.add_argument("--envs", default="8,64,256,1024,4096", help="comma-separated env counts")
    args = p.parse_args(argv)
    env_counts = [int(x) for x in args.envs.split(",")]
    updates, raw_steps = 30, 300
    if args.smoke:
        env_counts, updates, raw_steps, args.seeds = [8, 64], 2, 20, 1

    C.header("ppokit throughput on native CartPole-v1")
    rows, frac_1024 = [], None
    for n in env_counts:
        raw = raw_env_sps(n, raw_steps)
        roll, loop, act_us = ppokit_sps(n, updates, args.device)
        rows.append([n, raw, roll, roll / raw, f"{act_us:.0f}", loop, loop / raw])
        if n == 1024:
            frac_1024 = roll / raw
        print(f"  {n} envs: raw {raw:,.0f}/s, rollout {roll:,.0f}/s, acting {act_us:.0f} us/step, "
              f"loop {loop:,.0f}/s", flush=True)
    print()
    print("## Throughput vs number of envs (16 steps per rollout, 4 epochs x 4 minibatches, fused update)")
    print(C.table(["envs", "raw env steps/s", "ppokit rollout steps/s", "rollout / raw", "acting us/step",
                   "ppokit loop steps/s", "loop / raw"], rows))
    print()

    print("## Seconds to solve CartPole-v1 (whole process: python -m ppokit.cli train --preset cartpole-fast --quiet)")
    extra = ["--total-timesteps", "4096", "--eval-every", "1"] if args.smoke else []
    if args.device != "cpu":
        extra += ["--device", args.device]
    res = solve_times(list(range(1, args.seeds + 1)), "cartpole-fast", extra)
    print(C.table(["seed", "wall s (process)", "env steps", "final eval return"],
                  [[r["seed"], r["wall"], r["steps"], r["eval"]] for r in res]))
    imp = import_time()
    solved = sum(r["eval"] >= C.SOLVED_RETURN for r in res)
    print(f"import torch+gymnasium alone: {imp:.2f} s")
    print(f"load average after: {C.load()}")
    if frac_1024 is not None:
        print(f"RATIO rollout/raw env throughput at 1024 envs: {frac_1024:.1%} (target >= 25%)")
    print(f"RATIO median seconds to solve CartPole (whole process): {C.median([r['wall'] for r in res]):.2f} s, "
          f"solved {solved}/{len(res)} seeds (target <= 6 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
