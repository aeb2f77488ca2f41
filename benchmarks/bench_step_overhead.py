"""Per-step cost of a one-env ppokit rollout beyond the raw env, by rollout path.

For the ``mujoco`` preset (1 env, observation and reward normalization) on ``--env`` (default Hopper-v5): CPU time
per step (``time.thread_time``, so other jobs on the machine count less than in wall time) of one collector
rollout of 2048 steps, of the same vector env stepped with a fixed action, of its one sub-env (wrappers included)
stepped alone, and of acting on one row; the minimum over ``--reps`` repetitions. The paths: "host normalizers" is
the default (the one-env loop of ``one_env.py`` with the host normalizers); "general loop" switches the one-env
loop off (``Collector.one_env_path``), keeping the host normalizers; "torch normalizers" also switches those off
(``hostnorm``), so they run on one-row tensors as with several envs. All compute the same bits
(``tests/test_single_env_fastpath.py``, ``tests/test_hostnorm.py``). "beyond the env" is the rollout minus the sub-env's own step.

    python benchmarks/bench_step_overhead.py [--env Hopper-v5] [--reps 4] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402,F401  (one torch thread)


def measure(env_id: str, reps: int, host_path: bool, one_env: bool = True) -> dict[str, float]:
    import numpy as np
    import torch

    from ppokit.config.ppo_config import load_preset
    from ppokit.rollout import hostnorm
    from ppokit.rollout.collector import Collector
    from ppokit.training.trainer import Trainer

    applies = hostnorm.HostNormalizers.applies
    if not host_path:
        hostnorm.HostNormalizers.applies = staticmethod(lambda *a: False)
    Collector.one_env_path = one_env
    try:
        cfg = load_preset("mujoco")
        cfg.env_id, cfg.tensorboard = env_id, False
        with tempfile.TemporaryDirectory(prefix="ppokit-bench-") as tmp:
            trainer = Trainer(cfg, run_dir=Path(tmp) / "run", console_enabled=False)
            envs, steps = trainer.envs, cfg.num_steps
            action = envs.action_space.sample()
            obs = torch.zeros(1, trainer.obs_dim)
            starts = np.zeros(1, dtype=bool)
            inference = torch.inference_mode()
            best = {"rollout": 1e9, "env": 1e9, "sub": 1e9, "act": 1e9}
            sub, sub_action = envs.envs[0], action[0]
            for _ in range(reps):
                t0 = time.thread_time()
                trainer.collect_rollout()
                best["rollout"] = min(best["rollout"], (time.thread_time() - t0) / steps)
                t0 = time.thread_time()
                for _ in range(steps):
                    envs.step(action)
                best["env"] = min(best["env"], (time.thread_time() - t0) / steps)
                t0 = time.thread_time()
                for _ in range(steps):
                    _, _, terminated, truncated, _ = sub.step(sub_action)
                    if terminated or truncated:
                        sub.reset()
                best["sub"] = min(best["sub"], (time.thread_time() - t0) / steps)
                envs.reset()  # the vector env's own bookkeeping restarts from a reset sub-env
                t0 = time.thread_time()
                with inference:
                    for _ in range(steps):
                        trainer.collector.acting.act(obs, None, starts)
                best["act"] = min(best["act"], (time.thread_time() - t0) / steps)
            trainer.envs.close()
            trainer._claim.release()
    finally:
        hostnorm.HostNormalizers.applies = applies
        Collector.one_env_path = True
    return {k: v * 1e6 for k, v in best.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="Hopper-v5", help="a one-env MuJoCo (or any Box) task (default Hopper-v5)")
    p.add_argument("--reps", type=int, default=4, help="repetitions; the minimum is reported (default 4)")
    p.add_argument("--smoke", action="store_true", help="one repetition (checks the script runs)")
    args = p.parse_args(argv)
    if args.smoke:
        args.reps = 1
    C.header(f"one-env rollout step cost, {args.env}, mujoco preset")
    rows = []
    for name, host, one in (("host normalizers", True, True), ("general loop, host normalizers", True, False),
                            ("torch normalizers", False, False)):
        m = measure(args.env, args.reps, host, one)
        rows.append([name, m["rollout"], m["env"], m["sub"], m["act"], m["rollout"] - m["sub"]])
    print(C.table(["path", "rollout us/step", "vector env step us", "sub-env step us", "acting us (one row)",
                   "beyond the env us/step"], rows))
    print(f"load average after: {C.load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
