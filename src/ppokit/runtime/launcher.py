"""``ppokit train --nproc K`` and ``ppokit lm ALGO --nproc K``: K ranks under torchrun on this machine, stopped
together, a lost rank in one line.

Three generations: this launcher -> torchrun's agent (``python -m ppokit.runtime.launcher``: ``torch.distributed.run``
with its failure report replaced) -> the K ranks (torchrun starts each in its own session).

- **Signals.** The agent runs in its own session, so a terminal's Ctrl-C reaches the launcher alone, which
  passes SIGINT or SIGTERM on to the agent once; torchrun sends it to every rank once (a second one would abort
  a rank's save: the trainer's second-Ctrl-C rule), waits up to ``SHUTDOWN_S`` for them to finish the update and
  save, then kills them. The launcher waits for the agent and the ranks (bounded), kills what is left, and exits
  128 + the signal (130, 143).
- **A launcher killed without a word (kill -9).** The agent's and the ranks' stdin is a pipe whose only write
  end the launcher holds; the kernel closes it however the launcher ends, so EOF on stdin means "the launcher is
  gone": the agent stops its ranks as for SIGTERM; a rank whose agent is gone too stops itself; each kills
  itself after the grace. Chosen over ``PR_SET_PDEATHSIG``: that fires when the parent *thread* exits, must be
  set in both generations (torchrun's Popen offers no hook), and misses a parent that dies before the child
  calls prctl; the pipe passes through torchrun's Popen as stdin, unchanged, and exists from the fork on.
- **A lost rank.** One line naming it and how it ended (exit code or signal) replaces torchrun's
  ``ChildFailedError`` traceback and its log lines. A rank that exits 1 or 2 has printed its own line (the CLI's
  rule); a surviving rank whose collective failed because a peer exited exits 1 quietly
  (``DistributedError.peer_exited``): this line names the cause.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from ppokit.runtime.procs import children, kill, start_time

__all__ = ["launch", "describe_failures", "supervised", "watch_launcher", "SHUTDOWN_S", "PIPE_VAR"]

PIPE_VAR = "PPOKIT_NPROC_PIPE"  # "1": this process's stdin is the launcher's pipe (set by ``launch``)
# How long torchrun lets the ranks finish the update and save after a signal before it kills them (its
# --shutdown_timeout, default 30 s: a large network's update and checkpoint can take longer).
SHUTDOWN_S = 60
_MARGIN_S = 15  # beyond SHUTDOWN_S: torchrun's own kill, its exit and the launcher's poll
SELF_REPORTED = (1, 2, 130)  # exit codes after which a rank has printed its own line (or was interrupted)


def supervised() -> bool:
    """Whether this process was started by ``launch`` (its launcher reports lost ranks)."""
    return os.environ.get(PIPE_VAR) == "1"


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``ppokit ARGV`` (``["train", ...]``, ``["lm", "grpo", ...]``) as ``nproc`` ranks under torchrun; the exit
    code (130/143 after SIGINT/SIGTERM)."""
    cmd = [sys.executable, "-m", "ppokit.runtime.launcher", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "ppokit", *argv]
    # The grace by the variable, not --shutdown_timeout: torch releases without that flag read neither and keep
    # their 30 s (the launcher's own deadline still bounds the wait).
    env = {**os.environ, PIPE_VAR: "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_S)}
    agent = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env, start_new_session=True)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        try:
            os.kill(agent.pid, signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    ranks: dict[int, str] = {}  # pid -> start time (a recycled pid is not ours)
    deadline = None
    try:
        while True:
            try:
                rc = agent.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if len(ranks) < nproc:
                ranks.update(children(agent.pid))
            if received and deadline is None:
                deadline = time.monotonic() + SHUTDOWN_S + _MARGIN_S
            if deadline is not None and time.monotonic() > deadline:
                kill(agent.pid, start_time(agent.pid))
                rc = agent.wait()
                break
    finally:
        # EOF for the ranks: one still running (its agent was killed) stops itself. Then a bounded wait for them.
        agent.stdin.close()
        _reap(ranks, (deadline or time.monotonic() + SHUTDOWN_S) + _MARGIN_S)
        for s, handler in old.items():
            signal.signal(s, handler)
    return 128 + received[0] if received else rc


def describe_failures(exitcodes: dict[int, int], world_size: int, command: str = "ppokit train") -> str | None:
    """The one line for the ranks that failed (rank -> exit code, negative: killed by that signal), or None when
    each has said why itself (``SELF_REPORTED``). A rank killed by SIGTERM beside another failure was stopped by
    torchrun (the survivors of a lost rank are): the other is the news. ``command``: the ranks' command, which
    the line tells how to resume."""
    others = {r: c for r, c in exitcodes.items() if c != -signal.SIGTERM}
    exitcodes = others or exitcodes
    told = []
    for rank, code in sorted(exitcodes.items()):
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "a signal"
            told.append(f"rank {rank} of {world_size} was killed by {name} (signal {-code})")
        elif code not in SELF_REPORTED:
            told.append(f"rank {rank} of {world_size} exited with code {code}")
    if not told:
        return None
    return ("; ".join(told) + "; the other ranks were stopped; rank 0's last checkpoint is whole: continue with "
            f"{command} --nproc {world_size} --resume RUN_DIR")


def watch_launcher(agent: bool = False) -> None:
    """Stop this process when the launcher is gone (EOF on the stdin pipe; see the module docstring).

    The agent (``agent=True``) stops its ranks at once, as for SIGTERM; a rank waits for its agent to do so and
    stops itself only once the agent is gone too. Either kills itself ``SHUTDOWN_S`` + margin after the EOF."""
    if not supervised():
        return
    parent = os.getppid()

    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        deadline = time.monotonic() + SHUTDOWN_S + _MARGIN_S
        asked = False
        while True:
            if not asked and (agent or os.getppid() != parent):
                asked = True
                os.kill(os.getpid(), signal.SIGTERM)
            if time.monotonic() > deadline:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.5)

    threading.Thread(target=watch, name="ppokit-launcher-watch", daemon=True).start()


