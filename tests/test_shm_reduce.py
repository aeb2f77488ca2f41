"""``ppokit.runtime.shm_reduce``: the shared-memory sum the per-minibatch gradient sync uses when every rank is on one host.

Real processes (multiprocessing, spawn) share one buffer (here a file each opens, so spawned processes can
reach it; in a run the anonymous memory file ``join`` hands over); each checks the sum against the rows computed
independently in the parent, call after call (the two-slot protocol is exercised by consecutive calls).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from ppokit.runtime import shm_reduce
from ppokit.runtime.shm_reduce import ShmReducer

pytestmark = pytest.mark.skipif(not shm_reduce.supported(), reason="the flag protocol is used on x86-64 only")

K, N, CALLS = 3, 257, 40


def _row(rank: int, call: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(N, generator=g).to(dtype)


def _create(path: str, world_size: int, capacity: int) -> None:
    with open(path, "wb") as f:
        f.truncate(ShmReducer.nbytes(world_size, capacity))


def _open(path: str, rank: int, world_size: int, capacity: int) -> ShmReducer:
    fd = os.open(path, os.O_RDWR)
    try:
        return ShmReducer(fd, rank, world_size, capacity)
    finally:
        os.close(fd)


def _rank(path: str, rank: int, dtype: torch.dtype, out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    red = _open(path, rank, K, capacity=N + 3)

    def fail(why):
        raise RuntimeError(why)

    results = []
    for call in range(CALLS):
        if rank == call % K:  # a different rank arrives late each call: the others must wait for it
            time.sleep(0.002)
        got = red.sum(_row(rank, call, dtype), 10.0, lambda: None, fail)
        results.append(got)
    out.put((rank, torch.stack(results).numpy()))  # numpy: a tensor would travel as a file descriptor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_rank_gets_the_rank_ordered_sum_on_every_call(tmp_path, dtype):
    path = str(tmp_path / "sync")
    _create(path, K, N + 3)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(path, r, dtype, out)) for r in range(K)]
    for p in procs:
        p.start()
    got = {r: torch.from_numpy(a) for r, a in (out.get(timeout=60) for _ in range(K))}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for call in range(CALLS):
        ref = _row(0, call, dtype).double() + _row(1, call, dtype).double() + _row(2, call, dtype).double()
        for r in range(K):
            assert got[r].dtype == dtype
            assert torch.equal(got[r][call], got[0][call])  # the same bits on every rank
        torch.testing.assert_close(got[0][call], ref.to(dtype), rtol=0, atol=0)


def test_a_rank_that_never_arrives_is_reported_within_the_timeout(tmp_path):
    path = str(tmp_path / "sync")
    _create(path, 2, 8)
    red = _open(path, 0, 2, capacity=8)
    seen = []

    def on_lost(why):
        seen.append(why)
        raise TimeoutError(why)

    start = time.monotonic()
    with pytest.raises(TimeoutError):
        red.sum(torch.ones(8), 0.5, lambda: None, on_lost)
    assert seen == [None] and 0.5 <= time.monotonic() - start < 3
    # A lost() that names a gone peer is raised before the timeout.
    red2 = _open(path, 0, 2, capacity=8)
    red2._gen = 5
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="lost rank 1"):
        red2.sum(torch.ones(8), 30.0, lambda: "lost rank 1 (its process exited) of 2", on_lost)
    assert time.monotonic() - start < 3


def test_a_buffer_larger_than_the_file_is_refused_so_the_caller_falls_back(tmp_path):
    path = str(tmp_path / "sync")
    _create(path, 2, 8)
    red = _open(path, 1, 2, capacity=8)
    assert red.fits(8) and not red.fits(9)
    assert os.path.getsize(path) == ShmReducer.nbytes(2, 8)


def test_two_ranks_compute_the_same_bits_with_and_without_shared_memory(tmp_path):
    """The shared-memory sum is a drop-in for gloo's all-reduce: a 2-rank run's per-update parameter digests are
    the same either way (for 2 ranks both add a + b once, correctly rounded), and no shared file is left."""
    import glob
    import subprocess
    import sys

    from ppokit.runtime import distributed

    before = set(glob.glob("/dev/shm/ppokit-sync-*"))
    digests = []
    for no_shm in ("0", "1"):
        d = tmp_path / f"no_shm{no_shm}"
        d.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                "MASTER_PORT", distributed.NO_SYNC_VAR)}
        env.update(OMP_NUM_THREADS="1", TMPDIR=str(d), **{distributed.CHECKSUMS_VAR: str(d / "ck.txt"),
                                                          distributed.NO_SHM_VAR: no_shm})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "ppokit",
               "train", "--env", "CartPole-v1", "--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2",
               "--update-epochs", "2", "--quiet", "--no-tensorboard", "--total-timesteps", "384",
               "--normalize-obs", "--run-dir", str(d / "run")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        digests.append((d / "ck.txt").read_text().splitlines())
    assert len(digests[0]) == 3 and digests[0] == digests[1]
    assert all(line.split()[1] == line.split()[2] for line in digests[0])
    assert set(glob.glob("/dev/shm/ppokit-sync-*")) <= before


OUTSIDER = '''
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(bytes.fromhex(sys.argv[1]))
try:
    _, fds, _, _ = socket.recv_fds(s, 16, 4)
except OSError:
    fds = []
print(len(fds))
'''

RANK = '''
import mmap, os, sys
from ppokit.runtime.shm_reduce import receive_fd
fd = receive_fd(bytes.fromhex(sys.argv[1]), int(sys.argv[2]), 60.0)
print(mmap.mmap(fd, 16)[:8].decode())
'''


def test_a_process_outside_the_job_is_refused_the_buffer_and_a_rank_gets_it(tmp_path):
    """Rank 0's side of ``join`` here, a same-user process that is not a rank connects first and gets no
    descriptor; the rank whose pid is the job's gets the buffer (and sees what rank 0 wrote in it)."""
    import socket
    import subprocess
    import sys
    import threading

    fd = ShmReducer.memfd(2, 8)
    os.pwrite(fd, b"ppokit!!", 0)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = b"\0ppokit-sync-test-" + os.urandom(8).hex().encode()
    listener.bind(name)
    listener.listen(4)
    try:
        out_proc = subprocess.Popen([sys.executable, "-c", OUTSIDER, name.hex()], stdout=subprocess.PIPE, text=True)
        rank = subprocess.Popen([sys.executable, "-c", RANK, name.hex(), str(os.getpid())], stdout=subprocess.PIPE,
                                text=True)
        errors = []

        def serve():
            try:
                shm_reduce.serve_fd(listener, fd, {rank.pid}, 60.0)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        server = threading.Thread(target=serve)
        server.start()
        assert out_proc.communicate(timeout=60)[0].strip() == "0"  # the stranger got nothing
        assert rank.communicate(timeout=60)[0].strip() == "ppokit!!"
        server.join(timeout=60)
        assert not server.is_alive() and not errors
    finally:
        listener.close()
        os.close(fd)


