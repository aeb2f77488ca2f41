"""Returns benchmark: train a task over seeds in parallel worker processes and compare the final deterministic
evaluation with the published CleanRL / RL-Zoo figure for the same task.

    python benchmarks/returns.py cartpole acrobot --seeds 3 --budget 500000
    python benchmarks/returns.py hopper halfcheetah --seeds 2 --time-limit 4200   # 1M steps, or what fits
    python benchmarks/returns.py --list

Each run trains with the task's shipped preset (the same one `ppokit train --preset` uses) in its own process
(``--workers`` at a time, default 2, each at ``nice`` 19 and one torch thread), then evaluates the final policy
deterministically for ``--eval-episodes`` episodes with the saved normalization statistics frozen (``ppokit.load``
+ ``ppokit.evaluate``; for Atari, the whole game's unclipped score, with sampled actions as RL-Zoo does). ``--time-limit`` (seconds per run) stops a run
as Ctrl-C does (it finishes the update and saves) and records the steps it reached, so a budget that does not fit
the machine still yields an honest, labelled number. Per task it writes ``<out>/<task>.json`` (per-seed evaluation,
steps reached, wall time, the learning curve; the reference and its source) and ``<out>/<task>.png`` (learning
curves beside the reference), rewritten after every finished seed so an interrupted benchmark keeps what it had.

The published figures differ in what they average, and each row says so: CleanRL's MuJoCo/Atari numbers are the
mean +- std over seeds (3) of the final training episodic return; RL-Zoo's are one trained agent's deterministic
evaluation, mean +- std over its evaluation episodes (rl-baselines3-zoo benchmark.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("MUJOCO_GL", "egl")  # headless MuJoCo (only rendering needs it)

RESULTS_DIR = Path(__file__).parent / "results"
CURVE_POINTS = 200  # learning-curve points kept per seed (the JSON stays small)

RLZOO = "RL-Zoo (rl-baselines3-zoo benchmark.md, ppo; one agent, deterministic evaluation, std over episodes)"
CLEANRL_MUJOCO = ("CleanRL ppo_continuous_action.py, MuJoCo v4 (Huang et al. 2022 / CleanRL docs; 3 seeds, "
                  "std over seeds)")
CLEANRL_ATARI = "CleanRL ppo_atari.py (CleanRL docs; 3 seeds, std over seeds)"


@dataclass(frozen=True)
class Task:
    """One benchmark row: the env, the preset it trains with, its default budget and the published figure."""

    env_id: str
    preset: str
    budget: int
    seeds: int
    ref_mean: float
    ref_std: float
    ref_budget: int
    source: str
    env_kwargs: dict = field(default_factory=dict)
    eval_episodes: int = 10
    # Atari is evaluated with sampled actions, as RL-Zoo does ("deterministic policy except for Atari games"): an
    # argmax policy can stall a game (measured: Breakout at 52k steps scored 0 deterministically).
    deterministic_eval: bool = True


TASKS: dict[str, Task] = {
    "cartpole": Task("CartPole-v1", "cartpole", 500_000, 3, 500.0, 0.0, 100_000, RLZOO),
    "acrobot": Task("Acrobot-v1", "acrobot", 500_000, 3, -73.506, 18.201, 1_000_000, RLZOO),
    # RL-Zoo's row is Pendulum-v0 (the same dynamics and reward as v1) with gSDE exploration, 2M steps.
    "pendulum": Task("Pendulum-v1", "pendulum", 300_000, 3, -169.887, 104.904, 2_000_000, RLZOO),
    "lunarlander": Task("LunarLander-v3", "lunarlander", 1_000_000, 2, 242.119, 31.823, 1_000_000,
                        RLZOO + "; LunarLander-v2"),
    "lunarlander-continuous": Task("LunarLander-v3", "lunarlander", 1_000_000, 2, 270.863, 32.072, 1_000_000,
                                   RLZOO + "; LunarLanderContinuous-v2", env_kwargs={"continuous": True}),
    "hopper": Task("Hopper-v5", "mujoco", 1_000_000, 2, 2383.0, 272.0, 1_000_000, CLEANRL_MUJOCO),
    "halfcheetah": Task("HalfCheetah-v5", "mujoco", 1_000_000, 2, 1443.0, 46.0, 1_000_000, CLEANRL_MUJOCO),
    "walker2d": Task("Walker2d-v5", "mujoco", 1_000_000, 2, 2288.0, 572.0, 1_000_000, CLEANRL_MUJOCO),
    "invertedpendulum": Task("InvertedPendulum-v5", "mujoco", 100_000, 2, 1000.0, 0.0, 1_000_000,
                             "the task's maximum return (1000 steps balanced)"),
    "pong": Task("ALE/Pong-v5", "atari", 10_000_000, 1, 20.4, 0.2, 10_000_000, CLEANRL_ATARI, eval_episodes=3,
                 deterministic_eval=False),
    "breakout": Task("ALE/Breakout-v5", "atari", 10_000_000, 1, 415.0, 28.0, 10_000_000, CLEANRL_ATARI,
                     eval_episodes=3, deterministic_eval=False),
}


# ---------------------------------------------------------------------------------------------------- one run
def task_config(job: dict):
    """The validated ``PPOConfig`` of one run: the task's preset, env and budget, the job's seed and overrides."""
    from ppokit.config.ppo_config import load_preset

    task = TASKS[job["task"]]
    config = load_preset(task.preset)
    config.env_id, config.env_kwargs = task.env_id, dict(task.env_kwargs)
    config.total_timesteps, config.seed = job["budget"], job["seed"]
    config.device, config.torch_threads, config.tensorboard = job["device"], 1, False
    config.save_every = 10**9  # one checkpoint at the end (or at the time limit)
    for key, value in job["overrides"].items():
        setattr(config, key, value)
    return config.validate()


def run_one(job: dict) -> dict:
    """Train one seed of one task and evaluate it (runs in a worker process)."""
    if job["nice"]:
        os.nice(job["nice"])
    import numpy as np
    import torch

    torch.set_num_threads(1)
    import ppokit
    from ppokit.core import schema as S

    config = task_config(job)
    timer = None
    if job["time_limit"]:
        # Stops the run as Ctrl-C does: the update in flight finishes, the checkpoint is written, run() returns.
        timer = threading.Timer(job["time_limit"], os.kill, (os.getpid(), signal.SIGINT))
        timer.daemon = True
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ppokit-returns-") as tmp:
        if timer is not None:
            timer.start()
        run = ppokit.train(config, run_dir=Path(tmp) / "run", console_enabled=False)
        if timer is not None:
            timer.cancel()
        wall = time.perf_counter() - t0
        agent = ppokit.load(Path(tmp) / "run", device=job["device"])
        result = ppokit.evaluate(agent, episodes=job["eval_episodes"], seed=10_000 + 1000 * job["seed"],
                                 deterministic=TASKS[job["task"]].deterministic_eval)
        if job["keep_runs"]:  # the run dir (checkpoint, metrics, curves) kept for a later look or evaluation
            import shutil

            shutil.copytree(Path(tmp) / "run", Path(job["keep_runs"]) / f"{job['task']}__s{job['seed']}",
                            dirs_exist_ok=True)
    curve = [(int(m[S.UPDATE]) * config.batch_size, float(m[S.EPISODIC_RETURN])) for m in run.metrics
             if not math.isnan(m[S.EPISODIC_RETURN])]
    last = [r for _, r in curve[-10:]]  # the last 10 updates, before the curve is thinned
    stride = max(1, math.ceil(len(curve) / CURVE_POINTS))
    curve = curve[::stride] + ([curve[-1]] if curve and (len(curve) - 1) % stride else [])
    return {"task": job["task"], "seed": job["seed"], "steps": int(run.global_step), "budget": job["budget"],
            "stopped_at_time_limit": bool(run.interrupted), "wall_s": round(wall, 1),
            "sps": round(run.global_step / max(wall, 1e-9)), "eval_mean": result["mean"],
            "eval_std": result["std"], "eval_returns": [round(float(r), 2) for r in result["returns"]],
            "final_train_return": float(np.mean(last)) if last else None,
            "curve": [[s, round(r, 2)] for s, r in curve]}


# ---------------------------------------------------------------------------------------------------- outputs
def summarize(name: str, runs: list[dict], args: argparse.Namespace) -> dict:
    """The task's JSON record: per-seed runs, mean +- std over seeds of the evaluation, the reference."""
    import numpy as np

    task = TASKS[name]
    evals = [r["eval_mean"] for r in runs]
    return {
        "task": name, "env_id": task.env_id, "env_kwargs": task.env_kwargs, "preset": task.preset,
        "budget": runs[0]["budget"] if runs else None, "seeds_done": len(runs),
        "steps_reached": [r["steps"] for r in runs],
        "eval_mean": float(np.mean(evals)) if evals else None,
        "eval_std_over_seeds": float(np.std(evals)) if evals else None,
        "reference": {"mean": task.ref_mean, "std": task.ref_std, "budget": task.ref_budget, "source": task.source},
        "eval_episodes": len(runs[0]["eval_returns"]) if runs else None,
        "eval_deterministic": task.deterministic_eval,
        "command": "python benchmarks/returns.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPUs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        "runs": sorted(runs, key=lambda r: r["seed"]),
    }


