"""Decoupled rollout workers (``--actors K``, rollout/actors.py): real CartPole runs in worker processes, checked
by what the run writes and by pid."""

from __future__ import annotations

import csv
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from ppokit.config.ppo_config import ConfigError, PPOConfig, load_preset
from ppokit.core import schema as S

SRC = str(Path(__file__).resolve().parents[1] / "src")
LAG_COLUMNS = (S.POLICY_LAG, S.POLICY_LAG_MEAN, S.DROPPED_CHUNKS_FRAC, S.ACTOR_REPLACEMENTS)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def _train(run_dir: Path, *flags: str) -> subprocess.Popen:
    # Its own process group, as at a terminal (a Ctrl-C there reaches the whole group).
    return subprocess.Popen([sys.executable, "-m", "ppokit", "train", "--preset", "cartpole", "--seed", "1",
                             "--run-dir", str(run_dir), "--no-tensorboard", "--quiet", *flags],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _actor_pids(proc: psutil.Process) -> list[int]:
    """The learner's rollout workers (spawned interpreters named ppokit-actor-K by multiprocessing)."""
    pids = []
    for c in proc.children():
        try:
            if "multiprocessing.spawn" in " ".join(c.cmdline()):
                pids.append(c.pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):  # a worker that just died, not yet joined
            continue
    return pids


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_cartpole_with_two_actors_learns_and_logs_the_lag(tmp_path):
    run_dir = tmp_path / "run"
    # max_policy_lag 2: a loaded machine slows the learner more than the workers, and at the default (8) the chunks
    # it trained on grew stale enough that one CI run ended at 143 (the same seed reaches ~380 on an idle machine).
    proc = _train(run_dir, "--actors", "2", "--total-timesteps", "30000", "--max-policy-lag", "2")
    kids: list[int] = []
    while proc.poll() is None:  # the workers, while they live
        try:
            kids = sorted(set(kids) | set(_actor_pids(psutil.Process(proc.pid))))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    rows = _rows(run_dir)
    for col in LAG_COLUMNS:
        assert col in rows[0], col
    returns = [float(r[S.EPISODIC_RETURN]) for r in rows if r[S.EPISODIC_RETURN] not in ("", "nan")]
    last = [x for x in returns[-10:] if not math.isnan(x)]
    # Seed 1: ~380 at 30k steps (the synchronous loop: ~200); a policy that learned nothing stays near 20.
    assert sum(last) / len(last) > 150, last
    lags = [float(r[S.POLICY_LAG]) for r in rows]
    assert 0 <= min(lags) and max(lags) <= 2  # max_policy_lag: nothing older is trained on
    assert len(kids) == 2 and _gone(kids, 1.0)


def _pool(tmp_path, **fields):
    """A learner's ActorPool over real CartPole workers, built as the trainer builds it."""
    from ppokit.training.build import build

    cfg = load_preset("cartpole", PPOConfig())
    for k, v in {"actors": 1, "run_dir": str(tmp_path / "unused"), **fields}.items():
        setattr(cfg, k, v)
    parts = build(cfg)
    parts.collector.reset(cfg.seed)
    return parts


def test_a_chunk_older_than_max_policy_lag_is_dropped_and_counted(tmp_path):
    parts = _pool(tmp_path, max_policy_lag=3)
    pool, policy = parts.collector, parts.policy
    try:
        pool.publish(policy, 0)
        pool.collect(0)
        assert int(pool.buffer.policy_version.max()) == 0 and pool.dropped == 0
        time.sleep(1.5)  # the worker fills the queue with version-0 chunks and waits to hand over the next
        pool.publish(policy, 4)  # 4 versions ahead of every queued chunk: more than max_policy_lag
        pool.collect(0)
        assert pool.dropped >= 1
        assert int(pool.buffer.policy_version.min()) == 4  # what was kept was acted by the new weights
        frac = pool.diagnostics()[S.DROPPED_CHUNKS_FRAC]
        assert frac == pool.dropped / (pool.dropped + 2)
        pids = [p.pid for p in pool.workers.values()]
    finally:
        pool.close()
        parts.envs.close()
    assert _gone(pids, 1.0)


def test_the_learner_normalizes_with_every_chunks_observations_dropped_ones_included(tmp_path):
    parts = _pool(tmp_path, max_policy_lag=0, normalize_obs=True)
    pool, policy = parts.collector, parts.policy
    try:
        pool.publish(policy, 0)
        pool.collect(0)
        time.sleep(1.5)
        pool.publish(policy, 1)
        pool.collect(0)
    finally:
        pool.close()
        parts.envs.close()
    rows = pool.num_steps * pool.num_envs
    assert pool.dropped >= 1
    # Each chunk adds the observation after each of its steps to its worker's statistics; the learner merges them.
    assert float(parts.obs_norm.state_dict()["count"]) == (pool.taken + pool.dropped) * rows
    assert 0 < float(parts.obs_norm.state_dict()["var"].min())


def test_lag_within_max_policy_lag_is_trained_on(tmp_path):
    parts = _pool(tmp_path, max_policy_lag=8)
    pool, policy = parts.collector, parts.policy
    try:
        pool.publish(policy, 0)
        pool.collect(0)
        time.sleep(1.0)
        pool.publish(policy, 8)  # exactly max_policy_lag ahead: still kept
        pool.collect(0)
        assert pool.dropped == 0 and int(pool.buffer.policy_version.min()) == 0
    finally:
        pool.close()
        parts.envs.close()


# One env: the scalar loop (rollout/one_env.py); three: the vector one. "kernel": acting with the fused path's
# acting kernel, as a worker of a fused learner does (it must see weights loaded in place mid-chunk).
@pytest.mark.parametrize("num_envs,acting", [(1, "eager"), (3, "eager"), (1, "kernel"), (3, "kernel")])
def test_weights_published_mid_chunk_act_from_the_next_step_on(num_envs, acting):
    # A worker picks up weights published while it steps its chunk (Sample Factory's way of keeping the lag
    # low): the steps from the publish on are acted by, and recorded as, the new version, with its log-probs;
    # the chunk's version (what max_policy_lag drops by) stays its oldest.
    from ppokit.kernels.acting import ActingKernel
    from ppokit.policies import config_policy
    from ppokit.rollout.actors import RolloutWorker, _Shared

    torch.set_num_threads(1)
    cfg = load_preset("cartpole", PPOConfig())
    cfg.num_envs, cfg.num_steps = num_envs, 40
    worker = RolloutWorker(0, cfg, seed=3, acting_type=ActingKernel if acting == "kernel" else None)
    try:
        space = worker.envs.single_observation_space, worker.envs.single_action_space
        old, new = config_policy(*space, cfg), config_policy(*space, cfg)
        with torch.no_grad():  # another policy: its log-probs of the same actions differ
            for p in new.actor.parameters():
                p.add_(0.5 * torch.randn_like(p))
        shared = _Shared(torch.multiprocessing.get_context("spawn"), old, None)
        shared.push(old, None, 0)
        worker.version = shared.pull(worker.policy, None, worker.version)
        worker.follow(lambda policy, have: shared.pull(policy, None, have))
        follow = worker.collector.refresh

        def publish_at_step_25(t: int) -> None:
            if t == 25:
                shared.push(new, None, 1)
            follow(t)

        worker.collector.refresh = publish_at_step_25
        chunk = worker.chunk()
    finally:
        worker.close()
    fields = chunk["fields"]
    assert chunk["version"] == 0 and worker.version == 1
    assert (fields["policy_version"][:25] == 0).all() and (fields["policy_version"][25:] == 1).all()
    obs, actions = fields["obs"].flatten(0, 1), fields["actions"].flatten(0, 1)
    with torch.no_grad():
        by_old = old.evaluate(obs, actions)[0].reshape(40, num_envs)
        by_new = new.evaluate(obs, actions)[0].reshape(40, num_envs)
    torch.testing.assert_close(fields["logp"][:25], by_old[:25])
    torch.testing.assert_close(fields["logp"][25:], by_new[25:])
    assert not torch.allclose(by_old[25:], by_new[25:], atol=1e-3)


def _one_chunk(tmp_path):
    """``(pool, policy)`` after one chunk of a real worker acting with the learner's weights (workers stopped)."""
    parts = _pool(tmp_path)
    pool, policy = parts.collector, parts.policy
    try:
        pool.publish(policy, 0)
        pool.collect(0)
    finally:
        pool.close()
        parts.envs.close()
    return pool, policy


def test_vtrace_targets_use_the_current_policy(tmp_path):
    # The learner's values replace the behaviour's; on-policy (weights unchanged) with lambda = 1 the targets are
    # the chunk's n-step returns, GAE(1)'s.
    from ppokit.core.advantages import gae
    from ppokit.rollout.actors import vtrace_targets

    pool, policy = _one_chunk(tmp_path)
    buf = pool.buffer
    behaviour_values = buf.values.clone()
    with torch.no_grad():
        for p in policy.critic.parameters():
            p.add_(0.1)
    adv, ret = vtrace_targets(policy, buf, pool.last_obs, 0.98, 1.0)
    assert not torch.allclose(buf.values, behaviour_values)
    with torch.no_grad():
        boot = policy.value(pool.last_obs)
    _, ref = gae(buf.rewards, buf.values, buf.next_values(boot), buf.terminated, buf.truncated, 0.98, 1.0)
    torch.testing.assert_close(ret, ref)


@pytest.mark.parametrize("proximal", [False, True])
def test_the_surrogate_is_clipped_against_actor_clips_policy_and_rho_weighs_the_advantage(tmp_path, proximal):
    # A lagged chunk (the learner's actor moved since the worker acted). proximal: after vtrace_targets the
    # ratio's denominator is the learner's pre-update policy (the first ratio of the update is exactly 1, so the
    # clip bounds this update's step, not the lag); behaviour: the log-probs that acted stay. Either way the
    # behaviour correction is in the advantages, V-trace's rho_t = min(1, pi/mu) times its TD error.
    from ppokit.core.vtrace import vtrace
    from ppokit.rollout.actors import vtrace_targets

    pool, policy = _one_chunk(tmp_path)
    buf = pool.buffer
    behaviour = buf.logp.clone()
    with torch.no_grad():
        for p in policy.actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
        current, _, _ = policy.evaluate(buf.obs.flatten(0, 1), buf.actions.flatten(0, 1))
        current = current.reshape(behaviour.shape)
    assert not torch.allclose(current, behaviour, atol=1e-3)  # lagged: the ratios to the behaviour are not 1
    adv, ret = vtrace_targets(policy, buf, pool.last_obs, 0.98, 0.95, proximal=proximal)
    torch.testing.assert_close(buf.logp, current if proximal else behaviour)
    with torch.no_grad():
        boot = policy.value(pool.last_obs)
    ref_ret, ref_adv = vtrace(behaviour, current, buf.rewards, buf.values, buf.next_values(boot), buf.terminated,
                              buf.truncated, 0.98, 0.95)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)


