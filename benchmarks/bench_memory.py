"""Peak resident memory of a CartPole training run: ppokit vs Stable-Baselines3, each in its own child process.

Each child trains PPO on CartPole-v1 with the RL-Zoo settings (ppokit's ``cartpole`` preset; the same for SB3)
and reports ``resource.getrusage(RUSAGE_SELF).ru_maxrss``. A child that only imports the library (torch and
gymnasium included) gives the floor that imports alone cost.

    python benchmarks/bench_memory.py [--smoke] [--device cpu] [--steps 20000]

``--lm``: the peak RSS of one GRPO and one PPO iteration on a tiny Llama with a 32k vocabulary (2 layers, 64 wide),
64 completions (8 prompts x 8) of 128 tokens, with ``micro_batch_size`` 4 against none (issue 21: 2.55 GB before
micro-batches; the goal is under 1 GB with micro-batches of 4). Each in its own child process.

    python benchmarks/bench_memory.py --lm [--smoke] [--iterations 1]
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


LM_VOCAB, LM_PROMPTS, LM_GROUP, LM_TOKENS = 32_000, 8, 8, 128


def lm_child(algo: str, micro: int | None, iterations: int, tokens: int) -> None:
    """Run in the child process: ``iterations`` of ``algo`` on the 32k-vocabulary tiny Llama; print the peak RSS."""
    import torch

    torch.set_num_threads(1)
    from ppokit.lm import GRPOTrainer, LMConfig, PPOTrainer
    from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer("ABCDEFGH:")
    model = build_tiny_llama(tok, hidden=64, layers=2, heads=2, mlp=128, vocab=LM_VOCAB, positions=256, seed=0)
    after_build = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = LMConfig(batch_prompts=LM_PROMPTS, group_size=LM_GROUP, max_new_tokens=tokens, num_minibatches=2,
                   update_epochs=1, learning_rate=1e-4, micro_batch_size=micro, seed=0)
    trainer = {"grpo": GRPOTrainer, "ppo": PPOTrainer}[algo]
    t = trainer(model, tok, reward=lambda p, c: [float(x.count("A")) for x in c], prompts=["AB:", "CD:", "EFG:"],
                config=cfg)
    history = t.train(iterations)
    length = history[-1]["lm/response_length"]
    scale = 1 if sys.platform == "darwin" else 1024
    print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20,
                      "model_built_mib": after_build * scale / 2**20, "response_length": length}))


def measure_lm(algo: str, micro: int | None, iterations: int, tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--child-lm", algo, "--micro", str(micro), "--iterations", str(iterations),
           "--tokens", str(tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def lm_main(args) -> int:
    import time

    import _common as C

    tokens = 16 if args.smoke else LM_TOKENS
    C.header(f"Peak RSS of LM iterations: tiny Llama, {LM_VOCAB:,} vocabulary, {LM_PROMPTS * LM_GROUP} completions "
             f"x {tokens} tokens, {args.iterations} iteration(s)")
    rows = []
    for algo in ("grpo", "ppo"):
        for micro in (None, 4):
            t0 = time.perf_counter()
            r = measure_lm(algo, micro, args.iterations, tokens)
            rows.append([algo, "none" if micro is None else micro, f"{r['response_length']:.0f}",
                         f"{r['model_built_mib']:.0f}", f"{r['peak_rss_mib']:.0f}", f"{time.perf_counter() - t0:.0f}"])
    print(C.table(["algo", "micro_batch_size", "mean length", "model built MiB", "peak MiB", "seconds"], rows))
    print(f"load average after: {C.load()}")
    return 0


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
    p.add_argument("--lm", action="store_true", help="measure the LM trainers (GRPO, PPO) with and without "
                                                     "micro-batches instead of CartPole")
    p.add_argument("--iterations", type=int, default=1, help="--lm: iterations per run (default 1)")
    p.add_argument("--child-lm", choices=["grpo", "ppo"], help=argparse.SUPPRESS)
    p.add_argument("--micro", default="None", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=LM_TOKENS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_lm:
        lm_child(args.child_lm, None if args.micro == "None" else int(args.micro), args.iterations, args.tokens)
        return 0
    if args.lm:
        return lm_main(args)
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
