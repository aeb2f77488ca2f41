"""Sharded checkpoints of an fsdp LM run (``ppokit.lm.sharded_checkpoint``, torch.distributed.checkpoint).

In one process: the shards round-trip, and a forged ``.metadata`` or non-tensor entry, which DCP's own reader and
planner would execute (checked here as the reference), is refused without running; a write that fails midway is
one line and keeps the previous shards. Under torchrun (2 ranks, gloo on
127.0.0.1): each rank writes its own shard file; a resume on as many ranks gives the uninterrupted run's metrics and
weights bit for bit; a one-process (consolidated) checkpoint resumes sharded on 2 ranks; and a kill -9 of the whole
launch at each moment of a save leaves the previous checkpoint, which a resume finishes into the uninterrupted
run, with no process left behind; ``ppokit lm export`` consolidates the shards offline into the final save's
policy/.
"""

from __future__ import annotations

import csv
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_lm_fsdp import SAVE_SCRIPT, TIMEOUT, _chain, _env, _torchrun

LAUNCH_S = 120  # one launch of a few iterations: a bound, not a wait (about 10 s on an idle 2-core machine)


class _Payload:
    """Unpickled, it creates the file ``path``: what a forged checkpoint would run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _tiny_trained():
    import torch

    from ppokit.lm.base import adamw
    from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer("ABX:", pad_is_eos=True)
    model = build_tiny_llama(tok, seed=0)
    opt = adamw(list(model.parameters()), 1e-2, 0.0)
    model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.square().mean().backward()
    opt.step()
    return tok, model, opt


def _fresh(tok):
    from ppokit.lm.base import adamw
    from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama

    model = build_tiny_llama(build_char_tokenizer("ABX:", pad_is_eos=True), seed=1)  # other weights than saved
    return model, adamw(list(model.parameters()), 1e-2, 0.0)


def test_shards_round_trip_in_one_process_and_a_forged_metadata_runs_no_code(tmp_path):
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import torch
    import torch.distributed.checkpoint as dcp

    from ppokit.lm.sharded_checkpoint import is_shards_name, load_shards, save_shards
    from ppokit.runtime import distributed
    from ppokit.runtime.checkpoint import CheckpointError

    dist = distributed.current()
    tok, model, opt = _tiny_trained()
    name = save_shards(tmp_path, {"policy": model}, opt, 7, dist)
    assert is_shards_name(name) and name.startswith("shards-7-") and not list(tmp_path.glob(".shards-*"))
    model2, opt2 = _fresh(tok)
    load_shards(tmp_path / name, {"policy": model2}, opt2, dist)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    for s, s2 in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(s[k], s2[k]) for k in ("exp_avg", "exp_avg_sq", "step"))

    # A forged .metadata: DCP's own reader runs its payload (the reference), ppokit's refuses it in one line.
    meta = tmp_path / name / ".metadata"
    made = tmp_path / "ran"
    meta.write_bytes(pickle.dumps(_Payload(str(made))))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):  # after running the payload (it returns no metadata)
        dcp.load({"x": torch.zeros(1)}, checkpoint_id=tmp_path / name, no_dist=True)
    assert made.is_dir()  # the payload ran under DCP's default reader
    made.rmdir()
    with pytest.raises(CheckpointError, match="cannot be loaded") as info:
        load_shards(tmp_path / name, {"policy": model2}, opt2, dist)
    assert not made.exists() and "\n" not in str(info.value)
    assert not is_shards_name("../" + name) and not is_shards_name(name + "/..") and not is_shards_name(3)


def test_a_forged_non_tensor_entry_runs_no_code(tmp_path):
    """AdamW's param groups are DCP byte entries, which its default planner reads with weights_only=False."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ppokit.lm.sharded_checkpoint import load_shards
    from ppokit.runtime import distributed
    from ppokit.runtime.checkpoint import CheckpointError

    tok, model, opt = _tiny_trained()
    model_sd, optim_sd = get_state_dict(nn.ModuleDict({"policy": model}), opt)
    made = tmp_path / "ran"
    optim_sd["param_groups"][0]["lr"] = _Payload(str(made))
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp_path / "ck", no_dist=True)
    model2, opt2 = _fresh(tok)
    reference = {"model": dict(model_sd), "optimizer": get_state_dict(nn.ModuleDict({"policy": model2}), opt2)[1]}
    dcp.load(reference, checkpoint_id=tmp_path / "ck", no_dist=True)
    assert made.is_dir()  # DCP's default planner ran it
    made.rmdir()
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        load_shards(tmp_path / "ck", {"policy": model2}, opt2, distributed.current())
    assert not made.exists()