# ---------------------------------------------------------------------- the ranks
def _reap(ranks: dict[int, str], deadline: float) -> None:
    """Wait until every rank has exited, polling; at ``deadline`` kill the ones left."""
    while any(start_time(p) == s for p, s in ranks.items()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p, s in ranks.items():
        kill(p, s)


# ---------------------------------------------------------------------- the agent
def _agent(argv: list[str]) -> int:
    """torchrun with ARGV, its failures told in one line, its own log lines and traceback silenced."""
    import logging

    # torchrun's own lines ("Sending process N closing signal", "failed (exitcode: -9)"): the failure line below
    # says what they would. A handler here, not propagating, keeps both torch's handler and logging's last-resort
    # printer away.
    quiet = logging.getLogger("torch.distributed.elastic")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(argv)
    watch_launcher(agent=True)
    try:
        torchrun.run(args)
    except SignalException as exc:  # the launcher's SIGINT/SIGTERM: the ranks were stopped (and have saved)
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:  # a SIGINT before torchrun's handler was installed: no rank had started
        return 130
    except ChildFailedError as exc:
        codes = {rank: f.exitcode for rank, f in exc.failures.items()}  # by global rank
        words = [w for w in args.training_script_args[:2] if not w.startswith("-")]  # train | lm grpo
        line = describe_failures(codes, int(args.nproc_per_node), " ".join(["ppokit", *words]))
        if line:
            print(f"error: {line}", file=sys.stderr, flush=True)
        return 130 if set(codes.values()) == {130} else 1  # every rank interrupted (and saved): not a failure
    return 0


if __name__ == "__main__":
    sys.exit(_agent(sys.argv[1:]))
