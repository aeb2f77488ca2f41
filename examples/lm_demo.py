"""The language-model demo as a script: a tiny GPT-2, supervised-fine-tuned on a weak prior, then PPO, GRPO and DPO.

    pip install -e ".[lm]"
    python examples/lm_demo.py --seed 1 --json demo.json

Same as ``ppokit lm demo``. Everything is local (a character tokenizer built here, no download) and runs on one CPU
thread in well under a minute. Read ``ppokit.lm.demo`` for the task: prompt ``X:``, reward count(X) / max(len, 8),
malformed responses -1.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--out", metavar="DIR", default="runs/lm_demo", help="plot and run directories")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from ppokit.lm.demo import run_demo

    results = run_demo(seed=args.seed, json_path=args.json, out_dir=args.out)
    for stage in ("ppo", "grpo"):
        r = results[stage]
        print(f"{stage}: eval reward {r['reward_before']:.2f} -> {r['reward_after']:.2f}")
    d = results["dpo"]
    print(f"dpo: preference accuracy {d['pref_acc_before']:.2f} -> {d['pref_acc_after']:.2f}")


if __name__ == "__main__":
    main()
