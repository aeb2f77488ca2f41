"""Write the golden runs that ``tests/test_bit_identity.py`` compares the working tree against.

Each case is a tiny fixed-seed training; what is kept of it is its ``metrics.csv`` without the timing columns
(``perf/*``, which differ on every run) and a summary of the final policy parameters (per tensor: shape, sum, L1
and L2 norms and a sum under fixed weights). The test compares them with a tolerance, not bit for bit: another CPU
of the same kind (AMD EPYC vs Intel Xeon, both AVX512) runs other float kernels and differs from the 7th digit on.

Regenerate ONLY when a change of what a run computes is intended (and say so in that commit)::

    python3 tests/golden/make_golden.py            # from the repository root, with this checkout's ppokit

To make the golden files from another checkout (e.g. the commit before a refactoring), point PYTHONPATH at its
``src`` and keep this script::

    git worktree add /tmp/golden_tree HEAD
    PYTHONPATH=/tmp/golden_tree/src python3 tests/golden/make_golden.py
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import sys
import tempfile
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent

# Shared by every case: tiny budgets, no TensorBoard, no console, annealing on (the default) so the per-update
# learning rate enters the arithmetic too.
_BASE = dict(num_envs=2, num_steps=32, num_minibatches=4, update_epochs=3, seed=3, tensorboard=False,
             log_every=1000, save_every=1000)

# name -> PPOConfig overrides. "fused" cases use the hand-derived update where it applies; "autograd" cases run
# --no-fused-update. ppo-kl and a2c are never fused, so they run once. The target_kl cases make the KL early stop
# fire (a minibatch is dropped unapplied mid-epoch), which pins where the loop stops.
CASES: dict[str, dict] = {
    "cartpole_ppo_fused": dict(env_id="CartPole-v1", fused_update=True),
    "cartpole_ppo_autograd": dict(env_id="CartPole-v1", fused_update=False),
    "cartpole_ppo_kl_stop_fused": dict(env_id="CartPole-v1", fused_update=True, target_kl=0.0005,
                                       learning_rate=3e-3),
    "cartpole_ppo_kl_stop_autograd": dict(env_id="CartPole-v1", fused_update=False, target_kl=0.0005,
                                          learning_rate=3e-3),
    "pendulum_ppo_fused": dict(env_id="Pendulum-v1", fused_update=True, normalize_obs=True, normalize_reward=True),
    "pendulum_ppo_autograd": dict(env_id="Pendulum-v1", fused_update=False, normalize_obs=True,
                                  normalize_reward=True),
    "gridworld_ppo_fused": dict(env_id="ppokit/GridWorld-v0", fused_update=True, clip_vloss=False),
    "gridworld_ppo_autograd": dict(env_id="ppokit/GridWorld-v0", fused_update=False, clip_vloss=False),
    "gridworld_ppo_kl": dict(env_id="ppokit/GridWorld-v0", algo="ppo-kl", fused_update=False),
    "gridworld_a2c": dict(env_id="ppokit/GridWorld-v0", algo="a2c", fused_update=False),
}

NUM_UPDATES = 5


def case_config(name: str):
    """The ``PPOConfig`` of case ``name`` (budget: ``NUM_UPDATES`` updates)."""
    from ppokit.config.ppo_config import PPOConfig

    kw = {**_BASE, **CASES[name]}
    kw["total_timesteps"] = NUM_UPDATES * kw["num_envs"] * kw["num_steps"]
    return PPOConfig(**kw)


def strip_timing(csv_text: str) -> str:
    """``metrics.csv`` without its ``perf/*`` columns, re-serialized (cells kept as written)."""
    rows = list(csv.reader(io.StringIO(csv_text)))
    keep = [i for i, col in enumerate(rows[0]) if not col.startswith("perf/")]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow([row[i] for i in keep])
    return out.getvalue()


def params_sha256(policy) -> str:
    """sha256 over the policy's state dict: each entry's name, dtype, shape and raw bytes, in order. Exact, so
    only for comparing two runs made in one process (on one CPU), never against a stored file."""
    h = hashlib.sha256()
    for key, t in policy.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def params_summary(policy) -> dict[str, dict]:
    """Per state-dict entry: shape, and in float64 its sum, L1 and L2 norms and ``wsum``, the sum under fixed
    weights in [-1, 1] (integer arithmetic, so the same on every CPU), which a permutation or a change of a few
    entries moves even where the plain sum stays."""
    import numpy as np

    out = {}
    for key, t in policy.state_dict().items():
        x = t.detach().cpu().double().numpy().ravel()
        weights = ((np.arange(x.size, dtype=np.int64) * 2654435761) % 2001 - 1000) / 1000.0
        out[key] = {"shape": list(t.shape), "sum": float(x.sum()), "l1": float(np.abs(x).sum()),
                    "l2": float(np.sqrt((x * x).sum())), "wsum": float((x * weights).sum())}
    return out


def run_case(name: str, workdir: Path) -> tuple[str, dict[str, dict], str]:
    """Train case ``name`` in ``workdir``; return (metrics.csv without perf/*, ``params_summary`` and sha256 of
    the final parameters)."""
    from ppokit.training.trainer import train

    run = train(case_config(name), run_dir=workdir / name, console_enabled=False)
    return (strip_timing((run.run_dir / "metrics.csv").read_text()), params_summary(run.policy),
            params_sha256(run.policy))


def main(argv: list[str]) -> int:
    import torch

    torch.set_num_threads(1)
    import ppokit

    names = argv or list(CASES)
    print(f"ppokit from {Path(ppokit.__file__).parent}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            table, summary, digest = run_case(name, Path(tmp))
            (GOLDEN_DIR / f"{name}.csv").write_text(table)
            lines = [f" {json.dumps(key)}: {json.dumps(stats)}" for key, stats in summary.items()]
            (GOLDEN_DIR / f"{name}.params.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")
            print(f"{name}: {len(table.splitlines()) - 1} rows, params {digest[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