FULL_DISK_SCRIPT = r'''
import resource, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_lm_sharded_checkpoint import _fresh, _tiny_trained
from ppokit.lm.sharded_checkpoint import save_shards
from ppokit.runtime import distributed
from ppokit.runtime.checkpoint import CheckpointError
run, dist = Path(sys.argv[1]), distributed.current()
tok, model, opt = _tiny_trained()
first = save_shards(run, {"policy": model}, opt, 1, dist)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
try:
    save_shards(run, {"policy": model}, opt, 2, dist)
except CheckpointError as exc:
    print("ERROR", exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print("LEFT", sorted(p.name for p in run.iterdir()), "FIRST", first)
'''


def test_a_failed_shards_write_is_one_line_and_leaves_the_previous_shards(tmp_path):
    """A write that fails midway (a file size limit: EFBIG, as ENOSPC on a full disk) raises CheckpointError in
    one line, removes its temp directory and leaves the previous shards directory whole."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    from ppokit.lm.sharded_checkpoint import load_shards
    from ppokit.runtime import distributed

    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), str(Path(__file__).parent)],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    error = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert len(error) == 1 and "could not write the sharded checkpoint" in error[0], proc.stdout
    assert "File too large" in error[0] and "previous checkpoint stays" in error[0]
    first = proc.stdout.rsplit("FIRST ", 1)[1].strip()
    assert f"LEFT ['{first}']" in proc.stdout  # no temp directory, no second shards directory
    tok, _, _ = _tiny_trained()
    model, opt = _fresh(tok)
    load_shards(tmp_path / "run" / first, {"policy": model}, opt, distributed.current())


def test_claim_removes_a_killed_shards_write_and_overwrite_removes_the_shards(tmp_path):
    from ppokit.runtime.rundir import claim

    run = tmp_path / "run"
    (run / ".shards-abc.tmp").mkdir(parents=True)
    (run / ".shards-abc.tmp" / "__0_0.distcp").write_bytes(b"x")
    (run / "shards-3-abc").mkdir()
    (run / "metrics.csv").write_text("update\n")
    claim(run, resume=True).release()
    assert not (run / ".shards-abc.tmp").exists() and (run / "shards-3-abc").is_dir()
    claim(run, overwrite=True).release()
    assert not (run / "shards-3-abc").exists()


# ---------------------------------------------------------------------- 2 ranks under torchrun
RUN_SCRIPT = r'''
import json, os, sys, time
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from ppokit.lm import GRPOTrainer, LMConfig, PPOTrainer
from ppokit.lm.fsdp import full
from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama
kind, run_dir, mode, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
moment, at = (sys.argv[5].split("@") if len(sys.argv) > 5 else ["", "3"])
pids = os.path.join(os.path.dirname(run_dir), "pids")
os.makedirs(pids, exist_ok=True)
open(os.path.join(pids, f"{os.getpid()}"), "w").close()
Trainer = GRPOTrainer if kind == "grpo" else PPOTrainer
tok = build_char_tokenizer("ABX:", pad_is_eos=True)
t = None
def pause(where, rank=None):
    # The moment the test kills at ("writing@3": in iteration 3's save, iteration 2's checkpoint published before it).
    if moment == where and t is not None and t.iteration == int(at) and (rank is None or dist.get_rank() == rank):
        open(os.path.join(os.path.dirname(run_dir), "paused"), "w").close()
        time.sleep(LIMIT)
LIMIT = 50
def reward(prompts, completions):
    pause("between")  # iteration 4's rollout: iteration 3's checkpoint is whole
    return [c.count("X") / max(len(c), 4) for c in completions]
kw = dict(reward=reward, prompts=["X:", "AB:", "BXAX:", "A:"])
import torch.distributed.checkpoint as dcp
import ppokit.lm.base as base
write_data, finish, save_checkpoint = dcp.FileSystemWriter.write_data, dcp.FileSystemWriter.finish, base.save_checkpoint
def slow_write(self, *a, **k):
    pause("writing", rank=1)  # rank 1 has not written its shard file
    return write_data(self, *a, **k)
def slow_finish(self, *a, **k):
    pause("metadata")  # every rank's file written, rank 0 not yet the .metadata
    return finish(self, *a, **k)
def slow_pointer(*a, **k):
    pause("renamed")  # shards-3-* published, trainer_state.pt still names iteration 2's
    return save_checkpoint(*a, **k)
dcp.FileSystemWriter.write_data, dcp.FileSystemWriter.finish, base.save_checkpoint = slow_write, slow_finish, slow_pointer
if mode == "train":
    cfg = LMConfig(learning_rate=3e-3, batch_prompts=4, group_size=2, max_new_tokens=6, beta=0.04, fsdp=True,
                   save_every=1, tensorboard=False, console=False, adaptive_kl=(kind == "ppo"))
    t = Trainer(build_tiny_llama(tok, seed=0), tok, config=cfg, run_dir=run_dir, **kw)
else:
    t = Trainer.resume(run_dir, build_tiny_llama(tok, seed=0), tok, **kw)
    if dist.get_rank() == 0:
        print("resumed at", t.iteration, flush=True)
t.train(total - t.iteration)
models = [t.policy] + ([t.value_model] if kind == "ppo" else [])
w = torch.cat([full(p).detach().double().reshape(-1) for m in models for p in m.parameters()]).tolist()
t.close()
if dist.get_rank() == 0:
    json.dump({"weights": w}, open(os.path.join(os.path.dirname(run_dir), f"{mode}.json"), "w"))
'''


def _launch(tmp_path: Path, *args: str) -> subprocess.Popen:
    script = tmp_path / "run.py"
    script.write_text(RUN_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args]
    return subprocess.Popen(cmd, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: the test kills all of it at once


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, err = proc.communicate(timeout=LAUNCH_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-4000:]
    return out


def _rows(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in csv.DictReader(f)]


def _alive(pids: list[int]) -> list[int]:
    from ppokit.runtime.procs import start_time

    return [p for p in pids if start_time(p) is not None]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 2-rank fsdp GRPO run of 6 iterations, checkpointed at each: its metrics rows and final weights."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    base = tmp_path_factory.mktemp("uninterrupted")
    _finish(_launch(base, "grpo", str(base / "run"), "train", "6"))
    return base


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ppo"])  # PPO's shards hold the critic too: GRPO's are a subset (also passed)
def test_each_rank_writes_its_shard_and_a_resume_on_as_many_ranks_continues_exactly(tmp_path, kind):
    """2 ranks, 3 iterations saved at each, vs 2 then a resume for the third (PPO: the adaptive KL controller and
    the critic too): the same metrics rows and the same weights bit for bit (every rank's sampling stream is in
    the checkpoint). The run dir holds one shards directory with one file per rank, about half of the weights
    and AdamW states each, and a trainer_state.pt with none of them."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    from ppokit.runtime.checkpoint import load_checkpoint

    full_run, split = tmp_path / "a", tmp_path / "b"
    full_run.mkdir()
    split.mkdir()
    # The uninterrupted run and the first part of the split one: one launch, one trainer after the other.
    _chain(tmp_path, (RUN_SCRIPT, [kind, full_run / "run", "train", "3"]),
           (RUN_SCRIPT, [kind, split / "run", "train", "2"]))
    assert "resumed at 2" in _finish(_launch(split, kind, str(split / "run"), "resume", "3"))
    assert _rows(split / "run") == _rows(full_run / "run") and len(_rows(full_run / "run")) == 3
    a = json.loads((full_run / "train.json").read_text())["weights"]
    b = json.loads((split / "resume.json").read_text())["weights"]
    assert a == b
    run = split / "run"
    [shards] = list(run.glob("shards-*"))
    state = load_checkpoint(run / "trainer_state.pt")
    assert state["shards"] == shards.name == f"shards-3-{shards.name.rsplit('-', 1)[1]}"
    assert "policy" not in state and "optimizer" not in state and "value_model" not in state
    files = {p.name: p.stat().st_size for p in shards.glob("__*.distcp")}
    assert sorted(files) == ["__0_0.distcp", "__1_0.distcp"]
    both = sum(files.values())
    # Each rank's share (weights + two moments, ~3x the weights) within 60% of the whole: none holds it all.
    assert all(size < 0.6 * both for size in files.values()), files
    assert (run / "trainer_state.pt").stat().st_size < 0.5 * both


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory):
    """A one-process fsdp GRPO run of 2 iterations (SAVE_SCRIPT): a consolidated checkpoint. Tests that change it
    copy it first."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    base = tmp_path_factory.mktemp("consolidated")
    (base / "script.py").write_text(SAVE_SCRIPT)
    proc = subprocess.run([sys.executable, str(base / "script.py"), "grpo", str(base / "run"), "train"],
                          env=_env(base), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return base / "run"


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_sharded_on_two_ranks_with_its_weights(tmp_path, consolidated):
    """1 -> 2 ranks: fsdp in one process trains unsharded and saves the whole tensors; a 2-rank resume shards
    them and holds exactly the saved weights and AdamW moments, then trains on. (2 -> 1 and 2 -> 2 from shards:
    test_lm_fsdp's resume test.)"""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import shutil

    run = tmp_path / "run"
    shutil.copytree(consolidated, run)
    assert not list(run.glob("shards-*"))  # one process: the consolidated format
    _torchrun(tmp_path, SAVE_SCRIPT, "grpo", str(run), "resume")
    saved, resumed = (json.loads((run / name).read_text()) for name in ("train_1.json", "resume_2.json"))
    assert resumed["iteration"] == 2 and resumed["after"] == 3
    assert resumed["weights"] == saved["weights"] and resumed["moments"] == saved["moments"]


# Where the launch is killed, in the save of which iteration -> the iteration whose checkpoint must survive. One
# run meets them in turn: killed at the first, resumed, killed at the next, ..., then resumed to its end.
MOMENTS = {
    "writing@3": 2,  # rank 1 writing its shard file of iteration 3
    "renamed@4": 3,  # shards-4-* in place, trainer_state.pt still naming iteration 3's
}
# Also passed, left out of the suite for its time (each moment is a ~25-40 s launch): "metadata" (both shard files
# written, .metadata not yet: the same half-written directory as "writing") and "between" (in iteration 4's rollout,
# no save under way: iteration 3's checkpoint survives).


@pytest.mark.slow
def test_kill_9_of_the_launch_at_each_moment_of_a_save_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    """SIGKILL to torchrun's process group at each moment of ``MOMENTS`` in turn (the first in the fresh launch, the
    next in the launch that resumed from it; the ranks run in sessions of their own: they die with torchrun's agent,
    ``distributed.current``): after each, no process of the launch is left; trainer_state.pt loads and names a whole
    shards directory of the last finished save; no policy/ yet (the periodic saves write shards only); the next
    launch resumes there. The last resume finishes the 6 iterations with the uninterrupted run's metrics rows and
    weights, leaves one shards directory and no temp, and exports a policy/ from_pretrained loads."""
    import torch
    from transformers import AutoModelForCausalLM

    from ppokit.runtime.checkpoint import load_checkpoint

    run = tmp_path / "run"
    mode, resumed_at = "train", None
    for moment, survivor in MOMENTS.items():
        proc = _launch(tmp_path, "grpo", str(run), mode, "6", moment)
        try:
            deadline = time.monotonic() + LAUNCH_S
            while not (tmp_path / "paused").exists():
                assert proc.poll() is None, f"{moment}: {proc.communicate()[1][-4000:]}"
                assert time.monotonic() < deadline, f"{moment}: the run never reached the moment"
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        out = proc.stdout.read()
        if resumed_at is not None:
            assert f"resumed at {resumed_at}" in out, f"{moment}: {out}"
        pids = [int(p.name) for p in (tmp_path / "pids").iterdir()]
        assert len(pids) == 2, f"{moment}: {pids}"
        deadline = time.monotonic() + 30
        while _alive([proc.pid, *pids]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive([proc.pid, *pids]), f"{moment}: a rank outlived the kill"

        state = load_checkpoint(run / "trainer_state.pt")
        assert state["iteration"] == survivor, f"{moment}: {state['iteration']}"
        assert (run / state["shards"] / ".metadata").is_file(), moment
        assert not (run / "policy").exists(), moment
        (tmp_path / "pids").rename(tmp_path / f"pids_{moment}")
        (tmp_path / "paused").unlink()
        mode, resumed_at = "resume", survivor
    out = _finish(_launch(tmp_path, "grpo", str(run), "resume", "6"))
    assert f"resumed at {resumed_at}" in out
    assert _rows(run) == _rows(uninterrupted / "run")
    assert (json.loads((tmp_path / "resume.json").read_text())["weights"]
            == json.loads((uninterrupted / "train.json").read_text())["weights"])
    assert [p.name for p in run.glob("shards-*")] == [load_checkpoint(run / "trainer_state.pt")["shards"]]
    assert not list(run.glob(".*.tmp"))
    model = AutoModelForCausalLM.from_pretrained(run / "policy")
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.slow
def test_bench_lm_checkpoint_smoke_writes_half_per_rank(tmp_path):
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_lm_checkpoint.py"
    proc = subprocess.run([sys.executable, str(bench), "--smoke"], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("sharded ", "consolidated "))]
    files = {(r[0], int(r[1])): float(r[4]) for r in rows}
    assert files[("sharded", 0)] + files[("sharded", 1)] == pytest.approx(files[("consolidated", 0)], rel=0.15)
    assert files[("sharded", 0)] < 0.6 * files[("consolidated", 0)] and "resharded into whole tensors" in proc.stdout


@pytest.mark.slow
def test_lm_export_consolidates_the_latest_shards_offline_into_what_the_final_save_exported(tmp_path,
                                                                                          uninterrupted,
                                                                                          consolidated):
    """``ppokit lm export RUN OUT --model START`` in one process: OUT loads with from_pretrained and gives the
    logits of the policy/ that the run's final save gathered from the ranks (the same iteration's weights), bit for
    bit. An existing OUT and a consolidated (one-process) run are one error line, exit 2."""
    import torch
    from transformers import AutoModelForCausalLM

    from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama

    start = tmp_path / "start"
    tok = build_char_tokenizer("ABX:", pad_is_eos=True)
    build_tiny_llama(tok, seed=0).save_pretrained(start)
    tok.save_pretrained(start)
    run, out = uninterrupted / "run", tmp_path / "out"

    def export(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ppokit", "lm", "export", *args], env=_env(tmp_path),
                              capture_output=True, text=True, timeout=TIMEOUT)

    proc = export(str(run), str(out), "--model", str(start))
    assert proc.returncode == 0 and "iteration 6" in proc.stdout, proc.stderr[-4000:]
    ids = torch.tensor([[1, 2, 3, 4, 2]])
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits
        gathered = AutoModelForCausalLM.from_pretrained(run / "policy")(input_ids=ids).logits
    assert torch.equal(ours, gathered)
    again = export(str(run), str(out), "--model", str(start))
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "exists" in again.stderr, again.stderr
    refused = export(str(consolidated), str(tmp_path / "out2"), "--model", str(start))
    assert refused.returncode == 2 and "consolidated checkpoint" in refused.stderr, refused.stderr
    assert refused.stderr.count("\n") == 1 and not (tmp_path / "out2").exists()
