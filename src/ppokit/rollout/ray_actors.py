"""``--actors K --ray-address ADDR``: the rollout workers of ``actors.py`` as Ray actors (extra ``ray``).

Ray is the engine RLlib, verl and OpenRLHF distribute with; ppokit writes no cluster manager. ``RayActorPool`` is
``actors.ActorPool`` with another transport: each of the K workers is a Ray actor (one CPU each, placed by Ray on
any node of the cluster, so K may exceed this machine's cores) running the same ``RolloutWorker``. The learner
keeps one chunk request in flight per actor; each request carries the newest published weights (one
``ray.put`` per update, shared by every request) and the actor loads them before its chunk when they are newer.
Everything after the chunk arrives (the lag check, the statistics, V-trace, the update) is ``ActorPool``'s.

``ADDR``: ``auto`` (the cluster this machine belongs to, ``ray start --head`` first), ``HOST:PORT`` or
``ray://HOST:PORT``, or ``local`` (start a one-machine Ray here for the run; every process of it ends with the run,
however the run ends: runtime/reaper.py). Under a driver that already called ``ray.init`` the address is not used. An actor that raises or is lost (its process or node) is named in one line
and replaced, as a process worker is (a lost node's actor with the id of its node). Every node needs ppokit and
the env's packages installed. Tested on ``local`` and on a three-node ``ray start`` cluster on 127.0.0.1 (actors on
two nodes, the cluster left up, a worker node's raylet killed -9 mid-run): tests/test_ray_actors.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from typing import Any

import torch

from ppokit.core.errors import ConfigError
from ppokit.rollout.actors import POLL_S, START_GRACE_S, ActorPool, RolloutWorker, actor_backend
from ppokit.runtime.reaper import Reaper

__all__ = ["RayActorPool", "ray_backend", "require_ray"]

_REMOTE: list[Any] = []  # the Ray actor class of _RayWorker, made once per process


def require_ray() -> Any:
    """The ``ray`` module, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("ray_address", "needs Ray, which is not installed here: pip install 'ppokit[ray]'") from None
    return ray


def ray_backend(config: Any) -> Any:
    """The ``rollout=`` backend of ``config.actors`` Ray actors."""
    require_ray()
    return actor_backend(config, pool=RayActorPool)


