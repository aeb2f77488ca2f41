"""FSDP's options for the LM trainers (``ppokit.lm.fsdp``) on 2 ranks under torchrun, gloo on 127.0.0.1:
gradient checkpointing per transformer block, CPU offload of the shards and AdamW's states, and ``ppokit lm
grpo --nproc 2 --fsdp`` from the command line.

Each option must leave the run's numbers as they are (it trades memory for time): the reference is the same 2-rank
sharded run without it, same seed, same batches.
"""

from __future__ import annotations

import json

import pytest

from test_lm_fsdp import _chain

OPTIONS_SCRIPT = r'''
import json, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from ppokit.lm import GRPOTrainer, LMConfig
from ppokit.lm.fsdp import full, is_sharded, transformer_blocks
from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama
reward = lambda prompts, completions: [c.count("X") / max(len(c), 4) for c in completions]
out = {}
for option in sys.argv[2].split(","):
    tok = build_char_tokenizer("ABX:", pad_is_eos=True)
    model = build_tiny_llama(tok, seed=0)
    cfg = LMConfig(learning_rate=3e-3, batch_prompts=4, group_size=4, max_new_tokens=6, update_epochs=2,
                   num_minibatches=2, beta=0.04, fsdp=True, tensorboard=False, console=False,
                   gradient_checkpointing=option == "checkpointing", fsdp_offload=option == "offload")
    t = GRPOTrainer(model, tok, reward=reward, prompts=["X:", "AB:", "BXAX:", "A:"], config=cfg)
    assert is_sharded(t.policy) and is_sharded(t.ref_model)
    # The MLP runs inside its block's forward, which checkpointing runs again in the backward (FSDP2's hooks, on
    # the block's __call__, stay outside: they run once either way). Counted by the MLP's own forward (module
    # forward hooks do not fire in transformers' recomputation), where gradients are recorded: the update's
    # forwards and their recomputation, not the no-gradient rollout and log-prob passes.
    calls = [0]
    def counted(forward):
        def run(*args, **kwargs):
            calls[0] += torch.is_grad_enabled()
            return forward(*args, **kwargs)
        return run
    for block in transformer_blocks(t.policy):
        block.mlp.forward = counted(block.mlp.forward)
    losses = [v for _ in range(2) for k, v in sorted(t.step().items()) if "loss" in k]
    params = torch.cat([full(p).detach().double().reshape(-1) for p in t.policy.parameters()])
    devices = sorted({str(p.to_local().device) for p in t.policy.parameters()}
                     | {str(v.to_local().device) for s in t.optimizer.state.values() for v in s.values()
                        if hasattr(v, "to_local")})
    # Each sharded module's own record of where its shards live (FSDP2's parameter groups).
    offloaded = [g.offload_policy.__class__.__name__ for m in (t.policy, t.ref_model) for g in
                 (s._fsdp_param_group for s in (b._get_fsdp_state() for b in m.modules() if hasattr(b, "_get_fsdp_state")))
                 if g is not None]
    out[option] = {"losses": losses, "params": params.tolist(), "mlp_calls": calls[0],
                   "blocks": len(transformer_blocks(t.policy)), "devices": devices, "offload": sorted(set(offloaded)),
                   "sharded_modules": len(offloaded)}
    t.close()
if dist.get_rank() == 0:
    json.dump(out, open(sys.argv[1], "w"))
'''

# 2 iterations x 2 epochs x 2 minibatches, one micro-batch each (micro_batch_size None): the update's forwards.
UPDATE_FORWARDS = 2 * 2 * 2


def _has_peft() -> bool:
    import importlib.util

    return importlib.util.find_spec("peft") is not None


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank launch (``_chain``) for every 2-rank run of this file that needs no launcher of its own: the
    plain run, then gradient checkpointing, then offload (same seed and batches); with peft, the LoRA runs (GRPO
    and DPO, data-parallel and sharded) and the sharded LoRA run that checkpoints. Its directory: ``options.json``,
    ``two.json`` and ``lora_run/``."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    base = tmp_path_factory.mktemp("two_ranks")
    scripts = [(OPTIONS_SCRIPT, [base / "options.json", "plain,checkpointing,offload"])]
    if _has_peft():
        scripts += [(LORA_SCRIPT, [base / "two.json", "grpo,dpo"]), (LORA_SAVE_SCRIPT, [base / "lora_run", "train"])]
    _chain(base, *scripts)
    return base


@pytest.fixture(scope="module")
def options(two_ranks):
    """Each option's results, and the plain run they are held against."""
    return json.loads((two_ranks / "options.json").read_text())


