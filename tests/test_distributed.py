"""Data-parallel PPO (``ppokit.runtime.distributed``): K ranks under torchrun are one job.

The behaviour tests launch real ranks on this machine (gloo on 127.0.0.1, free ports, tiny CartPole budgets,
every subprocess under a hard timeout) and compare what rank 0 records with ``PPOKIT_DIST_CHECKSUMS``: after
every update, a SHA-256 of each rank's parameters and normalizer statistics, all-gathered. The unit tests check
the merges against direct computations.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ppokit.rollout.normalize import RunningMeanStd
from ppokit.runtime import distributed
from ppokit.runtime.distributed import Dist, combine_moments

# Seconds for any one launch: a few seconds each on an idle machine, but a bound, not a wait (every wait polls),
# generous enough for a loaded machine (checked under taskset -c 0 beside a busy loop).
TIMEOUT = 300
# 2 envs x 32 steps per rank: one update is 128 global steps; 512 steps = 4 updates on 2 ranks.
BASE = ["--env", "CartPole-v1", "--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2",
        "--update-epochs", "2", "--quiet", "--no-tensorboard", "--save-every", "2", "--dist-timeout", "20",
        "--normalize-obs", "--normalize-reward"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", distributed.NO_SYNC_VAR)}
    scratch = tmp_path / "tmp"  # where non-main ranks keep their scratch logs (removed at exit)
    scratch.mkdir(exist_ok=True)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(scratch),
               **{distributed.CHECKSUMS_VAR: str(tmp_path / "ck.txt")})
    env.update(extra)
    return env


def _torchrun(tmp_path: Path, args: list[str], **extra: str):
    """``torchrun --standalone --nproc_per_node=2 -m ppokit train ARGS`` (torchrun picks a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "ppokit",
           "train", *args]
    return subprocess.run(cmd, env=_env(tmp_path, **extra), capture_output=True, text=True, timeout=TIMEOUT)


def _checksums(tmp_path: Path) -> list[tuple[int, list[str]]]:
    rows = [line.split() for line in (tmp_path / "ck.txt").read_text().splitlines()]
    return [(int(r[0]), r[1:]) for r in rows]


def _metrics(run_dir: Path) -> list[dict[str, str]]:
    import csv

    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """2 ranks, fused update, obs/reward normalization, 4 updates, checkpoints at 2 and 4."""
    tmp = tmp_path_factory.mktemp("two_rank")
    proc = _torchrun(tmp, [*BASE, "--total-timesteps", "512", "--run-dir", str(tmp / "run")])
    return tmp, proc


def test_two_ranks_hold_identical_parameters_after_every_update(two_rank_run):
    tmp, proc = two_rank_run
    _ok(proc)
    rows = _checksums(tmp)
    assert [u for u, _ in rows] == [1, 2, 3, 4]
    assert all(len(d) == 2 and d[0] == d[1] for _, d in rows), rows
    assert len({d[0] for _, d in rows}) == 4  # the weights moved every update
    # Rank 0 alone wrote the run dir, counting both ranks' steps: 128 per update.
    assert proc.stdout.count("run dir:") == 1
    metrics = _metrics(tmp / "run")
    assert [int(float(m["global_step"])) for m in metrics] == [128, 256, 384, 512]
    assert not list((tmp / "tmp").glob("ppokit-rank*"))  # rank 1's scratch logs are gone


def test_negative_control_without_gradient_sync_the_ranks_drift_apart(tmp_path):
    """Launched with the ``--nproc 2`` shortcut (which re-runs the command under torchrun)."""
    cmd = [sys.executable, "-m", "ppokit", "train", "--nproc", "2", *BASE, "--total-timesteps", "256",
           "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=_env(tmp_path, **{distributed.NO_SYNC_VAR: "1"}), capture_output=True,
                          text=True, timeout=TIMEOUT)
    _ok(proc)
    assert proc.stdout.count("run dir:") == 1
    rows = _checksums(tmp_path)
    assert len(rows) == 2 and all(d[0] != d[1] for _, d in rows), rows


