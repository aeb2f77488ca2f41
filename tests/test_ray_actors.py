"""``--actors K --ray-address local`` (rollout/ray_actors.py): the rollout actors as Ray actors on a one-machine Ray
started for the run on 127.0.0.1, checked by what the run writes and by pid.

Every process of a run (the learner, the Ray head's GCS and raylet, the actors) inherits the environment variable
``_MARK`` or is below one that did, so ``_marked`` finds them all by pid, and after the run none may be left.

``--ray-address 127.0.0.1:PORT``: the ``cluster`` fixture's existing cluster of three ``ray start`` nodes (its
processes carry its own mark), for actors on several nodes and a lost node."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from ppokit.config.ppo_config import ConfigError, PPOConfig
from ppokit.core import schema as S

TESTS = Path(__file__).resolve().parent
SRC = str(TESTS.parent / "src")
LAG_COLUMNS = (S.POLICY_LAG, S.POLICY_LAG_MEAN, S.DROPPED_CHUNKS_FRAC, S.ACTOR_REPLACEMENTS)
_MARK = "PPOKIT_RAY_TEST_RUN"
# A Ray run on this loaded 2-core machine: ~6 s to start the head, ~15 s for 8k CartPole steps with 2 actors.
RUN_TIMEOUT_S = 120

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs pip install -e '.[ray]'")


def _pythonpath() -> str:
    # tests/ on the path: the actors import actor_faults as its env id says.
    return os.pathsep.join([SRC, str(TESTS), os.environ.get("PYTHONPATH", "")])


def _train(run_dir: Path, mark: str, *flags: str, address: str = "local", env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1", _MARK: mark,
           "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "ppokit", "train", "--preset", "cartpole", "--seed", "1",
                             "--actors", "2", "--ray-address", address, "--run-dir", str(run_dir),
                             "--no-tensorboard", "--quiet", *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


_SEEN: dict[str, dict[int, float]] = {}  # mark -> pid -> start time of every process of that run seen so far


def _marked(mark: str) -> dict[int, str]:
    """pid -> command line of every live process of the run marked ``mark``: those whose environment holds the
    mark, everything below them, and every one seen so before (Ray's agents retitle themselves, which blanks their
    ``/proc/PID/environ``, and an orphan is no longer below the run: the ``mark`` fixture samples while it runs)."""
    seen = _SEEN.setdefault(mark, {})
    found: dict[int, str] = {}

    def add(proc: psutil.Process) -> None:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = " ".join(proc.cmdline())
                seen.setdefault(proc.pid, proc.create_time())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass

    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(_MARK) == mark:
                for p in (proc, *proc.children(recursive=True)):
                    add(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    for pid, started in list(seen.items()):
        if pid not in found:
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == started:
                    add(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
    return found


def _actors(mark: str) -> list[int]:
    """The run's Ray actor processes (Ray titles them ``ray::_RayWorker...``)."""
    return sorted(pid for pid, cmd in _marked(mark).items() if cmd.startswith("ray::_RayWorker"))


def _none_left(mark: str, timeout: float = 15.0) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the Ray run did not finish in {RUN_TIMEOUT_S} s: {err[-2000:]}")


def _rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(name="mark")  # named: test_recurrent_actors.py imports it under another name
def mark_fixture():
    """A fresh mark for one run, whose processes are sampled every 0.25 s while the test runs (see ``_marked``)."""
    mark, done = uuid.uuid4().hex, threading.Event()
    sampler = threading.Thread(target=lambda: [_marked(mark) for _ in iter(lambda: done.wait(0.25), True)],
                               daemon=True)
    sampler.start()
    yield mark
    done.set()
    sampler.join()
    for pid in _marked(mark):  # whatever a failed test left behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _SEEN.pop(mark, None)


@needs_ray
def test_cartpole_on_two_ray_actors_trains_logs_the_lag_and_leaves_no_process(tmp_path, mark):
    run_dir = tmp_path / "run"
    proc = _train(run_dir, mark, "--total-timesteps", "10240")
    seen: set[int] = set()
    while proc.poll() is None:
        seen |= set(_actors(mark))
        time.sleep(0.2)
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-2000:]
    assert len(seen) == 2, seen  # two Ray actors did the stepping
    rows = _rows(run_dir)
    for col in LAG_COLUMNS:
        assert col in rows[0], col
    returns = [float(r[S.EPISODIC_RETURN]) for r in rows if r[S.EPISODIC_RETURN] not in ("", "nan")]
    last = [x for x in returns[-5:] if not math.isnan(x)]
    # Seed 1, 10k steps: ~75 by the end (random actions: ~20); 40 holds under load.
    assert sum(last) / len(last) > 40, returns
    lags = [float(r[S.POLICY_LAG]) for r in rows]
    assert 0 <= min(lags) and max(lags) <= 8  # max_policy_lag's default
    assert not _none_left(mark), "a process of the Ray run outlived it"
    # Its checkpoint evaluates as any run's does.
    ev = subprocess.run([sys.executable, "-m", "ppokit", "eval", str(run_dir), "--episodes", "2"],
                        env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=120)
    assert ev.returncode == 0, ev.stderr[-2000:]


