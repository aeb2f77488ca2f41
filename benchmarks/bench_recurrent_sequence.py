"""``RecurrentActorCritic.evaluate_sequence``'s replay of chunks: one padded core call over the stretches between
episode starts (``recurrent._segments``, what it uses) against stepping the core one step at a time with the
resets masked in (``recurrent._stepped``, sb3-contrib's way).

For L = 32..128 steps by M = 8..64 chunks (LSTM 64 units over 2 inputs, a separate critic core, heads of 64; an
episode start at random with probability 0.01, 0.05 and 0.2 per step): the median CPU time (``time.thread_time``,
so other jobs on the machine count less) of forward + backward of both heads' sum, one torch thread, and the
choice ``evaluate_sequence`` makes (``STEP_CALL_ROWS``).

    python benchmarks/bench_recurrent_sequence.py [--reps 7] [--cell lstm]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402,F401  (one torch thread)


def main() -> None:
    import torch

    from ppokit.policies.recurrent import STEP_CALL_ROWS, RecurrentActorCritic, _padded_rows, _segments, _stepped

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cell", default="lstm", choices=("lstm", "gru"))
    args = ap.parse_args()
    torch.manual_seed(0)
    policy = RecurrentActorCritic(2, "discrete", [2], [64], "relu", cell=args.cell, recurrent_hidden=64)
    print(f"{'p':>5} {'L':>4} {'M':>4} {'segments ms':>12} {'stepped ms':>11} {'speed-up':>9}  chosen")
    for p, L, M in [(p, L, M) for p in (0.01, 0.05, 0.2) for L in (32, 64, 128) for M in (8, 16, 32, 64)]:
            feats = torch.randn(L, M, 2)
            state0 = torch.randn(M, policy.state_size, 64)
            starts = torch.rand(L, M) < p
            times = {}
            for name, fn in (("segments", _segments), ("stepped", _stepped)):
                runs = []
                for _ in range(args.reps):
                    t0 = time.thread_time()
                    out_a, out_c = fn(policy, feats, state0, starts)
                    (policy.critic_head(out_c).sum() + policy.actor_head(out_a).sum()).backward()
                    runs.append(time.thread_time() - t0)
                times[name] = statistics.median(runs) * 1e3
            chosen = "segments" if _padded_rows(starts) <= L * (STEP_CALL_ROWS + M) else "stepped"
            print(f"{p:>5} {L:>4} {M:>4} {times['segments']:>12.2f} {times['stepped']:>11.2f} "
                  f"{times['stepped'] / times['segments']:>8.1f}x  {chosen}")


if __name__ == "__main__":
    main()