def test_a_masked_env_trains_with_actors_on_its_masks(tmp_path):
    # GridWorld with walls: the masks travel in each chunk, and a policy acting on them never bumps a wall; the
    # preset's 8192 steps reach the registered return threshold as the synchronous loop does (test_masking.py).
    from ppokit.envs import GRIDWORLD_WALLS_ID
    from ppokit.training.trainer import train

    cfg = load_preset("gridworld")
    cfg.env_id, cfg.seed, cfg.total_timesteps, cfg.actors, cfg.tensorboard = GRIDWORLD_WALLS_ID, 1, 8192, 1, False
    run = train(cfg, run_dir=tmp_path / "r", console_enabled=False)
    returns = [m[S.EPISODIC_RETURN] for m in run.metrics if not math.isnan(m[S.EPISODIC_RETURN])]
    assert returns[-1] >= 0.93


@pytest.mark.parametrize("fields,what", [({"capture_video": True}, "video"), ({"actors": -1}, "integer")])
def test_what_actors_do_not_support_is_refused_in_one_line(fields, what):
    cfg = PPOConfig(actors=2)
    for k, v in fields.items():
        setattr(cfg, k, v)
    with pytest.raises(ConfigError, match="actors") as info:
        cfg.validate()
    assert what in str(info.value) and "\n" not in str(info.value)