def test_a_rank_taking_the_buffer_only_from_rank_0s_pid(tmp_path):
    """The other direction: a socket held by a pid other than rank 0's is refused by the rank."""
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = b"\0ppokit-sync-test-" + os.urandom(8).hex().encode()
    listener.bind(name)
    listener.listen(1)
    try:
        with pytest.raises(shm_reduce.JoinError, match="not rank 0"):
            shm_reduce.receive_fd(name, os.getpid() + 1, 10.0)
    finally:
        listener.close()


JOIN_SCRIPT = '''
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from ppokit.runtime import shm_reduce
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
pids = [None, None]
dist.all_gather_object(pids, os.getpid())
if rank == 1:  # takes the socket's name (join's first step), then dies before collecting the buffer
    name = [None]
    dist.broadcast_object_list(name, src=0)
    os._exit(3)

def lost():
    try:
        state = open(f"/proc/{pids[1]}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "lost rank 1"
    return "lost rank 1" if state in ("Z", "X") else None

start = time.monotonic()
try:
    shm_reduce.join(0, 2, 64, pids, 60.0, lost)
    print("joined")
except shm_reduce.JoinError as exc:
    links = [os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")
             if os.path.exists(f"/proc/self/fd/{n}")]
    print(f"refused {time.monotonic() - start:.1f} {exc} memfds={sum('ppokit' in l for l in links)}")
os._exit(0)
'''


def test_a_rank_dying_during_the_join_leaves_nothing_behind(tmp_path):
    """Rank 1 takes the socket's name and dies: rank 0's join fails in one line within a bounded time, with no
    descriptor of the buffer left open and nothing in /dev/shm."""
    import glob
    import socket
    import subprocess
    import sys

    before = set(glob.glob("/dev/shm/ppokit*"))
    script = tmp_path / "join.py"
    script.write_text(JOIN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        out, err = procs[0].communicate(timeout=120)
        procs[1].wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == 3
    assert out.startswith("refused ") and "lost rank 1" in out and out.strip().endswith("memfds=0"), out + err
    assert float(out.split()[1]) < 30  # noticed by polling, long before the 60 s timeout
    # Another job's transient file (a join in progress elsewhere) may come and go: poll until only ours could be left.
    deadline = time.monotonic() + 10
    while set(glob.glob("/dev/shm/ppokit*")) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(glob.glob("/dev/shm/ppokit*")) - before
