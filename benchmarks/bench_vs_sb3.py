"""ppokit vs Stable-Baselines3 PPO on CartPole-v1 and MuJoCo: env steps per second (and on CartPole sample
efficiency), back to back.

Two CartPole comparisons, each library in this one process, one torch thread, same env id, same seeds, same
settings:

1. RL-Zoo settings (ppokit's ``cartpole`` preset): 8 envs x 32 steps, one 256-sample minibatch, 20 epochs,
   gamma 0.98, GAE lambda 0.8, lr 1e-3 and clip 0.2 both decayed linearly, no entropy bonus, no value clipping.
2. SB3's defaults (1 env x 2048 steps, minibatch 64, 10 epochs, lr 3e-4 constant, gamma 0.99, lambda 0.95) and
   ppokit configured the same way.

For each run: steps/s over the whole train call (construction + training + ppokit's end-of-run plot/summary) and
over the training loop alone, and the first env step at which the training return (mean of the last 100
finished episodes, read at each rollout's end; the same definition for both) reaches 475. The order of the two
libraries alternates between seeds so neither always runs on a warmer (or busier) machine.

3. MuJoCo (HalfCheetah-v5 and Hopper-v5; needs ``pip install 'ppokit[mujoco]'``) with ppokit's ``mujoco`` preset
   on both sides: 1 env x 2048 steps, 10 epochs of 32 minibatches (64 samples), lr 3e-4 annealed, gamma 0.99,
   lambda 0.95, clip 0.2 (values clipped too), no entropy bonus, [64, 64] tanh actor and critic, observations
   normalized and rewards scaled by the discounted-return std, both clipped at 10 (SB3: ``VecNormalize``).
   TensorBoard off on both sides (SB3 writes none by default). Each run is its own Python process, so the
   whole-process time counts interpreter start, imports, construction, training and teardown; the ratio is of
   env steps per second (the libraries round the budget to whole rollouts differently). ppokit's own split of
   its loop (``perf/time_*``) is printed beside it.

4. Recurrent PPO (``--tasks recurrent``; needs sb3-contrib, in the ``bench`` extra): RL-Zoo's ``ppo_lstm``
   CartPoleNoVel-v1 settings on both sides (ppokit's ``cartpole-novel`` preset, sb3-contrib's ``RecurrentPPO`` with
   ``MlpLstmPolicy``: 8 envs x 32 steps, 20 epochs of one 256-sample minibatch, gamma 0.98, lambda 0.8, lr 1e-3 and
   clip 0.2 linear to 0, no entropy, observation and reward normalization, an LSTM of 64 with the critic's own,
   ReLU heads of 64, no orthogonal init) on ``ppokit/CartPoleNoVel-v1``, each run its own process as for MuJoCo.

    python benchmarks/bench_vs_sb3.py [--smoke] [--device cpu] [--seeds 3] [--steps 100000]
                                      [--tasks cartpole,mujoco,recurrent] [--mujoco-seeds 1]
                                      [--mujoco-envs HalfCheetah-v5,Hopper-v5]

``--steps`` is the budget of the RL-Zoo CartPole and the MuJoCo runs; ``--tasks mujoco --steps 4096`` is a short
sanity run of the MuJoCo comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402


def zoo_configs(seed: int, steps: int):
    """(ppokit config, SB3 kwargs) for the RL-Zoo CartPole settings."""
    from ppokit.config.ppo_config import load_preset

    cfg = load_preset("cartpole")
    cfg.seed, cfg.total_timesteps = seed, steps
    sb3 = dict(n_envs=8, n_steps=32, batch_size=256, n_epochs=20, gamma=0.98, gae_lambda=0.8, ent_coef=0.0,
               learning_rate=lambda p: 1e-3 * p, clip_range=lambda p: 0.2 * p, vf_coef=0.5, max_grad_norm=0.5)
    return cfg, sb3


def default_configs(seed: int, steps: int):
    """(ppokit config, SB3 kwargs) for SB3's PPO defaults on one env."""
    from ppokit.config.ppo_config import PPOConfig

    cfg = PPOConfig(env_id="CartPole-v1", num_envs=1, num_steps=2048, num_minibatches=32, update_epochs=10,
                    learning_rate=3e-4, anneal_lr=False, gamma=0.99, gae_lambda=0.95, clip_coef=0.2,
                    clip_vloss=False, ent_coef=0.0, vf_coef=0.5, max_grad_norm=0.5, seed=seed,
                    total_timesteps=steps)
    return cfg, {"n_envs": 1}


