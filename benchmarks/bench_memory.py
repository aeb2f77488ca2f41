"""Peak resident memory of a CartPole training run: ppokit vs Stable-Baselines3, each in its own child process.

Each child trains PPO on CartPole-v1 with the RL-Zoo settings (ppokit's ``cartpole`` preset; the same for SB3)
and reports ``resource.getrusage(RUSAGE_SELF).ru_maxrss``. A child that only imports the library (torch and
gymnasium included) gives the floor that imports alone cost.

    python benchmarks/bench_memory.py [--smoke] [--device cpu] [--steps 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def child(lib: str, steps: int, device: str, import_only: bool) -> None:
    """Run in the child process: train (or only import) and print the peak RSS as JSON."""
    import _common as C

    if lib == "sb3":
        import stable_baselines3  # noqa: F401
        from stable_baselines3 import PPO  # noqa: F401
    else:
        import ppokit.training.trainer  # noqa: F401
    if not import_only:
        import bench_vs_sb3 as B

        cfg, sb3_kwargs = B.zoo_configs(1, steps)
        if lib == "sb3":
            n_envs = sb3_kwargs.pop("n_envs")
            C.run_sb3("CartPole-v1", n_envs, 1, steps, device, **sb3_kwargs)
        else:
            C.run_ppokit(cfg, device)
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20}))


def measure(lib: str, steps: int, device: str, import_only: bool) -> float:
    """Peak RSS (MiB) of a child process running ``child``."""
    cmd = [sys.executable, __file__, "--child", lib, "--steps", str(steps), "--device", device]
    if import_only:
        cmd.append("--import-only")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_mib"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny budget (checks the script runs)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=20_000, help="env steps per training run (default 20000)")
    p.add_argument("--child", choices=["ppokit", "sb3"], help=argparse.SUPPRESS)
    p.add_argument("--import-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.steps, args.device, args.import_only)
        return 0
    if args.smoke:
        args.steps = 512

    import _common as C

    C.header("Peak RSS of a CartPole-v1 training run (RL-Zoo settings)")
    libs = ["ppokit"] + (["sb3"] if C.sb3_module() is not None else [])
    if "sb3" not in libs:
        print(C.SB3_MISSING)
    rows, peaks = [], {}
    for lib in libs:
        floor = measure(lib, args.steps, args.device, import_only=True)
        peak = measure(lib, args.steps, args.device, import_only=False)
        peaks[lib] = peak
        rows.append([lib, args.steps, floor, peak, peak - floor])
    print(C.table(["library", "env steps", "imports only MiB", "training peak MiB", "training - imports MiB"], rows))
    print(f"load average after: {C.load()}")
    print(f"ppokit side ran: peak {peaks['ppokit']:.0f} MiB")
    if "sb3" in peaks:
        print(f"RATIO peak RSS ppokit/SB3: {peaks['ppokit'] / peaks['sb3']:.2f}x")
    else:
        print("RATIO peak RSS ppokit/SB3: n/a (stable-baselines3 not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