@needs_ray
def test_a_stopped_ray_actor_and_a_killed_one_mid_run_are_named_and_replaced_and_the_run_finishes(tmp_path, mark):
    # One actor, so that every chunk so far is its own (an actor still in its first chunk has 60 s more): stopped
    # (SIGSTOP: alive, silent, as one hung outside an env call), it is ended by --actor-timeout; its replacement,
    # once it has sent chunks too, is killed -9. Long enough that both land mid-run on a loaded machine.
    run_dir = tmp_path / "run"
    proc = _train(run_dir, mark, "--actors", "1", "--total-timesteps", "61440", "--actor-timeout", "3")

    def until(pred, what: str):
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (got := pred()):
            assert proc.poll() is None and time.monotonic() < deadline, f"{what}: {proc.poll()}"
            time.sleep(0.2)
        return got

    def rows() -> int:
        return len(_rows(run_dir)) if (run_dir / "metrics.csv").exists() else 0

    stopped = until(lambda: rows() >= 3 and _actors(mark), "a few updates")[0]
    os.kill(stopped, signal.SIGSTOP)
    killed = until(lambda: [p for p in _actors(mark) if p != stopped], "the stopped actor's replacement")[0]
    seen = rows()
    until(lambda: rows() > seen + 3, "updates on the replacement's chunks")
    os.kill(killed, signal.SIGKILL)
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-2000:]
    named = [line for line in err.splitlines() if f"(Ray actor, pid {stopped}) died: sent no chunk in 3 s "
             "(actor_timeout); killed; replaced by a fresh Ray actor" in line]
    assert len(named) == 1, err[-2000:]
    named = [line for line in err.splitlines() if f"(Ray actor, pid {killed}) died:" in line]
    assert len(named) == 1 and "replaced by a fresh Ray actor" in named[0], err[-2000:]
    assert float(_rows(run_dir)[-1][S.ACTOR_REPLACEMENTS]) == 2
    assert not _none_left(mark), "a process of the Ray run outlived it"


@needs_ray
def test_a_ray_actor_killed_while_starting_one_that_raises_and_one_whose_env_hangs_are_each_named_and_replaced(
        tmp_path, mark):
    """Three faults in one run (actor_faults:FaultyCartPole-v0, every actor process 8 s in its __init__): an actor
    killed -9 in its __init__ (building its envs), before it answered its pid, is named by the pid Ray's death cause
    gives; the first actor past 64 steps raises and is named with its exception; the first past 128 steps hangs in
    env.step and is named after --env-timeout 2 s. Each line says it was replaced, the run finishes, it counts the
    three replacements and no process outlives it."""
    run_dir = tmp_path / "run"
    flags = {name: tmp_path / name for name in ("learner_pid", "raised", "hung")}
    kwargs = (f'{{"start_flag": "{flags["learner_pid"]}", "delay_s": 8, "raise_flag": "{flags["raised"]}", '
              f'"raise_after": 64, "hang_flag": "{flags["hung"]}", "hang_after": 128}}')
    proc = _train(run_dir, mark, "--total-timesteps", "40960", "--env", "actor_faults:FaultyCartPole-v0",
                  "--env-kwargs", kwargs, "--env-timeout", "2")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    victim = None
    while victim is None and proc.poll() is None and time.monotonic() < deadline:
        starting = [pid for pid, cmd in _marked(mark).items() if cmd.startswith("ray::_RayWorker.__init__")]
        if starting:
            victim = starting[0]
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.1)
    assert victim is not None, "no Ray actor was seen in its __init__"
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-2000:]
    # Killed while starting: named by its pid.
    named = [line for line in err.splitlines() if f"(Ray actor, pid {victim}) died:" in line]
    assert len(named) == 1 and "replaced by a fresh Ray actor" in named[0], f"killed while starting: {err[-2000:]}"
    # Raised: named with its exception.
    raised = int(flags["raised"].read_text())
    named = [line for line in err.splitlines() if f"(Ray actor, pid {raised}) died:" in line]
    assert len(named) == 1 and "RuntimeError: injected fault in the third chunk" in named[0], \
        f"raised: {err[-2000:]}"
    assert "replaced by a fresh Ray actor" in named[0], f"raised: {named[0]}"
    # Hung past env_timeout: named with the timeout.
    hung = int(flags["hung"].read_text())
    named = [line for line in err.splitlines() if f"(Ray actor, pid {hung}) died:" in line]
    assert len(named) == 1 and "did not return within 2 s" in named[0], f"hung: {err[-2000:]}"
    assert "replaced by a fresh Ray actor" in named[0], f"hung: {named[0]}"
    assert len({victim, raised, hung}) == 3, (victim, raised, hung)
    assert float(_rows(run_dir)[-1][S.ACTOR_REPLACEMENTS]) == 3.0
    assert not _none_left(mark), "a process of the Ray run outlived it"