def compare(name: str, make, seeds: list[int], steps: int, device: str, have_sb3: bool,
            no_tb_variant: bool = False) -> dict:
    """Run both libraries on every seed; print one table; return the medians.

    With ``no_tb_variant``, ppokit also runs with TensorBoard off ("ppokit-notb"): SB3 writes no TensorBoard
    events by default, so that row compares the same logging work (ppokit still writes its CSV, checkpoints and
    the end-of-run plot).
    """
    libs = ["sb3", "ppokit"] + (["ppokit-notb"] if no_tb_variant else [])
    rows, res = [], {lib: [] for lib in libs}
    for i, seed in enumerate(seeds):
        order = libs if i % 2 == 0 else libs[::-1]
        for lib in order:
            cfg, sb3_kwargs = make(seed, steps)
            if lib == "sb3" and not have_sb3:
                continue
            if lib == "sb3":
                n_envs = sb3_kwargs.pop("n_envs")
                r = C.run_sb3("CartPole-v1", n_envs, seed, steps, device, **sb3_kwargs)
                sb3_kwargs["n_envs"] = n_envs
            else:
                cfg.tensorboard = cfg.tensorboard and lib == "ppokit"
                r = C.run_ppokit(cfg, device)
            r["solved_at"] = C.first_solved_step(r["rollouts"])
            res[lib].append(r)
            rows.append([lib, seed, r["steps"], r["wall"], r["steps"] / r["wall"], r["steps"] / r["loop"],
                         r["solved_at"] if r["solved_at"] is not None else "not reached"])
            print(f"  {name}: {lib} seed {seed}: {r['steps'] / r['loop']:,.0f} steps/s (loop), "
                  f"solved at {r['solved_at']}", flush=True)
    print()
    print(f"## {name}")
    print(C.table(["library", "seed", "env steps", "wall s", "steps/s (whole call)", "steps/s (loop)",
                   "first step with training return >= 475"], rows))
    out = {}
    for lib, runs in res.items():
        if runs:
            out[lib] = {
                "sps_call": C.median([r["steps"] / r["wall"] for r in runs]),
                "sps_loop": C.median([r["steps"] / r["loop"] for r in runs]),
                "solved": [r["solved_at"] for r in runs],
            }
    for lib, m in out.items():
        solved = [s for s in m["solved"] if s is not None]
        print(f"{lib}: median {m['sps_call']:,.0f} steps/s (whole call), {m['sps_loop']:,.0f} (loop); "
              f"reached 475 in {len(solved)}/{len(m['solved'])} seeds, median step "
              f"{C.median(solved) if solved else float('nan'):,.0f}")
    return out


MUJOCO_ENVS = ("HalfCheetah-v5", "Hopper-v5")


def mujoco_config(env_id: str, seed: int, steps: int):
    """ppokit's ``mujoco`` preset for ``env_id`` (TensorBoard off, as SB3 by default)."""
    from ppokit.config.ppo_config import load_preset

    cfg = load_preset("mujoco")
    cfg.env_id, cfg.seed, cfg.total_timesteps, cfg.tensorboard = env_id, seed, steps, False
    return cfg


def mujoco_sb3_kwargs(cfg) -> dict:
    """SB3 PPO arguments for the same settings as the ppokit config ``cfg`` (the ``mujoco`` preset)."""
    lr = cfg.learning_rate
    return dict(n_steps=cfg.num_steps, batch_size=cfg.minibatch_size, n_epochs=cfg.update_epochs, gamma=cfg.gamma,
                gae_lambda=cfg.gae_lambda, learning_rate=(lambda p: lr * p) if cfg.anneal_lr else lr,
                clip_range=cfg.clip_coef, clip_range_vf=cfg.clip_coef if cfg.clip_vloss else None,
                ent_coef=cfg.ent_coef, vf_coef=cfg.vf_coef, max_grad_norm=cfg.max_grad_norm,
                policy_kwargs=dict(net_arch=dict(pi=list(cfg.hidden_sizes), vf=list(cfg.hidden_sizes))))


