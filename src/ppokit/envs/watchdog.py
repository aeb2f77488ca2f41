"""Env calls that do not return: the ``env_timeout`` watchdog, closing a vector env that may hang, and async
workers that die with the trainer.

**The watchdog.** The trainer runs every ``reset()``/``step()``/``close()`` of its envs in the main thread: a
sync vector env runs the env's own code there, an async one waits there in ``Connection.recv`` for its workers.
``EnvWatchdog.arm(phase)`` before such a call and ``disarm()`` after it cost two attribute stores and a clock read
(~0.4 us a step measured, against ~1.7 us for a ``signal.setitimer`` pair). A daemon thread looks at the armed
call a few times a second; once it has run ``timeout`` seconds, or ``STOP_GRACE_S`` seconds after a Ctrl-C asked
the run to stop (the first Ctrl-C only sets a flag the loop reads between updates, which a hung env never
reaches), the thread sends SIGALRM to the main thread, whose handler raises ``EnvTimeout`` there. The trainer
turns that into its usual env failure: one line naming the env, the index, the phase and the step, after saving
the learner state (``envs.errors``, ``training.lifecycle``).

What a signal interrupts: any Python code (checked between bytecodes) and any blocking system call the
interpreter wraps (``time.sleep``, ``select``, socket and pipe reads: PEP 475 runs the handler and the exception
propagates), so a hung Python env, an env blocked on a socket and an async worker that never answers are all
covered. Not covered: a C extension that loops without returning to the interpreter; the handler runs only
when it returns. The handler is Python's, so the watchdog runs only when the trainer runs in the main thread
(elsewhere ``signal.signal`` is not allowed and the calls are unbounded, as before). A handler an env installed
for SIGALRM is put back when the run ends.

**Async workers.** ``orphan_proof_worker`` runs Gymnasium's own ``_async_worker`` after asking Linux to SIGKILL
the worker when the trainer dies (``prctl(PR_SET_PDEATHSIG)``, prctl(2)): a worker otherwise outlives a SIGKILL of
the trainer, because it inherited the other workers' pipe ends (fork) and so never sees its own pipe close, and a
hung one never reads it at all. A ``close()`` that raises in a worker is one line naming the env, not the
worker's traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["EnvTimeout", "EnvWatchdog", "NO_WATCHDOG", "STOP_GRACE_S", "close_vector_env", "die_with_parent",
           "orphan_proof_worker",
           "pending_workers", "async_kwargs"]

# After a Ctrl-C, how long a pending env call may still take before the run ends without it: a healthy step or
# reset takes milliseconds, so only an env that hangs meets this.
STOP_GRACE_S = 5.0


class EnvTimeout(BaseException):
    """An env call (``phase``) did not return in time; ``reason`` says which limit it met.

    A ``BaseException``, as ``KeyboardInterrupt`` and ``asyncio.CancelledError`` are: an env's own ``except
    Exception`` must not swallow it and keep hanging. The trainer's env call sites catch it by name."""

    def __init__(self, phase: str, reason: str, interrupted: bool = False):
        self.phase, self.reason, self.interrupted = phase, reason, interrupted
        super().__init__(f"{phase} {reason}")