def test_two_rank_recurrent_run_keeps_one_set_of_weights(tmp_path):
    """An LSTM policy (separate critic LSTM) on CartPole without velocities under torchrun: each rank replays its
    own envs' sequences from their saved initial states, the gradients are averaged, and the two ranks hold the
    same bits after every update, which moved the weights; the checkpoint carries each env's live state."""
    from ppokit.runtime.checkpoint import load_checkpoint

    args = ["--env", "ppokit/CartPoleNoVel-v1", "--recurrent", "lstm", "--recurrent-hidden", "16",
            "--recurrent-critic", "separate", "--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2",
            "--update-epochs", "2", "--quiet", "--no-tensorboard", "--dist-timeout", "20", "--normalize-obs",
            "--total-timesteps", "192", "--run-dir", str(tmp_path / "run")]
    proc = _torchrun(tmp_path, args)
    _ok(proc)
    rows = _checksums(tmp_path)
    assert [u for u, _ in rows] == [1, 2, 3]
    assert all(len(d) == 2 and d[0] == d[1] for _, d in rows), rows
    assert len({d[0] for _, d in rows}) == 3
    assert [int(float(m["global_step"])) for m in _metrics(tmp_path / "run")] == [64, 128, 192]
    loop = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["loop"]
    assert loop["policy_state"].abs().sum() > 0  # rank 0's envs' live LSTM states were saved


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    """Two torchrun agents meeting at one c10d rendezvous endpoint, as two machines would: the autograd path
    with a small target_kl and a large step, so that KL early stopping fires in every update, at different
    minibatches (each rank's own KL would cross the threshold at different points: a per-rank decision hangs),
    and an evaluation gate (rank 0's result decides for every rank) that ends the run at update 2 of 3."""
    tmp = tmp_path_factory.mktemp("two_node")
    port = _free_port()
    launcher = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=ppokit-test", "--max_restarts=0"]
    args = [*BASE, "--total-timesteps", "384", "--no-fused-update", "--target-kl", "0.003",
            "--learning-rate", "0.01", "--update-epochs", "4", "--num-minibatches", "4",
            "--eval-every", "2", "--eval-threshold", "1", "--eval-episodes", "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "ppokit", "train", *args]
    env = _env(tmp)
    nodes = [subprocess.Popen([*cmd, "--run-dir", str(tmp / f"run{i}")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    return tmp, [(p.returncode, *out) for p, out in zip(nodes, outs)]


def test_two_nodes_by_rendezvous_hold_identical_parameters(two_node_run):
    tmp, results = two_node_run
    for rc, out, err in results:
        assert rc == 0, f"exit {rc}\n{out[-2000:]}\n{err[-3000:]}"
    rows = _checksums(tmp)
    assert [u for u, _ in rows] == [1, 2]  # solved at the evaluation of update 2, on both ranks together
    assert all(d[0] == d[1] for _, d in rows) and len({d[0] for _, d in rows}) == 2


def test_kl_early_stop_on_every_rank_together_does_not_hang(two_node_run):
    tmp, results = two_node_run
    assert all(rc == 0 for rc, *_ in results)
    run_dir = next(p for p in (tmp / "run0", tmp / "run1") if (p / "metrics.csv").exists())
    metrics = _metrics(run_dir)
    # Both ranks stopped together in every update (the checksums agree), after different numbers of steps.
    assert [float(m["diag/early_stopped"]) for m in metrics] == [1.0] * 2
    applied = [float(m["diag/minibatches"]) for m in metrics]
    assert min(applied) >= 1 and max(applied) < 16 and len(set(applied)) > 1, applied
    assert float(metrics[1]["charts/eval_return"]) >= 1  # rank 0's evaluation, shared: the gate that stopped both


def test_two_rank_checkpoint_resumes_in_one_process(two_rank_run, tmp_path):
    from ppokit.training.trainer import resume

    src, proc = two_rank_run
    _ok(proc)
    shutil.copytree(src / "run", tmp_path / "run")
    run = resume(tmp_path / "run", total_timesteps=768, console_enabled=False)
    # 512 steps were done; one process takes 64 per update: 4 more updates.
    assert run.global_step == 768
    steps = [int(float(m["global_step"])) for m in _metrics(tmp_path / "run")]
    assert steps == [128, 256, 384, 512, 576, 640, 704, 768]


def test_one_process_checkpoint_resumes_in_two_ranks(tmp_path):
    from ppokit.cli import build_parser
    from ppokit.cli.train import config_from_args
    from ppokit.training.trainer import train

    args = build_parser().parse_args(["train", *BASE, "--total-timesteps", "128"])
    train(config_from_args(args), run_dir=tmp_path / "run", console_enabled=False)  # 2 updates of 64
    proc = _torchrun(tmp_path, ["--resume", str(tmp_path / "run"), "--total-timesteps", "384", "--quiet"])
    _ok(proc)
    rows = _checksums(tmp_path)
    assert [u for u, _ in rows] == [3, 4] and all(d[0] == d[1] for _, d in rows), rows
    assert [int(float(m["global_step"])) for m in _metrics(tmp_path / "run")] == [64, 128, 256, 384]


@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGSTOP, marks=pytest.mark.slow)],
                         ids=["kill-9", "stopped"])
def test_a_lost_rank_is_named_by_the_survivor_within_the_timeout(sig, tmp_path):
    """kill -9 (its sockets close: noticed at once) or SIGSTOP (it just stops answering: noticed when the
    collective times out) of rank 1: rank 0 exits non-zero within dist_timeout, naming rank 1; its checkpoint
    loads."""
    from ppokit.runtime.checkpoint import LEARNER_KEYS, load_checkpoint

    port, run_dir, timeout = _free_port(), tmp_path / "run", 8
    args = [*BASE, "--total-timesteps", "10000000", "--save-every", "1", "--dist-timeout", str(timeout),
            "--run-dir", str(run_dir)]
    ranks = []
    for rank in range(2):
        env = _env(tmp_path, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(subprocess.Popen([sys.executable, "-m", "ppokit", "train", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (run_dir / "checkpoint.pt").exists():
            assert time.monotonic() < deadline and ranks[0].poll() is None, "no checkpoint was written"
            time.sleep(0.2)
        ranks[1].send_signal(sig)
        start = time.monotonic()
        _, err = ranks[0].communicate(timeout=TIMEOUT)
        waited = time.monotonic() - start
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert ranks[0].returncode == 1, err[-3000:]
    # Named, not hung: kill -9 is noticed at once, SIGSTOP at the timeout; the margin is for a loaded machine
    # (the survivor's exit, checkpoint flush and interpreter teardown share the cores), far below "forever".
    assert waited < timeout + 60
    assert "lost rank 1" in err and "Traceback" not in err, err[-3000:]
    state = load_checkpoint(run_dir / "checkpoint.pt", require_finite=LEARNER_KEYS)
    assert state["update"] >= 1


# ---------------------------------------------------------------------- units (no process group)
def test_combine_moments_equals_the_moments_of_the_concatenation():
    torch.manual_seed(0)
    parts = [torch.randn(n, 3, dtype=torch.float64) * 5 + 2 for n in (7, 1, 12)]
    n = torch.tensor([7.0, 1.0, 12.0, 0.0], dtype=torch.float64)
    nan = torch.full((1, 3), float("nan"), dtype=torch.float64)  # an empty part's moments must not leak
    mean = torch.cat([torch.stack([p.mean(0) for p in parts]), nan])
    var = torch.cat([torch.stack([p.var(0, unbiased=False) for p in parts]), nan])
    total, mu, v = combine_moments(n, mean, var)
    allx = torch.cat(parts)
    assert total == 20
    torch.testing.assert_close(mu, allx.mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(v, allx.var(0, unbiased=False), rtol=0, atol=1e-12)


def _two_ranks_gather(monkeypatch, peer_rows):
    """``torch.distributed.all_gather`` of a two-rank job as rank 0 sees it: its own tensor, then ``next(peer_rows)``
    as rank 1's (the collective replaced, not ppokit's code around it)."""
    def all_gather(out, t):
        out[0].copy_(t)
        out[1].copy_(next(peer_rows))

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)


def test_merged_normalizer_statistics_equal_one_normalizer_over_every_rank_batch(monkeypatch):
    """Rank 0's RunningMeanStd, merging a peer's batches through ``Dist.merge_moments`` (the all-gather replaced
    by the peer's row), ends where one RunningMeanStd fed both ranks' batches ends."""
    torch.manual_seed(1)
    mine = [torch.randn(4, 2, dtype=torch.float64) for _ in range(5)]
    peer = [torch.randn(4, 2, dtype=torch.float64) * 3 + 1 for _ in range(5)]
    dist = Dist(rank=0, world_size=2)
    rows = iter([torch.cat([torch.tensor([4.0], dtype=torch.float64), b.mean(0), b.var(0, unbiased=False)])
                 for b in peer])
    _two_ranks_gather(monkeypatch, rows)
    merged, reference = RunningMeanStd(2), RunningMeanStd(2)
    merged.reduce = dist.merge_moments
    for a, b in zip(mine, peer):
        merged.update(a)
        reference.update(torch.cat([a, b]))
    assert float(merged.count) == float(reference.count) == 40
    torch.testing.assert_close(merged.mean, reference.mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(merged.var, reference.var, rtol=0, atol=1e-12)


def test_sync_hook_averages_gradients_and_stats_in_one_all_reduce(monkeypatch):
    calls = []

    def fake_all_reduce(buf, op=None):  # the peer holds the same tensors plus 2.0 everywhere
        calls.append(buf.numel())
        buf.mul_(2).add_(2.0)

    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    grads = [torch.arange(6.0).view(2, 3), torch.ones(4)]
    stats = [torch.tensor(0.5), torch.tensor([1.0, -1.0])]
    Dist(rank=0, world_size=2).sync(grads, stats)
    assert calls == [13]
    torch.testing.assert_close(grads[0], torch.arange(6.0).view(2, 3) + 1)
    torch.testing.assert_close(grads[1], torch.full((4,), 2.0))
    torch.testing.assert_close(stats[0], torch.tensor(1.5))
    assert distributed.LOCAL.sync is None  # one process: the epoch loop runs no hook


def test_schedule_counts_every_rank_and_reduces_to_num_updates_in_one_process():
    from ppokit.config.ppo_config import PPOConfig

    cfg = PPOConfig(num_envs=4, num_steps=16, total_timesteps=1000)
    assert distributed.LOCAL.schedule(1000, 64, 0, 0) == (cfg.num_updates, cfg.num_updates * 64)
    two = Dist(rank=0, world_size=2)
    assert two.schedule(1000, 64, 0, 0) == (7, 896)  # 1000 // 128 updates of 128 steps
    # 1 rank's checkpoint at update 5 (320 steps) resumed on 2 ranks: (1000 - 320) // 128 = 5 more.
    assert two.schedule(1000, 64, 5, 320) == (10, 960)


def test_nproc_relaunch_reproduces_every_given_flag():
    from ppokit.cli import build_parser
    from ppokit.cli.train import _child_argv

    argv = ["train", "--nproc", "2", "--env", "CartPole-v1", "--num-envs", "3", "--no-fused-update",
            "--hidden-sizes", "8,8", "--quiet", "--import-module", "x", "--run-dir", "r"]
    parser = build_parser()
    args = parser.parse_args(argv)
    child = parser.parse_args(["train", *_child_argv(args)])
    assert child.nproc is None
    assert {k: v for k, v in vars(child).items() if k != "nproc"} == {k: v for k, v in vars(args).items()
                                                                      if k != "nproc"}


def test_env_and_torch_seeds_of_the_ranks_never_overlap():
    # 2 ranks x 4 envs step the envs of one process with 8 envs: seeds 5..12, each once.
    seeds = [Dist(rank=r, world_size=2).env_seed(5, 4) + i for r in range(2) for i in range(4)]
    assert seeds == list(range(5, 13))
    assert [Dist(rank=r, world_size=2).seed(5) for r in range(2)] == [5, 6]
    assert distributed.LOCAL.env_seed(5, 4) == distributed.LOCAL.seed(5) == 5


def test_a_rollout_backend_plugs_in_without_touching_the_learner(tmp_path):
    """``train(rollout=...)`` builds the rollout side from Collector's arguments: a backend that wraps the local
    Collector (standing in for remote workers) trains the same run, bit for bit, as the Collector itself."""
    from ppokit.config.ppo_config import PPOConfig
    from ppokit.rollout.collector import Collector
    from ppokit.training.trainer import train

    calls = []

    class Backend:
        def __init__(self, *args, **kwargs):
            self._local = Collector(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._local, name)

        def collect(self, global_step):
            calls.append(global_step)
            return self._local.collect(global_step)

    cfg = dict(env_id="CartPole-v1", num_envs=2, num_steps=16, total_timesteps=96, tensorboard=False)
    ref = train(PPOConfig(**cfg), run_dir=tmp_path / "ref", console_enabled=False)
    run = train(PPOConfig(**cfg), run_dir=tmp_path / "run", console_enabled=False, rollout=Backend)
    assert calls == [0, 32, 64]
    assert [m["losses/policy_loss"] for m in run.metrics] == [m["losses/policy_loss"] for m in ref.metrics]
    assert all(torch.equal(a, b) for a, b in zip(run.policy.parameters(), ref.policy.parameters()))


def test_the_collector_is_the_rollout_source_the_trainer_reads(tmp_path):
    from ppokit.config.ppo_config import PPOConfig
    from ppokit.rollout.source import RolloutSource
    from ppokit.training.trainer import Trainer

    trainer = Trainer(PPOConfig(env_id="CartPole-v1", num_envs=2, num_steps=8, total_timesteps=16,
                                tensorboard=False), run_dir=tmp_path / "run", console_enabled=False)
    try:
        assert isinstance(trainer.collector, RolloutSource)
        assert trainer.dist is distributed.LOCAL  # no torchrun: one process, nothing synchronised
    finally:
        trainer.envs.close()
        trainer._claim.release()


LM_SCRIPT = '''
import hashlib, json, os, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from ppokit.lm import DPOTrainer, GRPOTrainer, LMConfig, PPOTrainer
from ppokit.lm.tiny import build_tiny
reward = lambda prompts, completions: [c.count("X") / max(len(c), 4) for c in completions]
cfg = LMConfig(learning_rate=3e-3, batch_prompts=4, group_size=4, max_new_tokens=6, update_epochs=2,
               num_minibatches=2, scale_rewards="batch", adaptive_kl=True, tensorboard=False, console=False)
pairs = [("X:", "XX", "AB"), ("A:", "XA", "BB"), ("AB:", "XXX", "A"), ("B:", "X", "BA")]
out = {}
for kind in ("grpo", "ppo", "dpo"):  # one launch, three trainers in turn
    # Each rank builds its model from a different seed: the start-up broadcast must make them one.
    model, tok = build_tiny("ABX:", pad_is_eos=True, seed=int(os.environ["RANK"]))
    run_dir = os.path.join(sys.argv[1], kind)
    if kind == "dpo":
        t = DPOTrainer(model, tok, pairs=pairs, config=cfg, run_dir=run_dir)
    else:
        Trainer = GRPOTrainer if kind == "grpo" else PPOTrainer
        t = Trainer(model, tok, reward=reward, prompts=["X:", "AB:", "BXAX:", "A:"], config=cfg, run_dir=run_dir)
    rows = []
    for _ in range(3):
        t.step()
        models = [model] + ([t.value_model] if kind == "ppo" else [])
        h = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for m in models for p in m.parameters()))
        row = [None] * dist.get_world_size()
        dist.all_gather_object(row, (h.hexdigest(), t.history[-1].get("charts/score_mean")))
        rows.append(row)
    t.close()
    out[kind] = rows
    if kind == "grpo":  # rank 0 saves, every rank resumes: the same weights, each rank its own sampling stream
        t.save(os.path.join(sys.argv[1], "saved"))
        dist.barrier()
        start, _ = build_tiny("ABX:", pad_is_eos=True, seed=0)  # the run's starting model (rank 0's)
        r = GRPOTrainer.resume(os.path.join(sys.argv[1], "saved"), start, tok, reward=reward,
                               prompts=["X:", "AB:", "BXAX:", "A:"])
        r.step()
        h = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in start.parameters())).hexdigest()
        row = [None] * dist.get_world_size()
        dist.all_gather_object(row, (h, hashlib.sha256(r._sample_state.numpy().tobytes()).hexdigest()))
        out["grpo_resumed"] = [row]
if dist.get_rank() == 0:
    json.dump(out, open(sys.argv[2], "w"))
'''


@pytest.mark.slow
def test_two_rank_lm_trainers_keep_the_ranks_identical_after_every_update(tmp_path):
    """GRPO, PPO-RLHF and DPO on the tiny GPT-2 across 2 ranks: each generates for its 2 of the 4 prompts
    (whole groups) or trains on its 2 of the 4 pairs, GRPO's batch std and PPO's advantage whitening and KL for
    the adaptive coefficient are taken over both ranks, gradients (PPO: of the value model too) are averaged in
    the sync hook."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import json

    script = tmp_path / "lm_dp.py"
    script.write_text(LM_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(tmp_path / "runs"), str(tmp_path / "rows.json")]
    proc = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)
    _ok(proc)
    out = json.loads((tmp_path / "rows.json").read_text())
    (weights0, stream0), (weights1, stream1) = out.pop("grpo_resumed")[0]
    assert weights0 == weights1 and stream0 != stream1  # resumed: one set of weights, two sampling streams
    for kind, rows in out.items():
        assert len(rows) == 3, kind
        assert all(r[0][0] == r[1][0] for r in rows), (kind, rows)  # same weights on both ranks
        assert len({r[0][0] for r in rows}) == 3, kind  # that moved every update
        if kind != "dpo":  # from different completions (each rank its own prompts)
            assert any(r[0][1] != r[1][1] for r in rows), kind
        assert len(_metrics(tmp_path / "runs" / kind)) == 3, kind  # rank 0 alone logged
    assert sorted(out) == ["dpo", "grpo", "ppo"]


STATS_SCRIPT = '''
import json, os, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from ppokit.core import schema as S
from ppokit.lm import DPOTrainer, LMConfig, RewardModelTrainer
from ppokit.lm.tiny import build_tiny
PAIRS = [("X:", "XX", "AB"), ("A:", "XA", "BB"), ("AB:", "XXX", "A"), ("B:", "X", "BA"), ("BX:", "XAX", "BBA")]
KEYS = {"dpo": [S.DPO_PREF_ACCURACY, S.DPO_REWARD_MARGIN, S.DPO_CHOSEN_REWARD, S.DPO_REJECTED_REWARD],
        "rm": [S.RM_ACCURACY, S.RM_MARGIN, S.RM_LOSS]}


def run(kind, seed):
    cfg = LMConfig(learning_rate=3e-2, batch_prompts=4, beta=0.5, tensorboard=False, console=False)
    model, tok = build_tiny("ABX:", pad_is_eos=True, seed=seed)
    Trainer = DPOTrainer if kind == "dpo" else RewardModelTrainer
    t = Trainer(model, tok, PAIRS[:4] if kind == "dpo" else PAIRS, config=cfg)
    rows = [[m[k] for k in KEYS[kind]] for m in (t.step() for _ in range(3))]
    t.close()
    return rows


if __name__ == "__main__":
    out = {}
    for kind in ("dpo", "rm"):
        rows = run(kind, seed=int(os.environ["RANK"]))  # the start-up broadcast makes rank 1's model rank 0's
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        out[kind] = gathered
    if dist.get_rank() == 0:
        json.dump(out, open(sys.argv[1], "w"))
'''


@pytest.mark.slow
def test_two_rank_dpo_and_reward_model_log_the_whole_batchs_accuracy_and_margins(tmp_path):
    """Each rank of a 2-rank DPO or reward-model run trains on its 2 of the 4 pairs; the step's preference
    accuracy, margins and implicit rewards it logs are those of all 4, as one process logs them (each rank's
    own half differs once the policy has moved)."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import importlib.util
    import json

    script = tmp_path / "lm_stats.py"
    script.write_text(STATS_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(tmp_path / "stats.json")]
    proc = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)
    _ok(proc)
    out = json.loads((tmp_path / "stats.json").read_text())
    spec = importlib.util.spec_from_file_location("lm_stats", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.set_num_threads(1)
    for kind in ("dpo", "rm"):
        rank0, rank1 = out[kind]
        one = mod.run(kind, seed=0)
        assert rank0 == rank1, kind  # every rank logs the same numbers
        flat = [v for row in rank0 for v in row]
        assert flat == pytest.approx([v for row in one for v in row], rel=1e-4, abs=1e-5), (kind, rank0, one)
        assert len({tuple(r) for r in one}) == 3, (kind, one)  # the statistics moved with the policy


def test_shard_splits_whole_items_and_refuses_an_uneven_split():
    assert Dist(rank=1, world_size=2).shard(["a", "b", "c", "d"]) == ["c", "d"]
    assert distributed.LOCAL.shard(["a", "b", "c"]) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="batch_prompts: 3 does not split evenly over 2 ranks"):
        Dist(rank=0, world_size=2).shard(["a", "b", "c"])


def test_whitening_over_the_ranks_equals_normalize_over_the_whole_batch(monkeypatch):
    """Rank 0's half of ``Dist.whiten`` (the peer's moments in place of the all-gather) is the first half of
    ``advantages.normalize`` over both halves with the mask."""
    from ppokit.core.advantages import normalize

    torch.manual_seed(2)
    x = torch.randn(6, 5) * 3 + 1
    mask = torch.rand(6, 5) > 0.3
    peer = x[3:][mask[3:]].double()
    peer_row = torch.tensor([float(peer.numel()), float(peer.mean()), float(peer.var(unbiased=False))],
                            dtype=torch.float64)
    dist = Dist(rank=0, world_size=2)
    _two_ranks_gather(monkeypatch, itertools.repeat(peer_row))
    torch.testing.assert_close(dist.whiten(x[:3], mask[:3]), normalize(x, mask=mask)[:3], rtol=0, atol=1e-6)
    assert torch.equal(distributed.LOCAL.whiten(x, mask), normalize(x, mask=mask))


def test_a_bad_nproc_is_one_line_and_exit_code_2(capsys):
    from ppokit.cli import main

    assert main(["train", "--nproc", "0", "--env", "CartPole-v1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--nproc must be a positive number of processes, got 0" in err and "Traceback" not in err


def test_logged_diagnostics_are_those_of_both_ranks_data_together(monkeypatch):
    """``Dist.diagnostics`` on rank 0, the peer's row in place of the all-gather, against the single-process
    formulas (``explained_variance``, ``Tensor.std``, episode means) applied to both ranks' data concatenated."""
    from ppokit.core import schema as S
    from ppokit.core.objectives import explained_variance

    torch.manual_seed(3)

    def data(n, shift):
        v, y = torch.randn(n) + shift, torch.randn(n) * 2 + shift
        return v, y, torch.rand(n) * 3, torch.randn(n) + shift

    mine, theirs = data(40, 0.0), data(25, 1.5)
    ep_mine, ep_theirs = [(10.0, 10), (20.0, 20)], [(40.0, 40)]
    peer = Dist(rank=1, world_size=2)
    captured = {}

    def peer_gather(out, t):  # rank 1's all_gather: keep the row it sends
        captured["row"] = t.clone()
        for o in out:
            o.copy_(t)

    monkeypatch.setattr(torch.distributed, "all_gather", peer_gather)
    peer.diagnostics(ep_theirs, *theirs, nonfinite_env=1, advantages_nonfinite=2.0)
    dist = Dist(rank=0, world_size=2)
    _two_ranks_gather(monkeypatch, itertools.repeat(captured["row"]))
    got = dist.diagnostics(ep_mine, *mine, nonfinite_env=0, advantages_nonfinite=0.0)
    v, y, r, a = (torch.cat([m, t]).double() for m, t in zip(mine, theirs))
    assert got[S.EPISODIC_RETURN] == pytest.approx(70 / 3) and got[S.EPISODES] == 3
    assert got[S.EPISODIC_LENGTH] == pytest.approx(70 / 3)
    assert got[S.NONFINITE_ENV] == 1 and got[S.ADVANTAGES_NONFINITE] == 2
    # (the residual is formed in float32, as the logged value is: agreement to float32 rounding)
    assert got[S.EXPLAINED_VARIANCE] == pytest.approx(float(explained_variance(v, y)), rel=1e-6)
    assert got[S.REWARD_STD] == pytest.approx(float(r.std()), abs=1e-12)
    assert got[S.ADVANTAGE_STD] == pytest.approx(float(a.std()), abs=1e-12)


def test_every_rank_runs_the_minibatch_count_of_the_smallest_batch(monkeypatch):
    """A rank whose rollout kept 3 valid steps makes only 3 non-empty minibatches of 4: every rank must run 3
    (one all-reduce each), or the others wait for a fourth that never comes."""
    from ppokit.update.epochs import UpdateSettings, minibatch_sizes

    s = UpdateSettings(algo="ppo", update_epochs=1, num_minibatches=4, clip_coef=0.2, clip_vloss=True,
                       norm_adv=True, ent_coef=0.0, vf_coef=0.5, max_grad_norm=0.5, target_kl=None)
    dist = Dist(rank=0, world_size=2)
    def all_reduce_min_with_3(t, op=None):  # the peer kept 3
        assert op == torch.distributed.ReduceOp.MIN
        t.clamp_(max=3.0)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce_min_with_3)
    agreed = dist.agree_minibatches(s, 64)
    assert agreed.num_minibatches == 3 and len(minibatch_sizes(64, agreed.num_minibatches)) == len(
        minibatch_sizes(3, 4))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None: None)  # the peer kept as many
    assert dist.agree_minibatches(s, 64) is s and distributed.LOCAL.agree_minibatches(s, 3) is s


@pytest.mark.slow
def test_sigterm_to_torchrun_makes_every_rank_finish_the_update_and_save(tmp_path):
    """Preemption (Slurm, Kubernetes, or torchrun's own shutdown) sends SIGTERM: the ranks agree to stop, rank 0
    checkpoints the update it finished (no periodic checkpoint is due: save_every is large)."""
    from ppokit.runtime.checkpoint import load_checkpoint

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "ppokit",
           "train", *BASE, "--total-timesteps", "10000000", "--save-every", "100000", "--run-dir", str(run_dir)]
    # torchrun SIGKILLs ranks that have not exited 30 s after its SIGTERM; on a loaded machine the update, the
    # agreement to stop and the save can take longer, so the bound is widened (the launcher sets the same variable).
    env = _env(tmp_path, TORCH_ELASTIC_SHUTDOWN_TIMEOUT=str(TIMEOUT))
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = ("", "")
    try:
        deadline = time.monotonic() + TIMEOUT
        while not ((run_dir / "metrics.csv").exists() and len(_metrics(run_dir)) >= 2):
            assert time.monotonic() < deadline and agent.poll() is None, "the run did not start"
            time.sleep(0.2)
        agent.send_signal(signal.SIGTERM)
        out = agent.communicate(timeout=TIMEOUT + 60)
    finally:
        agent.kill()
        agent.wait()
    assert (run_dir / "checkpoint.pt").is_file(), f"no checkpoint after SIGTERM; torchrun said:\n{out[1][-3000:]}"
    state = load_checkpoint(run_dir / "checkpoint.pt")
    assert state["update"] == len(_metrics(run_dir)) >= 2


@pytest.mark.slow
def test_bench_distributed_smoke():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_distributed.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    _ok(proc)
    for name in ("1 rank", "2 ranks", "1 rank, 2E envs"):
        assert f"| {name} | " in proc.stdout
    assert "| 1 rank | " in proc.stdout and "1.00x / 1.00x" in proc.stdout


# ---------------------------------------------------------------------- the --nproc launcher (ppokit.runtime.launcher)
def _proc_children(pid: int) -> list[int]:
    from ppokit.runtime.procs import children

    return sorted(children(pid))


def _alive(pids: list[int]) -> list[int]:
    from ppokit.runtime.procs import start_time

    return [p for p in pids if start_time(p) is not None]


def _rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK=")).split(b"=", 1)[1])


def _until(cond, what: str, limit: float = TIMEOUT):
    """Poll ``cond()`` until it is truthy (its value), failing with ``what`` after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _nproc_run(tmp_path: Path):
    """``ppokit train --nproc 2`` running with at least 2 updates logged: (launcher, agent pid, rank pids)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppokit", "train", "--nproc", "2", *BASE, "--total-timesteps", "10000000",
           "--save-every", "100000", "--run-dir", str(run_dir)]
    launcher = subprocess.Popen(cmd, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _until(lambda: launcher.poll() is not None or ((run_dir / "metrics.csv").exists()
                                                       and len(_metrics(run_dir)) >= 2), "the run did not start")
        assert launcher.poll() is None, launcher.communicate()
        agent = _until(lambda: _proc_children(launcher.pid), "no torchrun agent")[0]
        ranks = _until(lambda: len(_proc_children(agent)) == 2 and _proc_children(agent), "no 2 ranks")
    except BaseException:
        launcher.kill()
        raise
    return launcher, agent, ranks


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_nproc_launcher_stops_every_rank_after_a_checkpoint(sig, code, tmp_path):
    """SIGINT (Ctrl-C) or SIGTERM to ``ppokit train --nproc 2``: torchrun and both ranks are gone when it exits
    with 130 / 143, rank 0 saved the update it finished (save_every is large: only the stop saves), and the
    metrics stop growing."""
    from ppokit.runtime.checkpoint import load_checkpoint
    from ppokit.runtime.launcher import SHUTDOWN_S

    launcher, agent, ranks = _nproc_run(tmp_path)
    try:
        launcher.send_signal(sig)
        start = time.monotonic()
        _, err = launcher.communicate(timeout=TIMEOUT)
        waited = time.monotonic() - start
    finally:
        launcher.kill()
    assert launcher.returncode == code, err[-3000:]
    assert not _alive([agent, *ranks])  # it waited for them
    assert waited < SHUTDOWN_S  # they stopped on the signal, not at the launcher's kill deadline
    rows = len(_metrics(tmp_path / "run"))
    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert state["update"] == rows >= 2
    time.sleep(1.0)
    assert len(_metrics(tmp_path / "run")) == rows
    assert "Traceback" not in err, err[-3000:]


def test_kill_9_of_the_nproc_launcher_leaves_no_rank_or_torchrun_behind(tmp_path):
    """The launcher's pipe closes with it: torchrun stops its ranks as for SIGTERM (rank 0 saves)."""
    from ppokit.runtime.checkpoint import load_checkpoint

    launcher, agent, ranks = _nproc_run(tmp_path)
    try:
        launcher.kill()
        launcher.wait()
        _until(lambda: not _alive([agent, *ranks]), f"still alive: {_alive([agent, *ranks])}")
    finally:
        for p in _alive([agent, *ranks]):
            os.kill(p, signal.SIGKILL)
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["update"] >= 2


def test_kill_9_of_one_rank_under_nproc_is_one_line_naming_it(tmp_path):
    """Rank 1 killed: one error line naming rank 1 and SIGKILL (torchrun's ChildFailedError traceback, its log
    lines and gloo's text suppressed, rank 0 quiet about the peer), a non-zero exit, no process left."""
    launcher, agent, ranks = _nproc_run(tmp_path)
    rank1 = next(p for p in ranks if _rank_of(p) == 1)
    try:
        os.kill(rank1, signal.SIGKILL)
        _, err = launcher.communicate(timeout=TIMEOUT)
    finally:
        launcher.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert launcher.returncode not in (0, None)
    assert len(lines) == 1 and "rank 1 of 2 was killed by SIGKILL (signal 9)" in lines[0], err[-3000:]
    assert "Traceback" not in err and "hung?" not in err
    assert not _alive([agent, *ranks])


def test_the_failure_line_names_the_lost_rank_and_how_it_ended():
    from ppokit.runtime.launcher import describe_failures

    # torchrun's SIGTERM to the survivor is its stop, not the news; exit codes 1 and 2 said their own line.
    assert describe_failures({0: -15, 1: -9}, 2) == ("rank 1 of 2 was killed by SIGKILL (signal 9); the other ranks were "
                                                "stopped; rank 0's last checkpoint is whole: continue with ppokit train "
                                                "--nproc 2 --resume RUN_DIR")
    assert describe_failures({1: 7}, 2).startswith("rank 1 of 2 exited with code 7;")
    assert describe_failures({0: 1, 1: 2}, 2) is None
    assert describe_failures({1: -15}, 2).startswith("rank 1 of 2 was killed by SIGTERM (signal 15)")