RECURRENT_ENV = "ppokit/CartPoleNoVel-v1"


def recurrent_worker(lib: str, seed: int, steps: int, device: str) -> dict:
    """One recurrent run (RL-Zoo's ppo_lstm CartPoleNoVel-v1 settings) of ``lib`` in this process."""
    import ppokit.envs  # noqa: F401  (registers ppokit/CartPoleNoVel-v1 for SB3's make_vec_env)
    from ppokit.config.ppo_config import load_preset

    cfg = load_preset("cartpole-novel")
    cfg.seed, cfg.total_timesteps, cfg.tensorboard = seed, steps, False
    # Equal work on both sides: every step trained, no evaluations (the preset's gate would stop a solved run).
    cfg.eval_every, cfg.eval_threshold = 0, None
    if lib == "sb3":
        from sb3_contrib import RecurrentPPO
        from torch import nn

        r = C.run_sb3(RECURRENT_ENV, cfg.num_envs, seed, steps, device, normalize=True, algo=RecurrentPPO,
                      policy="MlpLstmPolicy", n_steps=cfg.num_steps, batch_size=cfg.minibatch_size,
                      n_epochs=cfg.update_epochs, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda, ent_coef=0.0,
                      learning_rate=lambda p: 1e-3 * p, clip_range=lambda p: 0.2 * p, vf_coef=cfg.vf_coef,
                      max_grad_norm=cfg.max_grad_norm,
                      policy_kwargs=dict(ortho_init=False, activation_fn=nn.ReLU, lstm_hidden_size=64,
                                         enable_critic_lstm=True, net_arch=dict(pi=[64], vf=[64])))
    else:
        r = C.run_ppokit(cfg, device)
    return {"steps": r["steps"], "loop": r["loop"], "call": r["wall"], "perf": r.get("perf")}


def mujoco_worker(lib: str, env_id: str, seed: int, steps: int, device: str) -> dict:
    """One MuJoCo run of ``lib`` in this process (see ``run_mujoco``); its measurements."""
    if env_id == RECURRENT_ENV:
        return recurrent_worker(lib, seed, steps, device)
    cfg = mujoco_config(env_id, seed, steps)
    if lib == "sb3":
        r = C.run_sb3(env_id, cfg.num_envs, seed, steps, device, normalize=cfg.normalize_obs and cfg.normalize_reward,
                      **mujoco_sb3_kwargs(cfg))
    else:
        r = C.run_ppokit(cfg, device)
    return {"steps": r["steps"], "loop": r["loop"], "call": r["wall"], "perf": r.get("perf")}