class EnvWatchdog:
    """Bounds the env call between ``arm(phase)`` and ``disarm()`` to ``timeout`` seconds (None: unbounded), and
    to ``STOP_GRACE_S`` seconds once ``stop_requested()`` is true. Active only inside ``running()``."""

    def __init__(self, timeout: float | None, stop_requested: Callable[[], bool] = lambda: False):
        self.timeout = timeout if timeout else None  # 0 and None: no limit
        self.stop_requested = stop_requested
        self.phase = ""
        self._started: float | None = None  # monotonic time the armed call began; None: nothing armed
        self._stop_seen: float | None = None  # when the thread first saw the stop request during this call
        self._active = False
        self.fired = False  # an env call was interrupted: the envs are not to be trusted (or waited on) again

    # The hot path: two stores and a clock read.
    def arm(self, phase: str) -> None:
        self.phase = phase
        self._started = time.monotonic()

    def disarm(self) -> None:
        self._started = None

    @contextmanager
    def guard(self, phase: str) -> Iterator[None]:
        """``arm(phase)`` ... ``disarm()`` around a block (the paths where a method call costs nothing)."""
        self.arm(phase)
        try:
            yield
        finally:
            self.disarm()

    def overdue(self, now: float) -> EnvTimeout | None:
        """The ``EnvTimeout`` the armed call has earned at ``now``, or None."""
        started = self._started
        if started is None or not self._active:
            return None
        if self.timeout is not None and now - started >= self.timeout:
            return EnvTimeout(self.phase, f"did not return within {self.timeout:g} s (env_timeout, --env-timeout)")
        seen = self._stop_seen
        if seen is not None and seen >= started and now - seen >= STOP_GRACE_S:
            return EnvTimeout(self.phase, f"did not return within {STOP_GRACE_S:g} s of Ctrl-C", interrupted=True)
        return None

    def start(self) -> None:
        """Install the SIGALRM handler and start the thread (main thread only, else a no-op; idempotent)."""
        if self._active or threading.current_thread() is not threading.main_thread():
            return
        main = threading.main_thread().ident
        done = threading.Event()
        # A few looks per limit, at most 4 a second: a late look only adds that much to a long limit.
        poll = min(0.25, self.timeout / 4) if self.timeout else 0.25

        def handler(signum: int, frame: Any) -> None:
            error = self.overdue(time.monotonic())
            if error is not None:  # else a late signal: the call returned in between, nothing to do
                self.fired = True
                raise error

        def watch() -> None:
            while not done.wait(poll):
                now, started, seen = time.monotonic(), self._started, self._stop_seen
                # The grace period counts from the first look that finds both a pending call and a stop request.
                if started is not None and (seen is None or seen < started) and self.stop_requested():
                    self._stop_seen = now
                if self.overdue(now) is not None:
                    # Again every look while the call is pending: an env that swallows the exception
                    # (``except Exception``) and keeps hanging is interrupted again.
                    signal.pthread_kill(main, signal.SIGALRM)

        self._old_handler = signal.signal(signal.SIGALRM, handler)
        self._active = True
        self._done = done
        self._thread = threading.Thread(target=watch, name="ppokit-env-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and put the previous SIGALRM handler back (idempotent)."""
        if not self._active:
            return
        self._active = False
        self._done.set()
        self._thread.join()
        signal.signal(signal.SIGALRM, self._old_handler if self._old_handler is not None else signal.SIG_DFL)
        self._started = None

    @contextmanager
    def running(self) -> Iterator["EnvWatchdog"]:
        """``start()`` for the block, and ``stop()`` after it unless it was running already."""
        was_active = self._active
        self.start()
        try:
            yield self
        finally:
            if not was_active:
                self.stop()


class _NoWatchdog:
    """The watchdog of a collector used without a trainer: nothing is bounded."""

    timeout, fired = None, False

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    @contextmanager
    def running(self) -> Iterator["_NoWatchdog"]:
        yield self

    def arm(self, phase: str) -> None:
        pass

    def disarm(self) -> None:
        pass

    @contextmanager
    def guard(self, phase: str) -> Iterator[None]:
        yield


NO_WATCHDOG = _NoWatchdog()


def _async_base(envs: Any) -> Any:
    """The ``AsyncVectorEnv`` under ``envs`` (vector wrappers included), or None."""
    import gymnasium as gym

    base = getattr(envs, "unwrapped", envs)
    return base if isinstance(base, gym.vector.AsyncVectorEnv) else None


def pending_workers(envs: Any, tb: Any = None) -> list[int]:
    """Indices of an async vector env's workers that have not answered the pending call ([] for others).

    Its ``step_wait``/``reset_wait`` read the pipes in order, so the workers before the one whose ``recv`` was
    interrupted (the frame of ``tb`` holding a ``pipe`` local) have answered; the later ones have, if their pipe
    holds data."""
    base = _async_base(envs)
    if base is None:
        return []
    from gymnasium.vector.async_vector_env import AsyncState

    if base._state == AsyncState.DEFAULT:
        return []
    pipes = list(base.parent_pipes)
    first = None
    while tb is not None:
        pipe = tb.tb_frame.f_locals.get("pipe")
        if pipe is not None and any(pipe is p for p in pipes):
            first = next(i for i, p in enumerate(pipes) if p is pipe)
        tb = tb.tb_next
    out = []
    for i in range(first or 0, len(pipes)):
        pipe = pipes[i]
        try:
            if i == first or (pipe is not None and not pipe.closed and not pipe.poll(0)):
                out.append(i)
        except OSError:
            out.append(i)
    return out


def _kill_workers(base: Any) -> None:
    """SIGKILL an async vector env's workers and mark it closed (its ``__del__`` then waits on nothing)."""
    for process in base.processes:
        if process.is_alive():
            process.kill()
    for process in base.processes:
        process.join(timeout=10)
    for pipe in base.parent_pipes:
        if pipe is not None:
            pipe.close()
    base.closed = True


def close_vector_env(envs: Any, watchdog: Any = NO_WATCHDOG) -> None:
    """Close ``envs`` without waiting on a hung env: an async vector env with a call still pending (an interrupted
    step or reset) or after a timed-out call has its workers killed; any other close runs under ``watchdog``
    (phase ``close()``), and an async one whose close times out is killed too. A close that raises, raises."""
    base = _async_base(envs)
    if base is not None and not base.closed:
        from gymnasium.vector.async_vector_env import AsyncState

        if watchdog.fired or base._state != AsyncState.DEFAULT:
            _kill_workers(base)
            return
    try:
        with watchdog.guard("close()"):
            envs.close()
    except EnvTimeout:
        if base is not None:
            _kill_workers(base)
        raise


# ------------------------------------------------------------------------------------------- async workers
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int | None) -> None:
    """Linux: SIGKILL this process when the process that started it exits (prctl(2)); a no-op elsewhere. Every
    worker process ppokit starts calls it first (env workers, tune's trial workers), so none outlives a kill -9 of
    its parent. ``parent``: the pid expected as parent (exit at once if it is gone already)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:  # the trainer died before prctl ran: nobody will read this worker's results
        os._exit(1)


def orphan_proof_worker(index: int, env_fn: Any, pipe: Any, parent_pipe: Any, shared_memory: Any, error_queue: Any,
                        autoreset_mode: Any, semaphore: Any) -> None:
    """Gymnasium's ``_async_worker`` (the ``worker`` of ``AsyncVectorEnv``), in a process that dies with the
    trainer; an env whose ``close()`` raises at the end costs one line naming it instead of a traceback."""
    import multiprocessing

    from gymnasium.vector.async_vector_env import _async_worker

    parent = multiprocessing.parent_process()
    die_with_parent(parent.pid if parent is not None else None)
    made: list[Any] = []

    def make() -> Any:
        env = env_fn()
        made.append(env)
        return env

    try:
        _async_worker(index, make, pipe, parent_pipe, shared_memory, error_queue, autoreset_mode, semaphore)
    except Exception as exc:  # noqa: BLE001 - the worker's last act, env.close(), raised
        name = _env_name(made[0]) if made else "?"
        message = " ".join(str(exc).split()) or "(no message)"
        # One write of the whole line: the workers close at the same time, and print's separate writes of the
        # text and its newline interleave across processes (two warnings ran together on one line).
        line = (f"warning: env {name!r} (env index {index}) failed in close(): raised {type(exc).__name__}: "
                f"{message}\n")
        try:
            sys.stderr.flush()
            os.write(sys.stderr.fileno(), line.encode(errors="replace"))
        except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor
            print(line, end="", file=sys.stderr, flush=True)


def _env_name(env: Any) -> str:
    spec = getattr(env, "spec", None)
    if spec is not None and getattr(spec, "id", None):
        return str(spec.id)
    return type(getattr(env, "unwrapped", env)).__name__


def async_kwargs(vector_mode: str) -> dict[str, Any]:
    """The ``AsyncVectorEnv`` keyword arguments ppokit adds for ``vector_mode`` "async" ({} for the others)."""
    return {"worker": orphan_proof_worker} if vector_mode == "async" else {}
