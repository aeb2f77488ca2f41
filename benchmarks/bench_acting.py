"""Per-call cost of acting: the acting kernel (``kernels.acting.ActingKernel.act``, as the trainer acts) against
``ActorCritic.act`` (eager modules).

For CartPole's shapes (4 observations, 2 actions, 64x64 tanh actor and critic) and a continuous 1-D action head,
at 8 and 1024 envs: the best of several timed blocks of calls, in microseconds per call, under inference mode on
one thread. Then the recurrent acting kernel (``kernels.recurrent_acting``) against ``RecurrentActorCritic.act``
at the cartpole-novel preset's shapes (2 observations, LSTM of 64 units with a separate critic LSTM, ReLU heads
of 64, 2 actions). ``--fused-module PATH`` times another implementation side by side with the installed one: an
``acting.py`` (for instance the previous revision, ``git show HEAD:src/ppokit/acting.py > /tmp/acting_old.py``)
or a ``fused.py`` from before acting had its own module.

    python benchmarks/bench_acting.py [--smoke] [--envs 8,1024] [--fused-module PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import _common as C  # noqa: E402


def load_fused(path: str | None):
    """The installed ``ppokit.kernels.acting``, or the file at ``path`` loaded as a module of the ppokit package."""
    import ppokit.kernels.acting

    if path is None:
        return ppokit.kernels.acting
    spec = importlib.util.spec_from_file_location("ppokit._fused_compare", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def per_call_us(fns: dict, arg, calls: int, repeats: int) -> dict[str, float]:
    """Best mean microseconds per call of each function over ``repeats`` rounds of ``calls`` calls; the functions
    alternate within each round (so machine noise hits them alike), after a warm-up round."""
    best = {name: float("inf") for name in fns}
    for r in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(arg)
            if r:  # round 0 warms up (first-call allocations, lazy initialisation)
                best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return {name: t * 1e6 for name, t in best.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny budgets (checks the script runs; numbers meaningless)")
    p.add_argument("--envs", default="8,1024", help="comma-separated batch sizes (default 8,1024)")
    p.add_argument("--fused-module", default=None,
                   help="path of another acting.py to time next to the installed one")
    args = p.parse_args(argv)
    from ppokit.policies import ActorCritic

    torch.set_num_threads(1)
    sizes = [int(x) for x in args.envs.split(",")]
    repeats = 2 if args.smoke else 7
    impls = {"fused (installed)": load_fused(None)}
    if args.fused_module:
        impls[f"fused ({args.fused_module})"] = load_fused(args.fused_module)
    C.header("Per-call acting cost")
    rows = []
    for kind, dims in (("discrete", [2]), ("continuous", [1])):
        for B in sizes:
            calls = 20 if args.smoke else max(50, 200_000 // (B * 64))
            torch.manual_seed(0)
            policy = ActorCritic(4, kind, dims, [64, 64], "tanh")
            obs = torch.randn(B, 4)
            starts = np.zeros(B, dtype=bool)
            fns = {"ActorCritic.act": lambda x, act=policy.act, s=starts: act(x, None, s)}
            for name, mod in impls.items():
                clone = ActorCritic(4, kind, dims, [64, 64], "tanh")
                clone.load_state_dict(policy.state_dict())
                act = mod.ActingKernel(clone).act
                # An acting.py from before the stateful protocol takes (obs, deterministic, out); both are wrapped
                # alike, so the lambda's cost is the same in every column.
                stateful = "state" in inspect.signature(act).parameters
                fns[name] = (lambda x, act=act, s=starts: act(x, None, s)) if stateful else (lambda x, act=act: act(x))
            with torch.inference_mode():
                times = per_call_us(fns, obs, calls, repeats)
            for name, us in times.items():
                rows.append([kind, B, name, f"{us:.1f}"])
                print(f"  {kind} {B} envs, {name}: {us:.1f} us/call", flush=True)
    print()
    print("## Microseconds per acting call (tanh 64x64 actor + critic, 4 observations; best block)")
    print(C.table(["action head", "envs", "implementation", "us per call"], rows))
    recurrent = recurrent_rows(sizes, repeats, args.smoke)
    print()
    print("## Microseconds per acting call, recurrent (LSTM 64 + critic LSTM, ReLU heads of 64, 2 obs; best block)")
    print(C.table(["envs", "implementation", "us per call"], recurrent))
    print(f"load average after: {C.load()}")
    for B in sizes:
        us = {r[1]: float(r[2]) for r in recurrent if r[0] == B}
        print(f"RATIO acting recurrent {B} envs: kernel {us['kernel']:.1f} us/call, "
              f"RecurrentActorCritic.act {us['RecurrentActorCritic.act']:.1f} us/call")
    for kind in ("discrete", "continuous"):
        for B in sizes:
            us = {r[2]: float(r[3]) for r in rows if r[0] == kind and r[1] == B}
            print(f"RATIO acting {kind} {B} envs: fused {us['fused (installed)']:.1f} us/call, "
                  f"ActorCritic.act {us['ActorCritic.act']:.1f} us/call")
    return 0


def recurrent_rows(sizes: list[int], repeats: int, smoke: bool) -> list[list]:
    """``[envs, implementation, us per call]`` of the recurrent kernel and the eager ``act`` (states carried)."""
    from ppokit.kernels.recurrent_acting import RecurrentActingKernel
    from ppokit.policies import RecurrentActorCritic

    rows = []
    for B in sizes:
        calls = 20 if smoke else max(50, 100_000 // (B * 64))
        torch.manual_seed(0)
        policy = RecurrentActorCritic(2, "discrete", [2], [64], "relu", cell="lstm", recurrent_hidden=64,
                                      critic="separate")
        kernel = RecurrentActingKernel(policy)
        starts = np.zeros(B, dtype=bool)
        state = {"s": policy.initial_state(B)}

        def carried(act, s=starts, st=state):  # the state each call returns is the next call's, as in a rollout
            def call(x):
                st["s"] = act(x, st["s"], s)[3]
            return call

        fns = {"RecurrentActorCritic.act": carried(policy.act), "kernel": carried(kernel.act)}
        with torch.inference_mode():
            times = per_call_us(fns, torch.randn(B, 2), calls, repeats)
        for name, us in times.items():
            rows.append([B, name, f"{us:.1f}"])
            print(f"  recurrent {B} envs, {name}: {us:.1f} us/call", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