def run_mujoco(lib: str, env_id: str, seed: int, steps: int, device: str) -> dict:
    """Run ``mujoco_worker`` in a fresh Python process (one torch thread); adds its whole-process wall time."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", lib, "--worker-env", env_id, "--seed-one",
           str(seed), "--steps", str(steps), "--device", device]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{lib} on {env_id} failed:\n{proc.stderr[-2000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    # The child's CPU seconds (user + system), whole process: on a machine other work shares, wall time measures
    # the load as much as the library, while one-threaded CPU time stays the library's own.
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**json.loads(line[len("RESULT "):]), "process": wall, "cpu": cpu}


def compare_mujoco(env_ids: list[str], seeds: list[int], steps: int, device: str, have_sb3: bool) -> dict:
    """Both libraries on each MuJoCo env and seed, alternating their order; one table; per-env median ratios."""
    libs = ["sb3", "ppokit"] if have_sb3 else ["ppokit"]
    rows, res = [], {}
    for env_id in env_ids:
        for i, seed in enumerate(seeds):
            for lib in (libs if i % 2 == 0 else libs[::-1]):
                r = run_mujoco(lib, env_id, seed, steps, device)
                res.setdefault((env_id, lib), []).append(r)
                split = ", ".join(f"{k} {v:.1f}s" for k, v in (r["perf"] or {}).items()) or "n/a"
                rows.append([env_id, lib, seed, r["steps"], r["process"], r["steps"] / r["process"],
                             r["steps"] / r["loop"], split])
                print(f"  mujoco {env_id}: {lib} seed {seed}: {r['process']:.1f} s whole process, "
                      f"{r['steps'] / r['loop']:,.0f} steps/s (loop)", flush=True)
    print()
    print("## MuJoCo, ppokit preset mujoco on both sides (1 env x 2048, 10 epochs x 32 minibatches, obs + reward "
          "normalization)")
    print(C.table(["env", "library", "seed", "env steps", "whole process s", "steps/s (whole process)",
                   "steps/s (loop)", "ppokit loop split (perf/time_*)"], rows))
    out = {}
    for env_id in env_ids:
        if not have_sb3:
            continue
        med = {lib: (C.median([r["steps"] / r["process"] for r in res[(env_id, lib)]]),
                     C.median([r["steps"] / r["loop"] for r in res[(env_id, lib)]])) for lib in libs}
        out[env_id] = (med["ppokit"][0] / med["sb3"][0], med["ppokit"][1] / med["sb3"][1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny budgets (checks the script runs; numbers meaningless)")
    p.add_argument("--device", default="cpu", help="torch device for both libraries (default cpu)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per comparison (default 3)")
    p.add_argument("--steps", type=int, default=100_000, help="env steps per RL-Zoo run (default 100000)")
    p.add_argument("--default-steps", type=int, default=100_000, help="env steps per SB3-defaults run")
    p.add_argument("--default-seeds", type=int, default=1, help="seeds for the SB3-defaults comparison (default 1)")
    p.add_argument("--tasks", default="cartpole,mujoco",
                   help="comma-separated: cartpole (RL-Zoo + SB3 defaults), mujoco (HalfCheetah-v5, Hopper-v5)")
    p.add_argument("--mujoco-seeds", type=int, default=1, help="seeds per MuJoCo env (default 1)")
    p.add_argument("--mujoco-envs", default=",".join(MUJOCO_ENVS),
                   help=f"comma-separated MuJoCo env ids (default {','.join(MUJOCO_ENVS)})")
    p.add_argument("--worker", choices=["sb3", "ppokit"], help=argparse.SUPPRESS)  # one MuJoCo run (internal)
    p.add_argument("--worker-env", help=argparse.SUPPRESS)
    p.add_argument("--seed-one", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(mujoco_worker(args.worker, args.worker_env, args.seed_one, args.steps,
                                                   args.device)))
        return 0
    tasks = {t.strip() for t in args.tasks.split(",") if t.strip()}
    unknown = tasks - {"cartpole", "mujoco", "recurrent"}
    if unknown:
        p.error(f"--tasks: unknown task(s) {', '.join(sorted(unknown))}; choose from cartpole, mujoco, recurrent")
    mujoco_envs = [e.strip() for e in args.mujoco_envs.split(",") if e.strip()]
    if args.smoke:
        args.seeds, args.steps, args.default_steps, args.default_seeds = 1, 2048, 2048, 1
        args.mujoco_seeds, mujoco_envs = 1, ["Hopper-v5"]

    C.header("ppokit vs Stable-Baselines3, " + " and ".join(
        name for task, name in (("cartpole", "CartPole-v1"), ("mujoco", "MuJoCo")) if task in tasks))
    have_sb3 = C.sb3_module() is not None
    if not have_sb3:
        print(C.SB3_MISSING)
    mujoco = None
    if "mujoco" in tasks:
        try:
            import mujoco as _mujoco  # noqa: F401
        except ImportError:
            print("MuJoCo is not installed, so the MuJoCo comparison is skipped. Install it with:  "
                  "pip install 'ppokit[mujoco]'")
        else:
            mujoco = compare_mujoco(mujoco_envs, list(range(1, args.mujoco_seeds + 1)), args.steps, args.device,
                                    have_sb3)
            print()
    if "recurrent" in tasks:
        recurrent = _compare_recurrent(list(range(1, args.mujoco_seeds + 1)), args.steps, args.device)
        if recurrent is not None:
            print(f"RATIO ppokit/sb3-contrib RecurrentPPO steps/s, {RECURRENT_ENV} (ppo_lstm settings, median): "
                  f"{recurrent[0]:.2f}x whole process, {recurrent[1]:.2f}x loop (target >= 3x)")
        print()
    if "cartpole" not in tasks:
        _print_mujoco_ratios(mujoco, have_sb3)
        print(f"load average after: {C.load()}")
        return 0
    zoo = compare("RL-Zoo settings (ppokit preset cartpole)", zoo_configs, list(range(1, args.seeds + 1)),
                  args.steps, args.device, have_sb3, no_tb_variant=True)
    print()
    dflt = compare("SB3 default settings", default_configs, list(range(1, args.default_seeds + 1)),
                   args.default_steps, args.device, have_sb3)
    print()
    _print_mujoco_ratios(mujoco, have_sb3)
    print(f"load average after: {C.load()}")
    runs = sum(len(m["solved"]) for m in (zoo.get("ppokit"), zoo.get("ppokit-notb"), dflt.get("ppokit")) if m)
    print(f"ppokit side ran: {runs} runs")
    if not have_sb3:
        print("RATIO ppokit/SB3: n/a (stable-baselines3 not installed)")
        return 0
    for name, res, lib in (("SB3-defaults", dflt, "ppokit"), ("RL-Zoo, TensorBoard on", zoo, "ppokit"),
                           ("RL-Zoo, TensorBoard off", zoo, "ppokit-notb")):
        r_call = res[lib]["sps_call"] / res["sb3"]["sps_call"]
        r_loop = res[lib]["sps_loop"] / res["sb3"]["sps_loop"]
        print(f"RATIO ppokit/SB3 steps/s, {name} CartPole (median): {r_call:.2f}x whole call, {r_loop:.2f}x loop"
              + (" (target >= 3x)" if "RL-Zoo" in name else ""))
    return 0


def _compare_recurrent(seeds: list[int], steps: int, device: str) -> tuple[float, float] | None:
    """ppokit's LSTM PPO against sb3-contrib's RecurrentPPO, each run its own process, order alternating."""
    try:
        import sb3_contrib  # noqa: F401
    except ImportError:
        print("sb3-contrib is not installed, so the recurrent comparison runs ppokit alone. Install it with:  "
              "pip install 'ppokit[bench]'")
        libs = ["ppokit"]
    else:
        libs = ["sb3", "ppokit"]
    res: dict[str, list[dict]] = {}
    rows = []
    for i, seed in enumerate(seeds):
        for lib in (libs if i % 2 == 0 else libs[::-1]):
            r = run_mujoco(lib, RECURRENT_ENV, seed, steps, device)
            res.setdefault(lib, []).append(r)
            rows.append([lib, seed, r["steps"], r["process"], r["cpu"], r["steps"] / r["process"],
                         r["steps"] / r["cpu"], r["steps"] / r["loop"]])
            print(f"  recurrent: {lib} seed {seed}: {r['process']:.1f} s whole process ({r['cpu']:.1f} s CPU), "
                  f"{r['steps'] / r['loop']:,.0f} steps/s (loop)", flush=True)
    print()
    print(f"## Recurrent PPO (LSTM 64), RL-Zoo's ppo_lstm settings on {RECURRENT_ENV}")
    print(C.table(["library", "seed", "env steps", "whole process s", "whole process CPU s",
                   "steps/s (whole process)", "steps/CPU s (whole process)", "steps/s (loop)"], rows))
    if "sb3" not in res:
        return None
    med = {lib: (C.median([r["steps"] / r["process"] for r in res[lib]]),
                 C.median([r["steps"] / r["loop"] for r in res[lib]]),
                 C.median([r["steps"] / r["cpu"] for r in res[lib]])) for lib in libs}
    print(f"RATIO ppokit/sb3-contrib steps per CPU second, whole process: {med['ppokit'][2] / med['sb3'][2]:.2f}x")
    return med["ppokit"][0] / med["sb3"][0], med["ppokit"][1] / med["sb3"][1]


def _print_mujoco_ratios(mujoco: dict | None, have_sb3: bool) -> None:
    if mujoco is None:
        return
    if not have_sb3:
        print("RATIO ppokit/SB3 steps/s, MuJoCo: n/a (stable-baselines3 not installed)")
    for env_id, (r_process, r_loop) in mujoco.items():
        print(f"RATIO ppokit/SB3 steps/s, {env_id} (mujoco preset, median): {r_process:.2f}x whole process, "
              f"{r_loop:.2f}x loop (target >= 3x)")


if __name__ == "__main__":
    sys.exit(main())