def write_outputs(record: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{record['task']}.json").write_text(json.dumps(record, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=80)
    for r in record["runs"]:
        if r["curve"]:
            steps, rets = zip(*r["curve"])
            ax.plot(steps, rets, lw=1, label=f"seed {r['seed']} (eval {r['eval_mean']:.0f})")
    ref = record["reference"]
    ax.axhline(ref["mean"], color="k", ls="--", lw=1, label=f"published {ref['mean']:g} +- {ref['std']:g}")
    ax.set_xlabel("env steps")
    ax.set_ylabel("training episodic return")
    ax.set_title(f"ppokit PPO, {record['env_id']}" + (" (continuous)" if record["env_kwargs"] else ""), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{record['task']}.png")
    plt.close(fig)


def row(record: dict) -> str:
    ref = record["reference"]
    steps = record["steps_reached"]
    reached = f"{min(steps):,}" + (f"-{max(steps):,}" if max(steps) != min(steps) else "")
    return (f"{record['task']:<24} {record['eval_mean']:>9.1f} +- {record['eval_std_over_seeds']:<7.1f} "
            f"({record['seeds_done']} seeds, {reached} steps)   published {ref['mean']:g} +- {ref['std']:g} "
            f"at {ref['budget']:,}")


def markdown_table(out: Path) -> str:
    """The Markdown table of every ``<out>/*.json`` record (RESULTS.md's Returns section)."""
    lines = ["| task | env | steps per run | seeds | ppokit: deterministic eval, mean +- std over seeds (per seed) | "
             "training return, last 10 updates | published (steps) | difference (eval) |",
             "|---|---|---|---|---|---|---|---|"]
    for path in sorted(out.glob("*.json")):
        r = json.loads(path.read_text())
        ref = r["reference"]
        steps = r["steps_reached"]
        reached = f"{min(steps):,}" if min(steps) == max(steps) else f"{min(steps):,}-{max(steps):,}"
        if any(run["stopped_at_time_limit"] for run in r["runs"]):
            reached += f" (time limit; budget {r['budget']:,})"
        per_seed = ", ".join(f"{run['eval_mean']:.1f}" for run in r["runs"])
        diff = r["eval_mean"] - ref["mean"]
        trained = [run["final_train_return"] for run in r["runs"] if run["final_train_return"] is not None]
        train = f"{sum(trained) / len(trained):.1f}" if trained else "-"
        env = r["env_id"] + (" continuous" if r["env_kwargs"] else "")
        lines.append(f"| {r['task']} | {env} | {reached} | {r['seeds_done']} | **{r['eval_mean']:.1f} +- "
                     f"{r['eval_std_over_seeds']:.1f}** ({per_seed}) | {train} | {ref['mean']:g} +- {ref['std']:g} "
                     f"({ref['budget']:,}) | {diff:+.1f} ({100 * diff / abs(ref['mean']):+.0f}%) |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("tasks", nargs="*", help=f"tasks: {', '.join(TASKS)}")
    p.add_argument("--list", action="store_true", help="list the tasks with their presets and references")
    p.add_argument("--table", action="store_true", help="print the Markdown table of the records in --out")
    p.add_argument("--seeds", type=int, default=None, help="seeds per task (default: the task's)")
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--budget", type=int, default=None, help="env steps per run (default: the task's)")
    p.add_argument("--workers", type=int, default=2, help="parallel worker processes (default 2)")
    p.add_argument("--nice", type=int, default=19, help="niceness of the workers (default 19; 0: unchanged)")
    p.add_argument("--time-limit", type=float, default=0.0, help="seconds per run before it is stopped and "
                   "evaluated at the steps reached (0: none)")
    p.add_argument("--eval-episodes", type=int, default=None, help="deterministic evaluation episodes per run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--keep-runs", type=Path, default=None, metavar="DIR",
                   help="copy each run dir (checkpoint, metrics) to DIR/<task>__s<seed> (default: temporary)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field for every run (e.g. num_envs=8)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"output folder (default {RESULTS_DIR})")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table(args.out))
        return 0
    if args.list or not args.tasks:
        for name, t in TASKS.items():
            print(f"{name:<24} {t.env_id:<20} preset {t.preset:<12} {t.budget:>10,} steps x {t.seeds} seeds; "
                  f"published {t.ref_mean:g} +- {t.ref_std:g} at {t.ref_budget:,}: {t.source}")
        return 0
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        print(f"returns.py: unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}", file=sys.stderr)
        return 2
    from ppokit.config.ppo_config import ConfigError, PPOConfig

    try:
        bad = [s for s in args.set if "=" not in s]
        if bad:
            raise ValueError(f"expected FIELD=VALUE, got {bad[0]!r}")
        pairs = dict(s.split("=", 1) for s in args.set)
        parsed = PPOConfig.from_dict(pairs)  # the CLI's parsing and its named errors
        overrides = {k.replace("-", "_"): getattr(parsed, k.replace("-", "_")) for k in pairs}
    except (ConfigError, ValueError) as exc:
        print(f"returns.py: --set: {exc}", file=sys.stderr)
        return 2
    jobs = []
    for name in args.tasks:
        task = TASKS[name]
        for seed in range(args.first_seed, args.first_seed + (args.seeds or task.seeds)):
            jobs.append({"task": name, "seed": seed, "budget": args.budget or task.budget, "nice": args.nice,
                         "time_limit": args.time_limit, "device": args.device, "overrides": overrides,
                         "eval_episodes": args.eval_episodes or task.eval_episodes,
                         "keep_runs": str(args.keep_runs) if args.keep_runs else None})
    try:  # every run's config is refused here, with the field, rather than in a worker
        for job in jobs:
            task_config(job)
    except ConfigError as exc:
        print(f"returns.py: {exc}", file=sys.stderr)
        return 2
    import multiprocessing as mp

    done: dict[str, list[dict]] = {name: [] for name in args.tasks}
    print(f"{len(jobs)} runs on {args.workers} workers (nice {args.nice})", flush=True)
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for result in pool.imap_unordered(run_one, jobs):
            done[result["task"]].append(result)
            print(f"{result['task']} seed {result['seed']}: eval {result['eval_mean']:.1f} at "
                  f"{result['steps']:,} steps ({result['wall_s']:.0f} s, {result['sps']} steps/s)", flush=True)
            record = summarize(result["task"], done[result["task"]], args)
            write_outputs(record, args.out)
    for name in args.tasks:
        print(row(summarize(name, done[name], args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