@needs_ray
# SIGTERM: ray.init installs its own handler for it (the bug this test caught). SIGINT, which Ray leaves alone, also
# passed (17 s); the process workers' Ctrl-C test covers the learner's side of it.
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_ctrl_c_and_sigterm_stop_a_ray_run_in_bounded_time_with_a_checkpoint(tmp_path, mark, sig):
    run_dir = tmp_path / "run"
    proc = _train(run_dir, mark, "--total-timesteps", "2000000", "--save-every", "5")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not ((run_dir / "checkpoint.pt").exists() and len(_actors(mark)) == 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the Ray run did not start"
        time.sleep(0.2)
    # Ctrl-C at a terminal reaches the whole process group (the learner started its Ray head in it).
    os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
    t0 = time.monotonic()
    out, err = _finish(proc)
    took = time.monotonic() - t0
    assert proc.returncode == 130, err[-2000:]
    assert took < 30, took
    import torch

    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert state["update"] == len(_rows(run_dir))  # the checkpoint holds the last logged update
    assert not _none_left(mark), "a process of the Ray run outlived it"


def test_ray_address_without_actors_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as err:
        PPOConfig(ray_address="local").validate()
    assert err.value.field == "ray_address" and "actors" in str(err.value)


def test_ray_address_without_ray_installed_is_one_line(monkeypatch):
    from ppokit.rollout.ray_actors import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    with pytest.raises(ConfigError) as err:
        require_ray()
    assert err.value.field == "ray_address" and "pip install 'ppokit[ray]'" in str(err.value)


def test_importing_ppokit_does_not_import_ray():
    code = "import sys, ppokit, ppokit.training.trainer; print('ray' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC}, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


@needs_ray
def test_a_killed_learner_takes_its_ray_head_and_actors_with_it(tmp_path, mark):
    proc = _train(tmp_path / "run", mark, "--total-timesteps", "40960")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(_actors(mark)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_actors(mark)) == 2, "the two Ray actors did not start"
    assert len(_marked(mark)) > 3  # the learner, the actors and the Ray head's own processes
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    # A `local` Ray's processes share the fate of the driver that started them (Ray's fate sharing): ~1.3 s here.
    assert not _none_left(mark, 20.0), "a process of the Ray run outlived its killed learner"


# An existing Ray cluster of several nodes (`--ray-address HOST:PORT`): `ray start` on 127.0.0.1, one head and two
# worker nodes of one CPU each, so two one-CPU actors must sit on two nodes and a replacement always has room.


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A lost node's actor fails its chunk request at once when the learner's connection to it closes, or else only
# once the GCS declares the node dead, after its health checks fail (Ray's defaults: every 3 s, 5 in a row, seen
# here: one run's remaining ~10 s ended before its lost actor was named). The cluster checks every 0.5 s, 3 in a
# row: ~2 s.
_FAST_NODE_DEATH = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
                    "RAY_health_check_failure_threshold": "3"}