def test_a_custom_env_factory_is_refused(tmp_path):
    import gymnasium as gym

    from ppokit.training.trainer import train

    with pytest.raises(ConfigError, match="custom env"):
        train(PPOConfig(actors=1, total_timesteps=256), run_dir=tmp_path / "r", env=lambda: gym.make("CartPole-v1"),
              console_enabled=False)




# ---------------------------------------------------------------------------------------- faults
def test_a_worker_that_raises_in_its_third_chunk_is_named_replaced_and_the_run_finishes(tmp_path, capfd):
    from ppokit.training.trainer import train

    sys.path.insert(0, str(Path(__file__).parent))  # the workers import actor_faults as the env id says
    flag = tmp_path / "raised"
    cfg = load_preset("cartpole", PPOConfig())
    cfg.env_id = "actor_faults:RaisingCartPole-v0"
    cfg.env_kwargs = {"flag": str(flag), "raise_after": 2 * cfg.num_steps}
    cfg.actors, cfg.total_timesteps, cfg.tensorboard = 2, 5000, False
    run = train(cfg, run_dir=tmp_path / "run", console_enabled=False)
    assert flag.exists() and run.global_step >= 4096
    pid = int(flag.read_text())
    lines = [line for line in capfd.readouterr().err.splitlines() if f"(pid {pid}) died" in line]
    assert len(lines) == 1 and "injected fault in the third chunk" in lines[0], lines
    assert run.metrics[-1][S.ACTOR_REPLACEMENTS] == 1.0
    assert _gone([pid], 1.0)


