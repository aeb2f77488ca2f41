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
                   gradient_checkpointing=option == "checkpointing")
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
    out[option] = {"losses": losses, "params": params.tolist(), "mlp_calls": calls[0],
                   "blocks": len(transformer_blocks(t.policy)), "devices": devices}
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
