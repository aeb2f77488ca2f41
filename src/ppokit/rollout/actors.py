"""Decoupled rollout workers (``--actors K``): IMPALA's actor-learner split (Espeholt et al. 2018) on one machine.

``ActorPool`` is a ``RolloutSource`` (``source.py``): K worker processes (torch.multiprocessing, spawn, one torch
thread each) each build their own ``num_envs`` envs the way the trainer does and a copy of the policy, and run a
plain ``collector.Collector`` over them, chunk after chunk of ``num_steps`` steps. Each chunk (every rollout
field, the bootstrap observation, finished episodes, the acting policy version) goes to the learner through the
worker's own multiprocessing queue; torch moves its tensors into shared memory. Before each step a worker reads
the published version counter and, when it changed, loads the newest weights (a shared-memory state_dict), so the
steps of a chunk after a publish act with, and record, the new version (``RolloutWorker.follow``; Sample
Factory's policy workers likewise take new weights as soon as they are published). With one actor on Hopper
this cut the mean lag from 1 to 0.26 versions. The normalizer statistics are loaded between chunks only.

Nothing a worker can die holding is shared with the others: a process killed inside a lock's critical section
leaves the lock taken forever. So the weights are published under a sequence count, not a lock (the learner, the
only writer, makes it odd while it writes; a worker whose copy saw it odd or changed copies again), and each
worker hands its chunks over through a queue of its own (a queue's write lock is held by whichever process is
sending; a shared one, with a worker killed mid-send, once left the learner waiting forever in a test). A
replaced worker's queue is dropped with it.

The learner takes one chunk per update into its ``[T, N]`` buffer, dropping (and counting) those more than
``max_policy_lag`` versions old; ``vtrace_targets`` then gives the update V-trace targets and APPO's advantages
``rho_t (r_t + gamma vs_{t+1} - V(x_t))`` under the CURRENT policy, ``rho_t = min(1, pi/mu)`` carrying the
behaviour correction, and the usual PPO epochs run with the surrogate clipped against ``actor_clip``'s policy:

- ``behaviour`` (the default; APPO's first form): the log-probs frozen in the chunk, so ``diag/clipfrac`` and
  ``diag/approx_kl`` include the lag, and the clip bounds the drift from the weights that acted;
- ``proximal``: the learner's policy at the start of the update (Hilton et al. 2021, "Batch size-invariance for
  policy optimization"; RLlib's APPO clips against its target network likewise), whose log-probs replace the
  behaviour's in the buffer: the first ratio of every update is 1 and the clip bounds this update's step.

How it learns, measured (``bench_actors.py --curves``, mean training return, benchmarks/RESULTS.md). Hopper
(mujoco preset, ``proximal``), last 20k of 200k steps over 6 seeds, with mid-chunk weights: synchronous 1,293
(seeds 687-1,929), one actor 1,106, two actors 800; actors kept in lockstep with the learner (lag 0, a check) gave
1,145, so the actor path itself learns as the loop does and the gap is the lag. Before mid-chunk weights (lag 1,
3 seeds) one actor's ``behaviour`` clip fraction was 0.28 against 0.03 synchronous: a whole update back, most
samples start at the clip's edge, hence ``proximal`` in the mujoco preset. CartPole (cartpole preset), 100k steps:
both 500 by 50k steps with ``behaviour`` (faster than the synchronous loop's 462 at 40k), so ``behaviour`` stays
the default.

Observation normalization stays one set of statistics, the learner's: each worker normalizes with the published
statistics and ships the moments of the observations it added (``normalize.split_moments``), which the learner
merges in (``merge_moments``), dropped chunks included. Reward scaling is per env, hence per worker.

Faults: a worker that raises reports it and exits, an env call of its that hangs past ``env_timeout`` included
(each worker runs the synchronous loop's watchdog, ``envs.watchdog``); one that dies otherwise (kill -9) is
noticed within ``POLL_S``; one that sends no chunk for ``actor_timeout`` seconds (hung elsewhere, or stopped;
RLlib's ``sample_timeout_s``) is killed; each is named in one line on stderr and replaced by a fresh worker (new env seeds), counted in
``diag/actor_replacements``. Workers ignore Ctrl-C (the learner finishes its update and stops them) and die with
the learner (``die_with_parent``). Not supported yet, refused by the config: capture_video, a CUDA learner; by
``build``: data-parallel ranks and a custom env or policy factory (a worker must rebuild them). A truncated
episode's bootstrap V(final obs) is the behaviour policy's (the worker computes it at acting time).

A recurrent policy (``--recurrent lstm|gru``, issue 19): the worker's collector stores, per env and step, the
state passed into act and the ``episode_start`` flags act saw (``RolloutBuffer.record_state``), and they travel
in the chunk with the other fields, with the state after the chunk (``last_state``). The learner replays each
env's chunk as the synchronous loop replays its rollout: in sequences of ``recurrent_seq_len`` steps (0: the
whole chunk), each from the state stored at its first step, reset at every episode start, padding masked out
(``current_logp_values`` for V-trace, ``RolloutBuffer.sequences`` for the epochs); V(last_obs) is stepped from
``last_state``. With the worker's weights the replay gives the worker's log-probs (the first ratio is 1). A
replaced worker, and every worker of a resumed run, starts its envs afresh: their states at zero, each step an
episode start, as at any reset (the learner's checkpoint holds no worker's state).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

from ppokit.core.batch import chunk_starts, chunk_steps, flatten_steps, tree_copy_, tree_map, unchunk_steps
from ppokit.core.schema import PERF_PHASES
from ppokit.core.vtrace import vtrace
from ppokit.envs.errors import EnvError, env_failure
from ppokit.envs.watchdog import EnvWatchdog, die_with_parent
from ppokit.rollout.buffer import ROLLOUT_FIELDS, RolloutBuffer
from ppokit.rollout.collector import Collector
from ppokit.rollout.normalize import merge_moments, split_moments

__all__ = ["ActorPool", "RolloutWorker", "actor_backend", "current_logp_values", "vtrace_targets", "POLL_S",
           "START_GRACE_S", "STOP_GRACE_S"]

# The learner looks at its workers at least this often while it waits for a chunk, so a kill -9 is noticed within
# it; a worker waiting to hand over a chunk looks at the stop flag as often.
POLL_S = 0.2
# A stopping worker finishes its chunk (Hopper: 2048 steps, ~1.5 s on this machine) and is killed after this.
STOP_GRACE_S = 5.0
# A worker's first chunk may take this much longer than actor_timeout: its start (spawn, imports, envs) takes ~2-5 s
# here, more on a loaded machine or a Ray node that is still installing.
START_GRACE_S = 60.0
# A worker that raised has put its report on the queue: this exit code says so (the learner then reads the report
# instead of guessing from the exit code).
_REPORTED = 3
# A worker finding a publish under way looks again after this; the learner, finding no chunk on any worker's queue,
# looks again after _IDLE_S (a chunk waits at most that long: ~0.1% of a 2 s CartPole update's wall time).
_PUBLISH_WAIT_S = 0.001
_IDLE_S = 0.002
# Replacements in a row with no chunk between them: the workers cannot run at all (an env that fails at once).
_MAX_FAILURES_IN_A_ROW = 3


def actor_backend(config: Any, pool: Any = None) -> Any:
    """The ``rollout=`` backend (``source.RolloutBackend``) of ``config.actors`` workers: ``pool`` (default
    ``ActorPool``, worker processes; ``ray_actors.RayActorPool``: Ray actors) built with Collector's arguments."""
    import multiprocessing

    if multiprocessing.parent_process() is not None and getattr(sys.modules.get("__main__"), "__name__",
                                                                 "") == "__mp_main__":
        # Python's spawn start method imports the starting script again in every worker.
        from ppokit.core.errors import ConfigError

        raise ConfigError("actors", "the script that trains runs again in each actor process: put its training "
                          "call under if __name__ == '__main__':")
    def backend(*args: Any, **kwargs: Any) -> ActorPool:
        return (pool or ActorPool)(*args, config=config, **kwargs)
    return backend