def test_a_worker_whose_env_hangs_past_env_timeout_is_named_replaced_and_the_run_finishes(tmp_path, capfd):
    from ppokit.training.trainer import train

    sys.path.insert(0, str(Path(__file__).parent))  # the workers import actor_faults as the env id says
    flag = tmp_path / "hung"
    cfg = load_preset("cartpole", PPOConfig())
    cfg.env_id = "actor_faults:HangingCartPole-v0"
    cfg.env_kwargs = {"flag": str(flag), "hang_after": 2 * cfg.num_steps}
    # 40k steps (~10 s here, ~4k steps a second): the other worker alone must not end the run before the limit.
    cfg.actors, cfg.total_timesteps, cfg.tensorboard, cfg.env_timeout = 2, 40960, False, 2.0
    t0 = time.monotonic()
    run = train(cfg, run_dir=tmp_path / "run", console_enabled=False)
    assert flag.exists() and run.global_step >= 40960
    pid = int(flag.read_text())
    lines = [line for line in capfd.readouterr().err.splitlines() if f"(pid {pid}) died" in line]
    assert len(lines) == 1 and "did not return within 2 s" in lines[0] and "replaced by" in lines[0], lines
    assert run.metrics[-1][S.ACTOR_REPLACEMENTS] == 1.0
    assert _gone([pid], 1.0)
    assert time.monotonic() - t0 < 100  # not the 3600 s sleep: the hang was cut at ~2 s


def _wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _running(tmp_path, *flags: str) -> tuple[subprocess.Popen, Path, list[int]]:
    """A CLI run with two actors, once both workers are up and a checkpoint is written."""
    run_dir = tmp_path / "run"
    proc = _train(run_dir, "--actors", "2", "--total-timesteps", "2000000", "--save-every", "5", *flags)
    pids = _wait_for(lambda: (len(p := _actor_pids(psutil.Process(proc.pid))) == 2 and p), 60, "two actors")
    _wait_for(lambda: (run_dir / "checkpoint.pt").exists(), 60, "a checkpoint")
    return proc, run_dir, pids


def test_a_stopped_worker_and_a_killed_one_mid_run_are_named_and_replaced(tmp_path):
    # One actor, so that every chunk so far is its own (a worker still in its first chunk has 60 s more): stopped
    # (SIGSTOP: alive, silent, as one hung outside an env call), it is ended by --actor-timeout; its replacement,
    # once it has sent chunks too, is killed -9 and noticed by its exit. Each named once, in one run.
    run_dir = tmp_path / "run"
    proc = _train(run_dir, "--actors", "1", "--total-timesteps", "61440", "--actor-timeout", "3")
    try:
        def rows() -> int:
            return len(_rows(run_dir)) if (run_dir / "metrics.csv").exists() else 0

        def actor() -> list[int]:
            return _actor_pids(psutil.Process(proc.pid))

        stopped = _wait_for(lambda: rows() > 3 and actor(), 60, "a few updates")[0]
        os.kill(stopped, signal.SIGSTOP)
        killed = _wait_for(lambda: [p for p in actor() if p != stopped], 60, "the stopped worker's replacement")[0]
        seen = rows()
        _wait_for(lambda: rows() > seen + 3, 60, "updates on the replacement's chunks")
        os.kill(killed, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    named = [line for line in err.splitlines()
             if f"(pid {stopped}) died: sent no chunk in 3 s (actor_timeout); killed; replaced" in line]
    assert len(named) == 1, err[-2000:]
    named = [line for line in err.splitlines() if f"(pid {killed}) died: killed by SIGKILL; replaced" in line]
    assert len(named) == 1, err[-2000:]
    assert float(_rows(run_dir)[-1][S.ACTOR_REPLACEMENTS]) == 2.0
    assert _gone([killed, stopped], 1.0)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_stop_learner_and_workers_in_bounded_time_with_a_checkpoint(tmp_path, sig):
    proc, run_dir, pids = _running(tmp_path)
    try:
        # Ctrl-C at a terminal reaches the whole process group: the workers ignore it, the learner stops them.
        os.killpg(os.getpgid(proc.pid), sig) if sig == signal.SIGINT else proc.send_signal(sig)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert took < 20, took
    assert _gone(pids, 1.0)
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert state["update"] == len(_rows(run_dir))  # the checkpoint holds the last logged update


def test_workers_die_with_a_killed_learner_and_resume_starts_fresh_ones(tmp_path):
    proc, run_dir, pids = _running(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert _gone(pids, 5.0), "a worker outlived its learner"
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)["global_step"]
    resumed = subprocess.run([sys.executable, "-m", "ppokit", "train", "--resume", str(run_dir), "--total-timesteps",
                              str(saved + 2048), "--quiet"], env=_env(), capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert after["global_step"] >= saved + 2048 and after["config"]["actors"] == 2
