"""FSDP's options for the LM trainers (``ppokit.lm.fsdp``) on 2 ranks under torchrun, gloo on 127.0.0.1:
gradient checkpointing per transformer block, CPU offload of the shards and AdamW's states, and ``ppokit lm
grpo --nproc 2 --fsdp`` from the command line.

Each option must leave the run's numbers as they are (it trades memory for time): the reference is the same 2-rank
sharded run without it, same seed, same batches.
"""

from __future__ import annotations

import json

import pytest

from test_lm_fsdp import _torchrun

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


@pytest.mark.slow
def test_fsdp_gradient_checkpointing_recomputes_each_block_and_changes_no_number(tmp_path):
    """gradient_checkpointing under fsdp: every block's forward runs twice per update micro-batch (once more in
    the backward) instead of once, and 2 GRPO iterations give the same losses and weights as without it
    (measured: identical to the last bit on CPU; tolerance 1e-6, the recomputation may reorder a reduction)."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import torch

    _torchrun(tmp_path, OPTIONS_SCRIPT, str(tmp_path / "out.json"), "plain,checkpointing")
    out = json.loads((tmp_path / "out.json").read_text())
    plain, ckpt = out["plain"], out["checkpointing"]
    blocks = plain["blocks"]
    assert plain["mlp_calls"] == UPDATE_FORWARDS * blocks
    assert ckpt["mlp_calls"] == 2 * UPDATE_FORWARDS * blocks
    assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=1e-7)
    diff = float((torch.tensor(ckpt["params"]) - torch.tensor(plain["params"])).abs().max())
    print("max |param diff|", diff, plain["losses"], ckpt["losses"])
    assert diff < 1e-6, diff


@pytest.mark.slow
def test_fsdp_offload_keeps_the_shards_and_adamw_states_in_cpu_memory_and_changes_no_number(tmp_path):
    """fsdp_offload: every sharded module of the policy and pi_ref (each block and the root) runs with FSDP2's
    CPUOffloadPolicy, its shards and AdamW's moments are in CPU memory, and 2 GRPO iterations give the run without
    it, to the last bit (measured on CPU, where the offload copies nothing; tolerance 1e-6 all the same)."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import torch

    _torchrun(tmp_path, OPTIONS_SCRIPT, str(tmp_path / "out.json"), "plain,offload")
    out = json.loads((tmp_path / "out.json").read_text())
    plain, offload = out["plain"], out["offload"]
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


@pytest.mark.slow
def test_ppokit_lm_grpo_nproc_2_fsdp_trains_in_one_run_dir_and_leaves_no_process(tmp_path):
    """``ppokit lm grpo --nproc 2 --fsdp`` on a saved tiny GPT-2: the runtime launcher starts torchrun's agent and 2
    ranks; the run finishes (exit 0, rank 0's summary once), both ranks wrote into one default run dir (named once
    by the launching process, not by each rank's clock) and every process it started is gone when it returns."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import subprocess
    import sys
    import time

    from ppokit.lm.tiny import build_tiny, save_tiny
    from ppokit.runtime.checkpoint import load_checkpoint
    from test_distributed import _alive, _proc_children
    from test_lm_fsdp import TIMEOUT, _env

    model = save_tiny(*build_tiny("ab:", seed=0), tmp_path / "model")
    (tmp_path / "myreward.py").write_text(REWARD_MODULE)
    (tmp_path / "p.jsonl").write_text('{"prompt": "a:"}\n{"prompt": "b:"}\n')
    cmd = [sys.executable, "-m", "ppokit", "lm", "grpo", "--nproc", "2", "--fsdp", "--model", str(model),
           "--reward", "myreward:count_a", "--prompts", "p.jsonl", "--iterations", "2", "--batch-prompts", "2",
           "--group-size", "2", "--max-new-tokens", "4", "--num-minibatches", "1", "--update-epochs", "1",
           "--no-console", "--no-tensorboard"]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
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


def test_nproc_rank_argv_drops_nproc_and_names_the_run_dir():
    from ppokit.cli.lm_train import rank_argv

    argv = ["--model", "m", "--nproc", "2", "--fsdp", "--npro=3", "--no-console"]
    assert rank_argv(argv, "runs/x") == ["--model", "m", "--fsdp", "--no-console", "--run-dir=runs/x"]
    assert rank_argv(["--nproc=2", "--run-dir", "d"], "d") == ["--run-dir", "d"]
    assert rank_argv(["--nproc", "2", "--resume", "d"], None) == ["--resume", "d"]