# ---------------------------------------------------------------------------------------- shared state
class _Shared:
    """What the learner and its workers share: the published weights and normalizer statistics (shared-memory
    tensors), their version and sequence count, and the stop flag (see the module docstring: no lock)."""

    def __init__(self, ctx: Any, policy: torch.nn.Module, obs_norm: Any):
        def shared(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", copy=True).share_memory_()
        self.weights = {k: shared(v) for k, v in policy.state_dict().items()}
        self.obs_stats = tree_map(shared, obs_norm.state_dict()) if obs_norm is not None else None
        self.version = ctx.Value("q", -1, lock=False)
        self.seq = ctx.Value("q", 0, lock=False)  # odd while the learner writes the weights
        # A flag in shared memory, not an Event: an Event's lock held by a worker that is stopped (SIGSTOP) or
        # killed while it looks would block every other worker and the learner's close() for good.
        self.stop = _Flag(ctx)

    def push(self, policy: torch.nn.Module, obs_norm: Any, version: int) -> None:
        """Publish the learner's weights (and statistics) as ``version``."""
        self.seq.value += 1
        with torch.no_grad():
            for k, v in policy.state_dict().items():
                self.weights[k].copy_(v)
            if obs_norm is not None:
                tree_copy_(self.obs_stats, obs_norm.state_dict())
        self.version.value = version
        self.seq.value += 1

    def pull(self, policy: torch.nn.Module, obs_norm: Any, have: int) -> int:
        """Load the newest published weights into a worker's ``policy`` if newer than ``have``; their version.
        A copy that overlapped a publish (the count odd, or changed by the end) is taken again."""
        while True:
            seq = self.seq.value
            if seq % 2:
                time.sleep(_PUBLISH_WAIT_S)
                continue
            version = int(self.version.value)
            if version == have:
                return have
            with torch.no_grad():
                policy.load_state_dict(self.weights)
                if obs_norm is not None:
                    obs_norm.load_state_dict(self.obs_stats)
            if self.seq.value == seq:
                return version


class _Flag:
    """A one-way flag every process may read without a lock (set once, by the learner)."""

    def __init__(self, ctx: Any):
        self._value = ctx.Value("b", 0, lock=False)

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return bool(self._value.value)


def _hand_over(q: Any, stop: Any, item: dict) -> bool:
    """Put ``item`` on the worker's queue ``q`` for the learner; False once the learner asked the workers to stop."""
    while not stop.is_set():
        try:
            q.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


# ---------------------------------------------------------------------------------------- the worker
def _rms_leaves(state: dict, path: tuple = ()) -> list[tuple[tuple, dict]]:
    """The ``RunningMeanStd`` states in a normalizer's state (one, or one per part of a Dict observation)."""
    if "count" in state:
        return [(path, state)]
    return [leaf for key in sorted(state) for leaf in _rms_leaves(state[key], path + (key,))]


def _worker_main(slot: int, pid_parent: int, cfg: Any, seed: int, shared: _Shared, q: Any,
                 acting_type: Any) -> None:
    """A rollout worker's process: chunks of ``cfg.num_steps`` steps until the learner says stop."""
    die_with_parent(pid_parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's: it finishes the update, then stops us
    torch.set_num_threads(1)
    # A chunk's tensors travel as named shared-memory files (torch's file_system strategy), which the learner opens
    # by name: with the default file-descriptor strategy it connects to this process to receive them, and waits
    # for good on a worker that is stopped (SIGSTOP) or hung. torch's shm manager unlinks the files of a killed
    # worker. The strategy is the sender's: the learner's own stays as it was. Measured side by side (bench_actors.py,
    # CartPole 50k steps, two sittings): --actors 1 in 9.2 and 9.6 s against 9.3 and 10.9 s with descriptors.
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        _act(slot, cfg, seed, shared, q, acting_type)
    except BaseException as exc:  # noqa: BLE001 - whatever it was, the learner names it in one line
        message = f"{type(exc).__name__}: {' '.join(str(exc).split()) or '(no message)'}"
        try:
            q.put({"kind": "error", "slot": slot, "pid": os.getpid(), "message": message}, timeout=5.0)
            q.close()
            q.join_thread()  # the report is in the pipe before the exit code says it is
        except Exception:  # noqa: BLE001 - the learner sees the exit code instead
            os._exit(1)
        os._exit(_REPORTED)
    q.cancel_join_thread()  # stopping: a chunk nobody will read must not hold the exit
    os._exit(0)


def _act(slot: int, cfg: Any, seed: int, shared: _Shared, q: Any, acting_type: Any) -> None:
    worker = RolloutWorker(slot, cfg, seed, acting_type)
    worker.follow(lambda policy, have: shared.pull(policy, None, have))  # the weights only, mid-chunk
    try:
        while not shared.stop.is_set():
            worker.version = shared.pull(worker.policy, worker.obs_norm, worker.version)
            if not _hand_over(q, shared.stop, worker.chunk()):
                break
    finally:
        worker.close()


class RolloutWorker:
    """One worker's envs, policy copy and ``Collector``; ``chunk()`` steps ``num_steps`` and returns the chunk.

    The process workers here and the Ray actors (``ray_actors.py``) both run it; they differ only in how the
    weights arrive (loaded into ``policy`` and ``obs_norm`` with their ``version`` before a chunk) and how the
    chunk leaves."""

    def __init__(self, slot: int, cfg: Any, seed: int, acting_type: Any = None):
        from ppokit.envs.encoders import observation_encoder
        from ppokit.envs.masks import action_masks_available
        from ppokit.envs.run_envs import make_train_envs
        from ppokit.policies import config_policy
        from ppokit.rollout.normalize import RewardScaler, make_obs_normalizer

        torch.manual_seed(seed)
        self.slot, self.cfg, self.version, self.step = slot, cfg, -1, 0
        self.envs = envs = make_train_envs(cfg)
        obs_space, act_space = envs.single_observation_space, envs.single_action_space
        self.policy = policy = config_policy(obs_space, act_space, cfg)
        if policy.kind != "continuous":  # masks sent only in info are seen at a first reset, as build() finds them
            action_masks_available(envs, seed, cfg.env_id)
        self.obs_norm = make_obs_normalizer(observation_encoder(obs_space)) if cfg.normalize_obs else None
        reward_scaler = RewardScaler(cfg.num_envs, cfg.gamma) if cfg.normalize_reward else None

        def fail(step: int, rollout_start: int, exc: BaseException | None = None,
                 detail: str | None = None) -> EnvError:
            return env_failure(cfg.env_id, "step()", step, exc, envs, detail)

        # The learner's kind of acting object: its acting kernel (kernels/acting.py; it sees load_state_dict through
        # the parameters' version counters) where the learner acts with one, else the eager policy.
        acting = policy if acting_type is None else acting_type(policy)
        self.collector = Collector(envs, policy, acting, num_steps=cfg.num_steps, device=torch.device("cpu"),
                                   env_id=cfg.env_id, obs_norm=self.obs_norm, reward_scaler=reward_scaler,
                                   perf=dict.fromkeys(PERF_PHASES, 0.0), fail=fail)
        # env_timeout bounds each env call here as in the synchronous loop (a hung call raises EnvTimeout, reported
        # like any error: the worker is named and replaced). Its SIGALRM needs the main thread, where a process
        # worker and a Ray actor (a synchronous actor runs its calls there, checked on Ray 2.60) both run this.
        self.collector.watchdog = EnvWatchdog(cfg.env_timeout)
        self.collector.watchdog.start()
        self.collector.reset(seed)
        envs.action_space.seed(seed)
        self.names = [f.name for f in ROLLOUT_FIELDS.fields() if self.collector.buffer.__dict__[f.name] is not None]

    def chunk(self) -> dict:
        """``num_steps`` steps of every env with the loaded weights: the chunk the learner takes."""
        cfg, collector, obs_norm = self.cfg, self.collector, self.obs_norm
        before = obs_norm.state_dict() if obs_norm is not None else None
        version = self.version  # the chunk's oldest weights (newer ones may act from a step on: collector.refresh)
        collector.publish(self.policy, version)
        episodes, nonfinite = collector.collect(self.step)
        self.step += cfg.num_steps * cfg.num_envs
        moments = None
        if obs_norm is not None:  # the moments of the observations this chunk added to the statistics
            after = dict(_rms_leaves(obs_norm.state_dict()))
            moments = [(path, *split_moments(old, after[path])) for path, old in _rms_leaves(before)]
        buf = collector.buffer
        # A stateful policy's state after the chunk (and whether the next obs starts an episode): the bootstrap
        # V(last_obs) is stepped from it, as the synchronous loop's from its live state (collector.bootstrap_values).
        # The state at each step of the chunk travels in the fields (policy_state, episode_start).
        last_state = None if collector.policy_state is None else (
            tree_map(torch.clone, collector.policy_state), torch.from_numpy(np.array(collector.episode_start,
                                                                                     dtype=bool)))
        return {"kind": "chunk", "slot": self.slot, "pid": os.getpid(), "version": version,
                "fields": {name: tree_map(torch.clone, buf.__dict__[name]) for name in self.names},
                "last_obs": tree_map(torch.clone, collector.last_obs), "last_state": last_state,
                "episodes": episodes, "life_episodes": list(collector.life_episodes), "nonfinite": nonfinite,
                "moments": moments}

    def follow(self, pull: Callable[[torch.nn.Module, int], int]) -> None:
        """Act with weights published mid-chunk from the next step on: before each step ``pull(policy, have)``
        loads weights newer than version ``have`` into ``policy`` and returns their version (``have`` if none),
        which the steps from there on record in ``policy_version``; the chunk's ``version`` stays its first, the
        oldest. The normalizer's statistics are loaded between chunks only: the moments a chunk ships are those
        it added to the statistics it started from."""
        def refresh(t: int) -> None:
            version = pull(self.policy, self.version)
            if version != self.version:
                self.version = version
                self.collector.buffer.policy_version[t:] = version

        self.collector.refresh = refresh

    def close(self) -> None:
        try:
            self.envs.close()
        finally:
            self.collector.watchdog.stop()


# ---------------------------------------------------------------------------------------- the learner's side
class ActorPool(Collector):
    """The learner's side of ``config.actors`` rollout workers (see the module docstring).

    It is a ``Collector`` over the learner's own (idle) envs for everything but the rollout: the buffer's layout,
    ``normalize``, the checkpoint's loop state. The workers start at the first ``publish``, with its weights.
    """

    stale = True  # a chunk may come from weights older than the last published

    def __init__(self, *args: Any, config: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.config = config
        self.ctx = torch.multiprocessing.get_context("spawn")
        self.workers: dict[int, Any] = {}  # slot -> Process
        self.queues: dict[int, Any] = {}  # slot -> its worker's chunk queue
        self._next_slot = 0  # where the next look for a chunk starts: the workers take turns
        self.starts = 0  # workers started so far (each gets its own env seeds)
        self.replacements = self.dropped = self.taken = self.lost = 0  # lost: chunks of workers that died
        self._failures_in_a_row = 0
        self.asked_at: dict[int, float] = {}  # slot -> when its worker's current chunk was asked for (actor_timeout)
        self._seed = config.seed
        self._shared: _Shared | None = None
        self._fields = {f.name for f in ROLLOUT_FIELDS.fields() if self.buffer.__dict__[f.name] is not None}
        self.last_state: tuple[Any, torch.Tensor] | None = None  # the last chunk's (see collect)

    # ------------------------------------------------------------------ the source's side of the learner
    def reset(self, seed: int) -> None:
        """The learner's own envs (the checkpoint's loop state); the workers' envs are seeded from ``seed``."""
        super().reset(seed)
        self._seed = seed

    def publish(self, weights: Any, version: int) -> None:
        """Publish the weights of update ``version`` to the workers (the first call starts them)."""
        self.policy_version = version
        if self._shared is None:
            self._shared = _Shared(self.ctx, weights, self.obs_norm)
            self._shared.push(weights, self.obs_norm, version)
            for slot in range(self.config.actors):
                self._start(slot)
            return
        self._shared.push(weights, self.obs_norm, version)

    def collect(self, global_step: int) -> tuple[list, int]:
        """Wait for the next chunk recent enough to train on, and copy it into the buffer."""
        t0 = time.perf_counter()
        cfg = self.config
        while True:
            item = self._next_item()
            if item["kind"] == "error":
                self._replace(item["slot"], item["pid"], item["message"])
                continue
            self._failures_in_a_row = 0
            self._merge_moments(item["moments"])
            if self.policy_version - item["version"] > cfg.max_policy_lag:
                self.dropped += 1
                continue
            break
        self.taken += 1
        buf: RolloutBuffer = self.buffer
        if set(item["fields"]) != self._fields:  # e.g. a worker's env sends masks, the learner's does not
            raise EnvError(f"actor {item['slot']} sent a chunk with fields {sorted(item['fields'])}, the learner's "
                           f"buffer has {sorted(self._fields)}: its envs differ from the learner's")
        for name, value in item["fields"].items():
            tree_copy_(buf.__dict__[name], value)
        self.last_obs = tree_map(lambda t: t.to(self.device), item["last_obs"])
        # (state [N, ...], episode_start [N]) after the chunk, a stateful policy's; None for a stateless one.
        self.last_state = item["last_state"]
        self.life_episodes = item["life_episodes"]
        self.perf["env"] += time.perf_counter() - t0  # the learner's wait for its actors
        return item["episodes"], item["nonfinite"]

    def diagnostics(self) -> dict[str, float]:
        """The actors' side of the update's metrics (``core.schema.STALE_SOURCE_METRICS``)."""
        from ppokit.core import schema as S

        seen = self.dropped + self.taken
        return {S.DROPPED_CHUNKS_FRAC: self.dropped / seen if seen else 0.0,
                S.ACTOR_REPLACEMENTS: float(self.replacements)}

    def close(self) -> None:
        """Stop every worker (bounded by ``STOP_GRACE_S``, then killed); idempotent."""
        shared, self._shared = self._shared, None
        if shared is None:
            return
        shared.stop.set()
        deadline = time.monotonic() + STOP_GRACE_S
        for slot, proc in self.workers.items():
            while proc.is_alive() and time.monotonic() < deadline:
                _drain(self.queues[slot])  # a worker blocked handing over a chunk sees the stop flag
                proc.join(timeout=POLL_S)
        for proc in self.workers.values():
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1.0)
        for q in self.queues.values():
            _close(q)
        self.workers.clear()
        self.queues.clear()

    # ------------------------------------------------------------------ workers
    def _worker_seed(self, slot: int) -> int:
        """The env seed of the next worker started in ``slot``: every worker ever started gets envs seeded apart
        from every other's, seed + i for env i of start s."""
        cfg = self.config
        return self._seed + (1 + self.starts) * cfg.num_envs * 1000 + slot * cfg.num_envs

    def _acting_type(self) -> Any:
        """Acting as the learner acts: with its acting kernel's class (the fused path's), else the eager policy."""
        return None if self.acting is self.policy else type(self.acting)

    def _start(self, slot: int) -> None:
        seed = self._worker_seed(slot)
        self.starts += 1
        old = self.queues.pop(slot, None)
        if old is not None:  # the dead worker's queue (its report, if any, was read): dropped with it
            _close(old)
        self.queues[slot] = q = self.ctx.Queue(maxsize=1)
        proc = self.ctx.Process(target=_worker_main, args=(slot, os.getpid(), self.config, seed, self._shared, q,
                                                           self._acting_type()),
                                name=f"ppokit-actor-{slot}", daemon=False)  # daemon=False: async envs start children
        proc.start()
        self.workers[slot] = proc
        self.asked_at[slot] = time.monotonic() + START_GRACE_S

    # What a transport does to a dead worker's slot (the process pool here, the Ray pool in ray_actors.py).
    def _current(self, slot: int, pid: int | None) -> bool:
        """Whether ``pid`` is still ``slot``'s worker (a death is reported once, by the first who sees it)."""
        proc = self.workers.get(slot)
        return proc is not None and proc.pid == pid

    def _retire(self, slot: int) -> None:
        """Make sure ``slot``'s dead worker is gone."""
        proc = self.workers[slot]
        proc.join(timeout=STOP_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=1.0)

    def _who(self, pid: int | None) -> str:
        """How the stderr lines name a worker."""
        return f"pid {pid}"

    def _describe(self, slot: int) -> str:
        """How the stderr lines name ``slot``'s worker just started."""
        return self._who(self.workers[slot].pid)

    def _replace(self, slot: int, pid: int | None, why: str) -> None:
        if not self._current(slot, pid):
            return  # already replaced
        self._retire(slot)
        self._failures_in_a_row += 1
        if self._failures_in_a_row > _MAX_FAILURES_IN_A_ROW * self.config.actors:
            raise EnvError(f"actor {slot} ({self._who(pid)}) died: {why}; {self._failures_in_a_row} workers in a row "
                           "died before any chunk arrived, so the actors cannot run; check the env with --actors 0 (a "
                           "script needs its training call under if __name__ == '__main__')")
        self._start(slot)
        self.replacements += 1
        line = (f"ppokit: actor {slot} ({self._who(pid)}) died: {why}; replaced by {self._describe(slot)} "
                f"({self.replacements} replaced so far)\n")
        sys.stderr.write(line)
        sys.stderr.flush()

    def _overdue(self) -> list[int]:
        """The slots whose worker has taken more than ``actor_timeout`` seconds over its current chunk."""
        limit, now = self.config.actor_timeout, time.monotonic()
        return [slot for slot, t in self.asked_at.items() if limit and now - t > limit]

    def _timed_out(self) -> str:
        """The reason told for a worker killed by ``actor_timeout``."""
        return f"sent no chunk in {self.config.actor_timeout:g} s (actor_timeout); killed"

    def _check_workers(self) -> None:
        for slot, proc in list(self.workers.items()):
            code = proc.exitcode
            if code is None and slot in self._overdue() and self.queues[slot].empty():
                proc.kill()  # hung outside an env call (those raise after env_timeout) or stopped: no grace
                proc.join(timeout=STOP_GRACE_S)
                self._replace(slot, proc.pid, self._timed_out())
                continue
            if code is None or code == _REPORTED:  # alive, or its report is on the queue
                continue
            why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            self._replace(slot, proc.pid, why)

    def _next_item(self) -> dict:
        """The next chunk or error report on any worker's queue, the workers taking turns."""
        deadline = time.monotonic()  # the workers are looked at first, then every POLL_S
        while True:
            if time.monotonic() >= deadline:
                self._check_workers()
                deadline = time.monotonic() + POLL_S
            slots = sorted(self.queues)
            for i in range(len(slots)):
                slot = slots[(self._next_slot + i) % len(slots)]
                try:
                    item = self.queues[slot].get_nowait()
                except queue.Empty:
                    continue
                except (ConnectionError, EOFError, OSError):
                    # A chunk whose worker died as it sent it (its shared-memory files gone with it: see
                    # _worker_main) is lost with it. The death is noticed by _check_workers.
                    self.lost += 1
                    continue
                self._next_slot = (self._next_slot + i + 1) % len(slots)
                self.asked_at[slot] = time.monotonic()  # the worker, free to put again, steps its next chunk
                return item
            time.sleep(_IDLE_S)

    def _merge_moments(self, moments: list | None) -> None:
        """Merge a chunk's observation moments into the learner's statistics (published with the next weights)."""
        if not moments or self.obs_norm is None:
            return
        state = self.obs_norm.state_dict()
        leaves = dict(_rms_leaves(state))
        for path, n, mean, var in moments:
            if n > 0:
                rms = leaves[path]
                rms["count"], rms["mean"], rms["var"] = merge_moments(rms["count"], rms["mean"], rms["var"], n,
                                                                      mean, var)
        self.obs_norm.load_state_dict(state)


def _close(q: Any) -> None:
    _drain(q)
    q.close()
    q.cancel_join_thread()


def _drain(q: Any) -> None:
    try:
        while True:
            q.get_nowait()
    except (queue.Empty, OSError, ValueError, EOFError):
        return


# ---------------------------------------------------------------------------------------- V-trace
def current_logp_values(policy: Any, buffer: RolloutBuffer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, values)`` ``[T, N]`` of the chunk's actions under ``policy``. A stateless policy evaluates the steps
    as rows; a stateful one replays each env's steps in order as the update's sequence minibatches do
    (``RolloutBuffer.sequences``: chunks of ``seq_len`` steps, each from the state its worker stored at the chunk's
    first step, reset at every episode start), so with the worker's weights it gives the worker's numbers."""
    T, N = buffer.rewards.shape
    if buffer.policy_state is None:
        masks = None if buffer.masks is None else flatten_steps(buffer.masks)
        logp, _, values = policy.evaluate(flatten_steps(buffer.obs), flatten_steps(buffer.actions),
                                          action_mask=masks)
        return logp.reshape(T, N), values.reshape(T, N)
    masks = None if buffer.masks is None else chunk_steps(buffer.masks, seq_len)
    # The padding past step T - 1 (zeros) comes after every kept step of its chunk and is dropped on the way back.
    logp, _, values = policy.evaluate_sequence(chunk_steps(buffer.obs, seq_len), chunk_steps(buffer.actions, seq_len),
                                               chunk_starts(buffer.policy_state, seq_len),
                                               chunk_steps(buffer.episode_start, seq_len), masks)
    return unchunk_steps(logp, T), unchunk_steps(values, T)


def vtrace_targets(policy: Any, buffer: RolloutBuffer, last_obs: Any, gamma: float, lam: float,
                   seq_len: int | None = None, last_state: tuple[Any, torch.Tensor] | None = None,
                   proximal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[T, N]`` of a chunk under the current ``policy``: V-trace targets as returns,
    APPO's ``rho_t (r_t + gamma vs_{t+1} - V(x_t))`` as advantages (``core.vtrace``), with ``lam`` on the traces.
    ``buffer.values`` becomes the current policy's V(x_t) (the value loss and its clipping start from it); with
    ``proximal`` (``actor_clip``), ``buffer.logp`` becomes its log-probs too (the surrogate is then clipped against
    the policy the update starts from), else the behaviour's stay the surrogate's denominator. A stateful policy replays the chunk
    in sequences of ``seq_len`` steps (default: the whole chunk; ``current_logp_values``) and bootstraps from
    ``last_state``, the worker's ``(state, episode_start)`` after the chunk."""
    T, N = buffer.rewards.shape
    with torch.inference_mode():
        logp, values = current_logp_values(policy, buffer, seq_len or T)
        buffer.values.copy_(values)
        if buffer.policy_state is None:
            last_values = policy.value(last_obs)
        else:
            if last_state is None:
                raise ValueError("vtrace_targets: a stateful policy's chunk needs the worker's last_state")
            last_values = policy.value(last_obs, *last_state)
        next_values = buffer.next_values(last_values)
        vs, advantages = vtrace(buffer.logp, logp, buffer.rewards, buffer.values, next_values,
                                buffer.terminated, buffer.truncated, gamma, lam)
        if proximal:  # the surrogate's denominator: see the module docstring
            buffer.logp.copy_(logp)
    return advantages, vs
