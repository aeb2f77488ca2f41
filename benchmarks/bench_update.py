"""One PPO update, fused (hand-derived backward + FlatAdam) against eager autograd: the same work, interleaved.

CartPole's shapes: a 64x64 tanh actor-critic, 256 samples in one minibatch, 10 epochs (RL-Zoo's CartPole update
has 20). The best of ``--repeats`` interleaved rounds per path, in milliseconds per update, and their ratio.

    python benchmarks/bench_update.py [--repeats 7] [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds per path (default 7)")
    p.add_argument("--smoke", action="store_true", help="two rounds (checks the script runs; numbers meaningless)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from ppokit.core.algos import UpdateSettings
    from ppokit.kernels.flat_adam import FlatAdam
    from ppokit.kernels.fused_step import fused_ppo_update
    from ppokit.policies import ActorCritic
    from ppokit.update.autograd import Batch, ppo_update

    torch.manual_seed(0)
    pol = ActorCritic(4, "discrete", [2], [64, 64], "tanh")
    obs, act = torch.randn(256, 4), torch.randint(0, 2, (256,))
    with torch.no_grad():
        logp, _, v = pol.evaluate(obs, act)
    batch = Batch(obs, act, logp, v, torch.randn(256), v + torch.randn(256))
    s = UpdateSettings("ppo", 10, 1, 0.2, False, True, 0.0, 0.5, 0.5, None)
    ref = copy.deepcopy(pol)
    paths = {"autograd": (ppo_update, ref, torch.optim.Adam(ref.parameters(), lr=1e-4, eps=1e-5)),
             "fused": (fused_ppo_update, pol, FlatAdam(pol, lr=1e-4, eps=1e-5))}
    best = dict.fromkeys(paths, float("inf"))
    for r in range(2 if args.smoke else args.repeats + 1):
        for name, (fn, policy, opt) in paths.items():
            t0 = time.perf_counter()
            fn(policy, opt, batch, s)
            if r:  # round 0 warms up
                best[name] = min(best[name], time.perf_counter() - t0)
    C.header("One PPO update (64x64 tanh, 256 samples, 10 epochs)")
    for name, t in best.items():
        print(f"  {name}: {t * 1e3:.2f} ms per update")
    print(f"load average after: {C.load()}")
    print(f"RATIO update fused/autograd: {best['fused'] / best['autograd']:.2f}x the time "
          f"({best['autograd'] / best['fused']:.2f}x faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