class _Cluster:
    """A Ray cluster of ``ray start`` nodes on 127.0.0.1, each with its own --temp-dir under ``root``, so its
    processes are found by that path (in the GCS's and raylets' command lines) and their descendants. ``ray stop``
    stops every Ray of this machine's user, another test's too: teardown kills these pids instead."""

    def __init__(self, root: Path):
        self.root, self.mark, self.port = root, uuid.uuid4().hex, _free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Ray 2.60 enables token authentication by default where ~/.ray/auth_token exists: the cluster and its
        # drivers share their own token instead (Ray's RAY_AUTH_TOKEN), so no file outside root is read or written.
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex, "RAY_USAGE_STATS_ENABLED": "0"}
        self.nodes: dict[str, Path] = {}  # node name -> its --temp-dir
        self.lost: set[str] = set()  # nodes a test killed (the fixture is shared by the module's tests)
        # pid -> start time of every process of the cluster seen: a lost raylet's agents, orphaned, name neither
        # the root nor (their titles overwrite it) the mark, and live on for up to a minute.
        self.seen: dict[int, float] = {}

    def start(self, name: str, *, head: bool = False, num_cpus: int = 1) -> None:
        temp = self.root / name
        # Several nodes on one host: every port a node binds is its own (the defaults, e.g. 8265 and 52365, are
        # shared), and worker ports 0 = any free port (as ray.cluster_utils does for its one-host clusters).
        ports = ["--node-manager-port", str(_free_port()), "--object-manager-port", str(_free_port()),
                 "--dashboard-agent-listen-port", str(_free_port()), "--dashboard-agent-grpc-port", str(_free_port()),
                 "--runtime-env-agent-port", str(_free_port()), "--metrics-export-port", str(_free_port()),
                 "--min-worker-port", "0", "--max-worker-port", "0"]
        where = (["--head", "--port", str(self.port), "--include-dashboard=false", "--dashboard-port",
                  str(_free_port()), "--ray-client-server-port", str(_free_port())] if head
                 else ["--address", self.address])
        cmd = ["ray", "start", *where, "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus),
               "--temp-dir", str(temp), "--disable-usage-stats", *ports]
        env = {**os.environ, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1", _MARK: self.mark, **self.env,
               **_FAST_NODE_DEATH}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert res.returncode == 0, f"ray start ({name}) failed: {res.stderr[-2000:]}"
        self.nodes[name] = temp

    def raylet(self, name: str) -> int | None:
        """The pid of node ``name``'s raylet, None once it is gone."""
        temp = f"{self.nodes[name]}/"
        for proc in psutil.process_iter(["pid", "name", "cmdline"]):
            cmd = proc.info["cmdline"] or []
            if proc.info["name"] == "raylet" and any(temp in arg for arg in cmd) and proc.status() != "zombie":
                return proc.pid
        return None

    def lose(self, name: str) -> None:
        """Node ``name`` lost: its raylet killed -9, as when its machine goes away."""
        self.processes()  # its agents, while they are still its raylet's children
        os.kill(self.raylet(name), signal.SIGKILL)
        self.lost.add(name)

    def up(self) -> bool:
        """Every node not lost on purpose still has its raylet."""
        return all(self.raylet(name) for name in self.nodes if name not in self.lost)

    def node_id(self, name: str) -> str:
        """Ray's id of node ``name`` (its raylet's --node_id)."""
        cmd = psutil.Process(self.raylet(name)).cmdline()
        return next(arg.split("=", 1)[1] for arg in cmd if arg.startswith("--node_id="))

    def node_of(self, pid: int) -> str | None:
        """The node whose raylet is ``pid``'s parent (every Ray worker process is its raylet's child)."""
        try:
            parent = psutil.Process(pid).ppid()
        except psutil.NoSuchProcess:
            return None
        return next((name for name in self.nodes if self.raylet(name) == parent), None)

    def processes(self) -> set[int]:
        """Every live process of this cluster: those naming its root, their descendants, and any seen before."""
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(str(self.root) in arg for arg in proc.info["cmdline"] or []):
                    found += [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        for proc in [*found, *_marked(self.mark)]:
            try:
                proc = proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
                self.seen.setdefault(proc.pid, proc.create_time())
            except psutil.NoSuchProcess:
                continue
        return {pid for pid, started in self.seen.items() if _alive(pid, started)}

    def stop(self) -> None:
        deadline = time.monotonic() + 30
        while (left := self.processes()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        assert not self.processes(), "a process of the test's Ray cluster outlived its teardown"


def _alive(pid: int, started: float) -> bool:
    """``pid`` is still the process that started at ``started`` (not a reused pid) and not a zombie."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def cluster():
    import shutil
    import tempfile

    # A short root: Ray's unix sockets live under --temp-dir, and a socket path may not exceed 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="ppokit-ray-", dir="/tmp"))
    ray_cluster = _Cluster(root)
    try:
        ray_cluster.start("head", head=True)
        ray_cluster.start("a")
        ray_cluster.start("b")
        ray_cluster.processes()  # every node's processes, seen while each is its raylet's child
        yield ray_cluster
    finally:
        ray_cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@needs_ray
def test_a_cluster_run_spreads_its_actors_over_nodes_replaces_a_lost_nodes_actor_on_a_live_node_and_leaves_it_up(
        tmp_path, mark, cluster):
    """One run on the cluster: its two actors sit on two nodes (one CPU per node); a lost node (its raylet killed -9
    mid-run) is named with its actor, which is replaced on a live node; the run finishes all its steps, no process
    of it (its actors included) outlives it, and it leaves the cluster it joined running (every node not lost keeps
    its raylet; ``ray status`` answers)."""
    run_dir = tmp_path / "run"
    proc = _train(run_dir, mark, "--total-timesteps", "61440", address=cluster.address, env=cluster.env)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    victim = lost = None
    spread: dict[int, str | None] = {}  # actor pid seen before the loss -> its node
    while victim is None and proc.poll() is None and time.monotonic() < deadline:
        rows = _rows(run_dir) if (run_dir / "metrics.csv").exists() else []
        # The driver is on the head node (ray.init prefers the head among this host's nodes): lose another one,
        # the node of an actor seen there, never one picked by luck.
        placed = {pid: cluster.node_of(pid) for pid in _actors(cluster.mark)}  # the actors carry the cluster's mark
        for pid, node in placed.items():
            if spread.get(pid) is None:
                spread[pid] = node
        # An actor stepping a chunk (Ray titles its process by the method it runs): past its start, so the
        # learner knows its node.
        stepping = {pid for pid, cmd in _marked(cluster.mark).items() if cmd.startswith("ray::_RayWorker.chunk_with")}
        away = sorted((pid, node) for pid, node in placed.items() if node not in (None, "head") and pid in stepping)
        if len(rows) >= 3 and away:
            victim, lost = away[0]
            lost_id = cluster.node_id(lost)
            cluster.lose(lost)
        time.sleep(0.2)
    assert victim is not None, "the run ended before a node could be lost"
    # Spread: two actors before the loss, on two nodes.
    assert len(spread) == 2 and None not in spread.values(), f"spread: {spread}"
    assert len(set(spread.values())) == 2, f"spread: {spread}"  # one CPU per node: two actors, two nodes
    fresh: dict[int, str | None] = {}  # actor pid started after the loss -> its node
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in set(_actors(cluster.mark)) - set(spread):
            fresh.setdefault(pid, cluster.node_of(pid))
        time.sleep(0.2)
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-2000:]
    assert fresh and all(node not in (None, lost) for node in fresh.values()), (lost, fresh)  # on a live node
    named = [line for line in err.splitlines() if f"(Ray actor, pid {victim}) died:" in line]
    assert len(named) == 1 and "replaced by a fresh Ray actor" in named[0], err[-2000:]
    assert f"its node {lost_id} was lost" in named[0], named[0]  # the line says which node was lost
    rows = _rows(run_dir)
    assert float(rows[-1][S.ACTOR_REPLACEMENTS]) >= 1
    assert float(rows[-1][S.GLOBAL_STEP]) >= 61440, "the run did not finish its steps"
    assert not _none_left(mark), "a process of the run outlived it"
    deadline = time.monotonic() + 15
    while _actors(cluster.mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _actors(cluster.mark), "the run's Ray actors outlived it"
    # The run joined a cluster it did not start: it left it running, every live node's raylet included.
    assert cluster.up(), "the run stopped the cluster it joined"
    res = subprocess.run(["ray", "status", "--address", cluster.address], env={**os.environ, **cluster.env},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"ray status: {res.stderr[-2000:]}"


@needs_ray
def test_a_killed_learner_takes_its_actors_on_a_cluster_but_leaves_the_cluster_up(tmp_path, mark, cluster):
    proc = _train(tmp_path / "run", mark, "--total-timesteps", "40960", address=cluster.address, env=cluster.env)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(_actors(cluster.mark)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    actors = _actors(cluster.mark)
    assert len(actors) == 2, "the two Ray actors did not start"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    # A driver's actors share its fate (Ray kills a job's actors when its driver dies); the cluster's nodes do not.
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) for pid in actors) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(pid) for pid in actors), "a Ray actor outlived its killed learner"
    assert not _none_left(mark), "a process of the run outlived it"
    assert cluster.up(), "the killed learner took the cluster with it"