@pytest.fixture(scope="module")
def lora_one_process(two_ranks):
    """One process after the 2-rank launch: the one-process DPO LoRA run (``one.json``) and the resume of the
    sharded LoRA run (``lora_run/resume_1.json``)."""
    pytest.importorskip("peft", reason="needs pip install -e '.[lora]'")
    _chain(two_ranks, (LORA_SCRIPT, [two_ranks / "one.json", "dpo"]),
           (LORA_SAVE_SCRIPT, [two_ranks / "lora_run", "resume"]), nproc=1)
    return two_ranks


@pytest.mark.slow
def test_fsdp_gradient_checkpointing_recomputes_each_block_and_changes_no_number(options):
    """gradient_checkpointing under fsdp: every block's forward runs twice per update micro-batch (once more in
    the backward) instead of once, and 2 GRPO iterations give the same losses and weights as without it
    (measured: identical to the last bit on CPU; tolerance 1e-6, the recomputation may reorder a reduction)."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import torch

    plain, ckpt = options["plain"], options["checkpointing"]
    blocks = plain["blocks"]
    assert plain["mlp_calls"] == UPDATE_FORWARDS * blocks
    assert ckpt["mlp_calls"] == 2 * UPDATE_FORWARDS * blocks
    assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=1e-7)
    diff = float((torch.tensor(ckpt["params"]) - torch.tensor(plain["params"])).abs().max())
    print("max |param diff|", diff, plain["losses"], ckpt["losses"])
    assert diff < 1e-6, diff


@pytest.mark.slow
def test_fsdp_offload_keeps_the_shards_and_adamw_states_in_cpu_memory_and_changes_no_number(options):
    """fsdp_offload: every sharded module of the policy and pi_ref (each block and the root) runs with FSDP2's
    CPUOffloadPolicy, its shards and AdamW's moments are in CPU memory, and 2 GRPO iterations give the run without
    it, to the last bit (measured on CPU, where the offload copies nothing; tolerance 1e-6 all the same)."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import torch

    plain, offload = options["plain"], options["offload"]
    assert plain["offload"] == ["OffloadPolicy"]  # FSDP2's default: no offload
    assert offload["offload"] == ["CPUOffloadPolicy"]
    assert offload["sharded_modules"] == 2 * (plain["blocks"] + 1)  # policy and pi_ref: each block, then the root
    assert offload["devices"] == ["cpu"]
    assert offload["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=1e-7)
    diff = float((torch.tensor(offload["params"]) - torch.tensor(plain["params"])).abs().max())
    print("max |param diff|", diff)
    assert diff < 1e-6, diff


def test_fsdp_offload_without_fsdp_is_refused_in_one_line():
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    from ppokit.core.errors import ConfigError
    from ppokit.lm.config import LMConfig

    with pytest.raises(ConfigError, match="fsdp_offload.*add --fsdp") as info:
        LMConfig(fsdp_offload=True).validate()
    assert "\n" not in str(info.value)
    LMConfig(fsdp=True, fsdp_offload=True).validate()


REWARD_MODULE = "def count_a(prompts, completions, **info):\n    return [c.count('a') / 4 for c in completions]\n"


def _lm_nproc(tmp_path, *extra: str):
    """``ppokit lm grpo --nproc 2 --fsdp`` on a saved tiny GPT-2, started in ``tmp_path`` (its reward module and
    prompts there, the default run dir under ``runs/``)."""
    import subprocess
    import sys

    from ppokit.lm.tiny import build_tiny, save_tiny
    from test_lm_fsdp import _env

    model = save_tiny(*build_tiny("ab:", seed=0), tmp_path / "model")
    (tmp_path / "myreward.py").write_text(REWARD_MODULE)
    (tmp_path / "p.jsonl").write_text('{"prompt": "a:"}\n{"prompt": "b:"}\n')
    cmd = [sys.executable, "-m", "ppokit", "lm", "grpo", "--nproc", "2", "--fsdp", "--model", str(model),
           "--reward", "myreward:count_a", "--prompts", "p.jsonl", "--batch-prompts", "2", "--group-size", "2",
           "--max-new-tokens", "4", "--num-minibatches", "1", "--update-epochs", "1", "--no-console",
           "--no-tensorboard", *extra]
    return subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_ppokit_lm_grpo_nproc_2_fsdp_trains_in_one_run_dir_and_leaves_no_process(tmp_path):
    """``ppokit lm grpo --nproc 2 --fsdp`` on a saved tiny GPT-2: the runtime launcher starts torchrun's agent and 2
    ranks; the run finishes (exit 0, rank 0's summary once), both ranks wrote into one default run dir (named once
    by the launching process, not by each rank's clock) and every process it started is gone when it returns."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import time

    from ppokit.runtime.checkpoint import load_checkpoint
    from test_distributed import _alive, _proc_children
    from test_lm_fsdp import TIMEOUT

    launcher = _lm_nproc(tmp_path, "--iterations", "2")
    seen: set[int] = set()
    deadline = time.monotonic() + TIMEOUT
    try:
        while launcher.poll() is None:  # every descendant it starts: torchrun's agent, then the ranks
            assert time.monotonic() < deadline, "ppokit lm grpo --nproc 2 did not finish"
            for agent in _proc_children(launcher.pid):
                seen.update([agent, *_proc_children(agent)])
            time.sleep(0.1)
        out, err = launcher.communicate()
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-4000:]
    assert len(seen) >= 3, seen  # the agent and 2 ranks were seen
    assert not _alive(sorted(seen))
    assert out.count("ppokit lm grpo: 2 iterations") == 1, out
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs
    state = load_checkpoint(runs[0] / "trainer_state.pt")
    assert state["iteration"] == 2 and (runs[0] / state["shards"]).is_dir() and (runs[0] / "policy").is_dir()


@pytest.mark.slow
# kill -9 of the launcher (also passed, 14 s) is left to test_distributed.py's
# test_kill_9_of_the_nproc_launcher_leaves_no_rank_or_torchrun_behind: ppokit lm --nproc runs the same launcher.
@pytest.mark.parametrize("how", ["SIGINT", "rank1-SIGKILL"])
def test_a_signal_or_kill_9_to_ppokit_lm_nproc_stops_every_rank_after_a_sharded_save(tmp_path, how):
    """Ctrl-C (SIGINT) to ``ppokit lm grpo --nproc 2 --fsdp`` exits 130 once both ranks have saved and stopped;
    kill -9 of it closes the launcher's pipe, and torchrun's agent stops the ranks as for SIGTERM (they watch the
    launcher, ``runtime.launcher.watch_launcher``). Either way no process is left, and the run dir holds a sharded
    checkpoint of a finished iteration (save_every is large: only the stop saves). Rank 1 killed: one line names it
    and the command that resumes the run (no traceback), and no process is left."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import os
    import signal
    import time

    from ppokit.runtime.checkpoint import load_checkpoint
    from test_distributed import _alive, _proc_children, _rank_of, _until
    from test_lm_fsdp import TIMEOUT

    launcher = _lm_nproc(tmp_path, "--iterations", "100000", "--save-every", "100000")
    started: list[int] = []  # the agent and the ranks, once seen
    try:
        _until(lambda: launcher.poll() is not None or len(list(tmp_path.glob("runs/*/completions.jsonl"))) == 1,
               "the run did not start")
        assert launcher.poll() is None, launcher.communicate()
        agent = _until(lambda: _proc_children(launcher.pid), "no torchrun agent")[0]
        ranks = _until(lambda: len(_proc_children(agent)) == 2 and _proc_children(agent), "no 2 ranks")
        started += [agent, *ranks]
        if how == "SIGINT":
            launcher.send_signal(signal.SIGINT)
            _, err = launcher.communicate(timeout=TIMEOUT)
            assert launcher.returncode == 130, err[-3000:]
            assert "Traceback" not in err, err[-3000:]
        elif how == "SIGKILL":
            launcher.kill()
            launcher.wait()
        else:
            os.kill(next(p for p in ranks if _rank_of(p) == 1), signal.SIGKILL)
            _, err = launcher.communicate(timeout=TIMEOUT)
            # The error lines (transformers' "Writing model shards" bar of a save may sit beside them on stderr).
            lines = [line for line in err.splitlines() if line.startswith("error:")]
            assert launcher.returncode not in (0, None)
            assert "Traceback" not in err, err[-3000:]
            assert len(lines) == 1 and "rank 1 of 2 was killed by SIGKILL (signal 9)" in lines[0], err[-3000:]
            assert "continue with ppokit lm grpo --nproc 2 --resume RUN_DIR" in lines[0], lines[0]
        deadline = time.monotonic() + TIMEOUT
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(started)
    finally:
        launcher.kill()
        for p in _alive(started):
            os.kill(p, signal.SIGKILL)
    if how.startswith("rank"):
        return
    run = next(tmp_path.glob("runs/*"))
    state = load_checkpoint(run / "trainer_state.pt")
    assert state["iteration"] >= 1 and (run / state["shards"]).is_dir()


def test_nproc_rank_argv_drops_nproc_and_names_the_run_dir():
    from ppokit.cli.lm_train import rank_argv

    argv = ["--model", "m", "--nproc", "2", "--fsdp", "--npro=3", "--no-console"]
    assert rank_argv(argv, "runs/x") == ["--model", "m", "--fsdp", "--no-console", "--run-dir=runs/x"]
    assert rank_argv(["--nproc=2", "--run-dir", "d"], "d") == ["--run-dir", "d"]
    assert rank_argv(["--nproc", "2", "--resume", "d"], None) == ["--resume", "d"]


LORA_SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
import peft
from ppokit.lm import DPOTrainer, GRPOTrainer, LMConfig
from ppokit.lm.fsdp import full, is_sharded, local_bytes
from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama
reward = lambda prompts, completions: [c.count("X") / max(len(c), 4) for c in completions]
pairs = [("X:", "XX", "AB"), ("A:", "XA", "BB"), ("AB:", "XXX", "A"), ("B:", "X", "BA")]
ranks = int(os.environ.get("WORLD_SIZE", "1"))
out = {}
for kind in sys.argv[2].split(","):
    for fsdp in (False, True) if ranks > 1 else (False,):
        tok = build_char_tokenizer("ABX:", pad_is_eos=True)
        torch.manual_seed(0)  # peft draws the adapter's initial weights from the global stream
        model = peft.get_peft_model(build_tiny_llama(tok, seed=0), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        cfg = LMConfig(learning_rate=3e-2, batch_prompts=4, group_size=4, max_new_tokens=6, update_epochs=2,
                       num_minibatches=2, beta=0.1, fsdp=fsdp, tensorboard=False, console=False)
        if kind == "grpo":
            t = GRPOTrainer(model, tok, reward=reward, prompts=["X:", "AB:", "BXAX:", "A:"], config=cfg)
        else:
            t = DPOTrainer(model, tok, pairs, config=cfg)
        assert t.ref_model is None and is_sharded(t.policy) == (fsdp and ranks > 1)  # pi_ref: the adapter off
        named = dict(t.policy.named_parameters())
        adapter = [p for n, p in named.items() if "lora_" in n]
        base = [p for n, p in named.items() if "lora_" not in n]
        held = {"adapter": local_bytes(adapter) / sum(p.numel() * p.element_size() for p in adapter),
                "base": local_bytes(base) / sum(p.numel() * p.element_size() for p in base)}
        losses = [v for _ in range(3) for k, v in sorted(t.step().items()) if "loss" in k]
        out[f"{kind}_{'fsdp' if fsdp else 'ddp'}"] = {
            "losses": losses, "held": held,
            "adapter": torch.cat([full(p).detach().double().reshape(-1) for p in adapter]).tolist(),
            "base": torch.cat([full(p).detach().double().reshape(-1) for p in base]).tolist()}
        t.close()
if ranks == 1 or dist.get_rank() == 0:
    json.dump(out, open(sys.argv[1], "w"))
'''


@pytest.mark.slow
def test_fsdp_lora_shards_the_frozen_base_and_the_adapter_and_matches_unsharded_runs(lora_one_process):
    """A LoRA (peft) policy under fsdp: the adapter is applied before fully_shard, so each block's frozen base
    weights and its adapter are sharded together (each of 2 ranks holds about half of both) and only the adapter
    trains; pi_ref is the same sharded module with the adapter disabled. GRPO and DPO (3 iterations) give the
    2-rank data-parallel LoRA run's losses and weights, and DPO (no sampling: the same global batch of pairs on
    any number of ranks) the one-process run's (measured: equal bits vs data-parallel, 2.1e-7 vs one process)."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    pytest.importorskip("peft", reason="needs pip install -e '.[lora]'")
    import torch

    base = lora_one_process
    two, one = json.loads((base / "two.json").read_text()), json.loads((base / "one.json").read_text())
    start = None
    for kind in ("grpo", "dpo"):
        ddp, fsdp = two[f"{kind}_ddp"], two[f"{kind}_fsdp"]
        assert ddp["held"] == {"adapter": 1.0, "base": 1.0}
        assert fsdp["held"]["adapter"] == pytest.approx(0.5, abs=0.05)
        assert fsdp["held"]["base"] == pytest.approx(0.5, abs=0.05)
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5, abs=1e-6), kind
        assert fsdp["base"] == ddp["base"]  # frozen: bit for bit
        start = fsdp["base"] if start is None else start
        assert fsdp["base"] == start  # and the same in both trainers: the base never moved
        diff = float((torch.tensor(fsdp["adapter"]) - torch.tensor(ddp["adapter"])).abs().max())
        assert diff < 1e-5, (kind, diff)
    diff = float((torch.tensor(two["dpo_fsdp"]["adapter"]) - torch.tensor(one["dpo_ddp"]["adapter"])).abs().max())
    print("DPO LoRA, 2-rank fsdp vs 1 process: max |adapter diff|", diff)
    assert diff < 1e-5, diff
    assert two["dpo_fsdp"]["losses"] == pytest.approx(one["dpo_ddp"]["losses"], rel=1e-5, abs=1e-6)


LORA_SAVE_SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
import peft
from ppokit.lm import GRPOTrainer, LMConfig
from ppokit.lm.fsdp import full
from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama
reward = lambda prompts, completions: [c.count("X") / max(len(c), 4) for c in completions]
run_dir, mode = sys.argv[1], sys.argv[2]
tok = build_char_tokenizer("ABX:", pad_is_eos=True)
torch.manual_seed(0)
model = peft.get_peft_model(build_tiny_llama(tok, seed=0), peft.LoraConfig(
    r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
kw = dict(reward=reward, prompts=["X:", "AB:", "BXAX:", "A:"])
if mode == "train":
    cfg = LMConfig(learning_rate=3e-2, batch_prompts=4, group_size=2, max_new_tokens=6, beta=0.04, fsdp=True,
                   save_every=1, tensorboard=False, console=False)
    t = GRPOTrainer(model, tok, config=cfg, run_dir=run_dir, **kw)
    t.train(2)
else:
    t = GRPOTrainer.resume(run_dir, model, tok, **kw)
adapter = torch.cat([full(p).detach().double().reshape(-1) for n, p in t.policy.named_parameters() if "lora_" in n])
with torch.no_grad():
    logits = t.policy(input_ids=torch.tensor([[1, 2, 3, 4, 2]])).logits.double()  # sharded: every rank takes part
world = int(os.environ.get("WORLD_SIZE", "1"))
out = {"adapter": adapter.tolist(), "logits": logits.tolist(), "iteration": t.iteration}
t.close()
if world == 1 or dist.get_rank() == 0:
    json.dump(out, open(f"{run_dir}/{mode}_{world}.json", "w"))
'''


@pytest.mark.slow
def test_a_sharded_lora_run_resumes_in_one_process_and_exports_its_adapter(lora_one_process):
    """A 2-rank fsdp LoRA GRPO run's sharded checkpoint resumes in one process with exactly its adapter, and the
    policy/ its last save wrote is a peft adapter that PeftModel.from_pretrained puts on the base model, giving
    the sharded model's logits."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    peft = pytest.importorskip("peft", reason="needs pip install -e '.[lora]'")
    import torch

    from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama

    run = lora_one_process / "lora_run"
    saved, resumed = (json.loads((run / name).read_text()) for name in ("train_2.json", "resume_1.json"))
    assert resumed["iteration"] == 2 and resumed["adapter"] == saved["adapter"]  # bit-exact, resharded by DCP
    assert (run / "policy" / "adapter_config.json").is_file()
    tok = build_char_tokenizer("ABX:", pad_is_eos=True)
    model = peft.PeftModel.from_pretrained(build_tiny_llama(tok, seed=0), run / "policy")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4, 2]])).logits.double()
    diff = float((logits - torch.tensor(saved["logits"])).abs().max())
    assert diff < 1e-5, diff  # measured: 2.2e-8


def test_the_memory_check_counts_a_rank_s_shards_of_the_models_and_none_offloaded():
    """``estimate_lm_memory`` under fsdp on K ranks: the models' term (copies, gradients, AdamW's moments) is 1/K
    of the unsharded one on each rank, 0 on the device with fsdp_offload; sampling and the update's activations are
    per rank as before. A run that fits once sharded is not refused for the whole model's optimizer."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    from ppokit.lm.checks import estimate_lm_memory
    from ppokit.lm.config import LMConfig
    from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama

    model = build_tiny_llama(build_char_tokenizer("ABX:", pad_is_eos=True), seed=0)
    n = sum(p.numel() for p in model.parameters())

    def parts(shards, **kw):
        return estimate_lm_memory(LMConfig(fsdp=True, **kw), model, 8, 8, 8, extra_models=1, value_model=False,
                                  shards=shards)

    whole, half, offloaded = parts(1), parts(2), parts(2, fsdp_offload=True)
    assert whole["models"] == n * 4 + n * (8 + 4)  # pi_ref + (gradient + two moments) of float32 weights
    assert half["models"] == whole["models"] // 2 and offloaded["models"] == 0
    assert half["rollout"] == whole["rollout"] == offloaded["rollout"]
    assert half["update"] == whole["update"] == offloaded["update"]