class _RayWorker(RolloutWorker):
    """A ``RolloutWorker`` in a Ray actor: ``chunk_with(published)`` loads ``(version, weights, obs statistics)``
    when newer than its own, then steps one chunk."""

    def __init__(self, *args: Any):
        torch.set_num_threads(1)
        super().__init__(*args)

    def where(self) -> tuple[int, str]:
        """This actor's pid and the id of the Ray node it runs on."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def chunk_with(self, published: tuple[int, dict, Any]) -> dict:
        version, weights, obs_stats = published
        if version != self.version:
            with torch.no_grad():
                self.policy.load_state_dict(weights)
                if self.obs_norm is not None and obs_stats is not None:
                    self.obs_norm.load_state_dict(obs_stats)
            self.version = version
        return self.chunk()


def _remote(ray: Any) -> Any:
    if not _REMOTE:
        # max_restarts=0: a lost actor is the learner's to replace (with fresh env seeds, named in one line).
        _REMOTE.append(ray.remote(num_cpus=1, max_restarts=0)(_RayWorker))
    return _REMOTE[0]


def _one_line(ray: Any, exc: BaseException, node: str | None = None) -> str:
    """A failed chunk request in one line: the actor's own exception, or how the actor was lost (``node``: the id of
    the Ray node it ran on, where known)."""
    if isinstance(exc, ray.exceptions.RayTaskError):  # the actor raised: its exception, as a process worker names it
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        text = str(cause).strip().splitlines()
        return f"{type(cause).__name__}: {text[-1] if text else '(no message)'}"[:500]
    on = f"its node {node}" if node else "its node"
    if isinstance(exc, ray.exceptions.ActorDiedError):  # also how a lost node's actor ends, once the GCS knows
        return f"its Ray actor died (the process was killed or exited, or {on} was lost)"
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        # A node lost (its raylet killed, its machine gone) surfaces first as this: the learner's connection to the
        # actor closed ("Socket closed") before the GCS, which needs its health checks to time out, knows the node
        # is dead. Measured here (Ray 2.60, a worker node's raylet killed -9 mid-run): this, not ActorDiedError,
        # names the actor. Say where it was, so the line names the lost node.
        return f"its Ray actor stopped answering: its process or {on} was lost ({_last_line(exc)})"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"


def _last_line(exc: BaseException) -> str:
    cause = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {cause[-200:]}"


def _signal_handlers() -> dict[int, Any]:
    """SIGINT's and SIGTERM's Python handlers (none off the main thread, where they cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore(handlers: dict[int, Any]) -> None:
    for sig, handler in handlers.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


def _dead_pid(ray: Any, exc: BaseException) -> int | None:
    """The pid Ray's ``ActorDiedError`` names for a worker process that died (a ``pid: N`` line of its message, which
    Ray writes from the actor's death cause), else None."""
    if not isinstance(exc, ray.exceptions.ActorDiedError):
        return None
    found = re.search(r"^\s*pid: (\d+)\s*$", str(exc), re.MULTILINE)
    return int(found.group(1)) if found else None


class RayActorPool(ActorPool):
    """``ActorPool`` over Ray actors (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ray = require_ray()
        self.actors: dict[int, Any] = {}  # slot -> actor handle
        self.pending: dict[Any, int] = {}  # in-flight chunk request -> slot
        self.pid_refs: dict[int, Any] = {}  # slot -> ObjectRef of its actor's (pid, node id) (asked at its start)
        self.slot_pids: dict[int, int] = {}  # slot -> its actor's pid, once answered (kept: Ray is not asked again)
        self.slot_nodes: dict[int, str] = {}  # slot -> the id of its actor's Ray node, once answered
        self.actor_pids: list[int] = []  # every actor process seen, replaced ones included
        self._published: Any = None  # ObjectRef of (version, weights, obs statistics)
        self._connected = False  # this pool called ray.init (and so calls ray.shutdown)
        self._reaper: Reaper | None = None  # kills a local Ray's processes when this run ends, however it ends

    def publish(self, weights: Any, version: int) -> None:
        """One ``ray.put`` of update ``version``'s weights, which every later chunk request carries."""
        self.policy_version = version
        ray = self.ray
        first = self._published is None
        if first and not ray.is_initialized():
            address = self.config.ray_address
            local = address == "local"  # Ray's own "local": a new one-machine Ray, never an existing cluster's
            # num_cpus: K actors of one CPU each fit even where K exceeds the cores (they then share them).
            # ray.init installs its own SIGTERM handler (sys.exit(15)), which would end the run without its
            # checkpoint and exit code 130: the run's handlers are put back (main thread only, as Ray's is).
            handlers = _signal_handlers()
            # A local Ray is this run's to stop, however it ends (runtime/reaper.py).
            self._reaper = Reaper() if local else None
            with self._reaper.owning() if local else contextlib.nullcontext():
                ray.init(address=address, include_dashboard=False, configure_logging=False,
                         num_cpus=max(os.cpu_count() or 1, self.config.actors) if local else None,
                         _node_ip_address="127.0.0.1" if local else None)
            _restore(handlers)
            self._connected = True
        state = {k: v.detach().to("cpu", copy=True) for k, v in weights.state_dict().items()}
        stats = self.obs_norm.state_dict() if self.obs_norm is not None else None
        self._published = ray.put((version, state, stats))
        if first:
            for slot in range(self.config.actors):
                self._start(slot)

    def close(self) -> None:
        """Kill every actor and, where this pool connected, leave Ray (a ``local`` Ray stops with it)."""
        ray, actors = self.ray, list(self.actors.values())
        self.actors, self.pending = {}, {}
        for actor in actors:
            _kill(ray, actor)
        if self._connected and ray.is_initialized():
            ray.shutdown()
        self._connected = False
        if self._reaper is not None:  # what ray.shutdown() left (its dashboard agent lingers ~1 min)
            self._reaper.close()
            self._reaper = None

    def _start(self, slot: int) -> None:
        seed = self._worker_seed(slot)
        self.starts += 1
        actor = _remote(self.ray).remote(slot, self.config, seed, self._acting_type())
        self.actors[slot] = actor
        self.pid_refs[slot] = actor.where.remote()  # answered before any chunk (an actor runs its calls in order)
        self.slot_pids.pop(slot, None)
        self.slot_nodes.pop(slot, None)
        self.pending[actor.chunk_with.remote(self._published)] = slot
        self.asked_at[slot] = time.monotonic() + START_GRACE_S

    def _pid(self, slot: int) -> int | None:
        """The pid of ``slot``'s actor once it answered, else None (it died first, or is still starting)."""
        if slot in self.slot_pids:
            return self.slot_pids[slot]
        ref = self.pid_refs.get(slot)
        if ref is None:
            return None
        ready, _ = self.ray.wait([ref], timeout=0)
        if not ready:
            return None
        try:
            pid, node = self.ray.get(ref)
        except self.ray.exceptions.RayError:
            return None
        self.slot_nodes[slot] = node
        self._seen(slot, int(pid))
        return pid

    def _seen(self, slot: int, pid: int) -> None:
        self.slot_pids[slot] = pid
        if pid not in self.actor_pids:
            self.actor_pids.append(pid)

    def _still_out(self, slot: int) -> bool:
        """Whether ``slot``'s chunk request has not come back (a finished one waits to be taken: not overdue)."""
        refs = [ref for ref, s in self.pending.items() if s == slot]
        return bool(refs) and not self.ray.wait(refs, timeout=0)[0]

    def _current(self, slot: int, pid: int | None) -> bool:
        return slot in self.actors and self._pid(slot) == pid

    def _retire(self, slot: int) -> None:
        actor = self.actors.pop(slot)
        self.pending = {ref: s for ref, s in self.pending.items() if s != slot}
        _kill(self.ray, actor)

    def _who(self, pid: int | None) -> str:
        return f"Ray actor, pid {pid}" if pid is not None else "Ray actor"

    def _describe(self, slot: int) -> str:
        return "a fresh Ray actor"

    def _next_item(self) -> dict:
        ray = self.ray
        while True:
            for slot in self._overdue():  # hung outside an env call (those raise after env_timeout), or stopped
                if slot in self.actors and self._still_out(slot):
                    _kill(ray, self.actors[slot])
                    return {"kind": "error", "slot": slot, "pid": self._pid(slot), "message": self._timed_out()}
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=POLL_S)
            if not ready:
                continue
            ref = ready[0]
            slot = self.pending.pop(ref)
            pid = self._pid(slot)
            try:
                item = ray.get(ref)
            except ray.exceptions.RayError as exc:  # the actor raised, or its process or node was lost
                if pid is None and (pid := _dead_pid(ray, exc)) is not None:
                    self._seen(slot, pid)  # killed before it answered its pid (still in __init__): Ray names it
                return {"kind": "error", "slot": slot, "pid": pid,
                        "message": _one_line(ray, exc, self.slot_nodes.get(slot))}
            self.pending[self.actors[slot].chunk_with.remote(self._published)] = slot
            self.asked_at[slot] = time.monotonic()
            return item


def _kill(ray: Any, actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - a lost actor is gone already
        pass
