"""FSDP2 for the LM trainers (``LMConfig.fsdp``, ``ppokit.lm.fsdp``): 2 ranks under torchrun, gloo on 127.0.0.1.

The reference is the data-parallel run (every rank holds the whole model; gradients all-reduced by the sync hook)
with the same seed and the same global batch: each rank samples its own prompts from its own stream in both, so
the two runs see the same completions, and a sharded update must give the same losses and weights to rounding
(reduce-scatter vs all-reduce order, AdamW's normalization of near-zero gradients).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT = 300  # seconds for one launch: a bound, not a wait (a few tens of seconds on an idle machine)

PARITY_SCRIPT = r'''
import json, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from ppokit.lm import DPOTrainer, GRPOTrainer, LMConfig, PPOTrainer, SFTTrainer
from ppokit.lm.fsdp import full, is_sharded
from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama
reward = lambda prompts, completions: [c.count("X") / max(len(c), 4) for c in completions]
prompts = ["X:", "AB:", "BXAX:", "A:"]
out = {}
pairs = [("X:", "XX", "AB"), ("A:", "XA", "BB"), ("AB:", "XXX", "A"), ("B:", "X", "BA")]
rows = [{"prompt": p, "completion": c} for p, c, _ in pairs]
for kind in sys.argv[2].split(","):
    for fsdp in (False, True):
        tok = build_char_tokenizer("ABX:", pad_is_eos=True)
        model = build_tiny_llama(tok, seed=0)
        cfg = LMConfig(learning_rate=3e-3, batch_prompts=4, group_size=4, max_new_tokens=6, update_epochs=2,
                       num_minibatches=2, beta=0.04, fsdp=fsdp, tensorboard=False, console=False)
        if kind in ("grpo", "ppo"):
            Trainer = GRPOTrainer if kind == "grpo" else PPOTrainer
            t = Trainer(model, tok, reward=reward, prompts=prompts, config=cfg)
        else:
            Trainer = {"dpo": DPOTrainer, "sft": SFTTrainer}[kind]
            t = Trainer(model, tok, rows if kind == "sft" else pairs, config=cfg)
        assert is_sharded(t.policy) == fsdp and (t.ref_model is None or is_sharded(t.ref_model) == fsdp)
        losses = [v for _ in range(3) for k, v in sorted(t.step().items()) if "loss" in k or "nll" in k or "accuracy" in k]
        models = [t.policy] + ([t.value_model] if kind == "ppo" else [])
        params = [full(p).detach().double().reshape(-1) for m in models for p in m.parameters()]
        out[f"{kind}_{'fsdp' if fsdp else 'ddp'}"] = {"losses": losses, "params": torch.cat(params).tolist()}
        t.close()
if dist.get_rank() == 0:
    json.dump(out, open(sys.argv[1], "w"))
'''


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(scratch),
               PYTHONPATH=os.pathsep.join([src, env.get("PYTHONPATH", "")]))
    return env


def _torchrun(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(path), *args]
    proc = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


CHAIN_SCRIPT = r'''
import json, sys
for path, argv in json.loads(sys.argv[1]):  # each script as if launched alone: its own argv and globals
    sys.argv = [path, *argv]
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, {"__name__": "__main__", "__file__": path})
'''


def _chain(tmp_path: Path, *scripts: tuple[str, list[str]], nproc: int = 2) -> subprocess.CompletedProcess:
    """Several scripts one after the other in one launch (``nproc`` ranks under torchrun, or 1: one process), each
    with its own argv: the launch's start (torchrun, the imports, the process group) is paid once. Script ``i`` is
    written to ``tmp_path / f"script{i}.py"``."""
    steps = []
    for i, (script, args) in enumerate(scripts):
        path = tmp_path / f"script{i}.py"
        path.write_text(script)
        steps.append([str(path), [str(a) for a in args]])
    chain = tmp_path / "chain.py"
    chain.write_text(CHAIN_SCRIPT)
    run = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
           if nproc > 1 else [sys.executable])
    proc = subprocess.run([*run, str(chain), json.dumps(steps)], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=TIMEOUT * len(scripts))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


RESUME_KINDS = ["ppo"]  # PPO's checkpoint holds the critic too: GRPO's is a subset (also passed)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank launch (``_chain``) for this file's runs that need no launch of their own: the parity runs
    (``out.json``), the memory run (``mem.json``) and, for each of ``RESUME_KINDS``, the sharded run that
    checkpoints (``run_KIND/``; SAVE_SCRIPT's train mode)."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    base = tmp_path_factory.mktemp("two_ranks")
    _chain(base, (PARITY_SCRIPT, [base / "out.json", "grpo,ppo,dpo,sft"]), (MEMORY_SCRIPT, [base / "mem.json"]),
           *[(SAVE_SCRIPT, [kind, base / f"run_{kind}", "train"]) for kind in RESUME_KINDS])
    return base


@pytest.mark.slow
def test_two_rank_fsdp_grpo_ppo_dpo_and_sft_match_the_data_parallel_run(two_ranks):
    """GRPO (with pi_ref, sharded), PPO-RLHF (the critic sharded too), DPO (pi_ref sharded) and SFT on a tiny
    Llama: 3 iterations (GRPO/PPO: of 2 epochs x 2 minibatches) sharded over 2 ranks give the data-parallel
    run's losses and weights."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import torch

    out = json.loads((two_ranks / "out.json").read_text())
    for kind in ("grpo", "ppo", "dpo", "sft"):
        ddp, fsdp = out[f"{kind}_ddp"], out[f"{kind}_fsdp"]
        assert len(ddp["losses"]) >= 3 and fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-4, abs=1e-6), kind
        a, b = torch.tensor(ddp["params"]), torch.tensor(fsdp["params"])
        assert a.shape == b.shape, kind
        diff = float((a - b).abs().max())
        print(kind, "max |param diff|", diff, "losses", ddp["losses"], fsdp["losses"])
        assert diff < 1e-5, (kind, diff)  # measured: 6e-8 (GRPO, SFT), 1.2e-7 (PPO), 0 (DPO)


MEMORY_SCRIPT = r'''
import json, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from ppokit.lm import GRPOTrainer, LMConfig
from ppokit.lm.fsdp import local_bytes
from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama
tok = build_char_tokenizer("ABX:", pad_is_eos=True)
model = build_tiny_llama(tok, seed=0)
whole = sum(p.numel() * p.element_size() for p in model.parameters())
cfg = LMConfig(batch_prompts=2, group_size=2, max_new_tokens=4, beta=0.04, fsdp=True, tensorboard=False,
               console=False)
t = GRPOTrainer(model, tok, reward=lambda p, c: [float(len(x)) for x in c], prompts=["A:", "B:"], config=cfg)
t.step()  # AdamW's moments exist after the first step
params = [p for p in t.policy.parameters()]
moments = [v for s in t.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
out = {"whole": whole, "params": local_bytes(params), "moments": local_bytes(moments),
       "ref": local_bytes(list(t.ref_model.parameters()))}
t.close()
every = [None] * dist.get_world_size()
dist.all_gather_object(every, out)
if dist.get_rank() == 0:
    json.dump(every, open(sys.argv[1], "w"))
'''


@pytest.mark.slow
def test_two_rank_fsdp_holds_about_half_the_weights_and_adamw_states_per_rank(two_ranks):
    """From the local shards' sizes (DTensor.to_local()): each of 2 ranks holds about half of the policy's
    weights, of AdamW's two moments (2x the weights unsharded) and of pi_ref. 'About': fully_shard splits each
    parameter's first dimension in ceil(n / 2) rows, so an odd row count (the tiny vocabulary's 7) leaves rank 1 a row
    short (measured: 42304 and 43136 bytes of pi_ref on rank 0 for 84352 whole, within 2.3%)."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    ranks = json.loads((two_ranks / "mem.json").read_text())
    whole = ranks[0]["whole"]
    for r in ranks:
        print(r)
        assert r["params"] == pytest.approx(whole / 2, rel=0.05)
        assert r["moments"] == pytest.approx(whole, rel=0.05)  # two moments of half the weights
        assert r["ref"] == pytest.approx(whole / 2, rel=0.05)
    assert sum(r["params"] for r in ranks) == whole  # the shards partition the weights: nothing held twice


SAVE_SCRIPT = r'''
import json, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from ppokit.lm import GRPOTrainer, LMConfig, PPOTrainer
from ppokit.lm.fsdp import full, full_optimizer_state
from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama
kind, run_dir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
Trainer = GRPOTrainer if kind == "grpo" else PPOTrainer
tok = build_char_tokenizer("ABX:", pad_is_eos=True)
reward = lambda prompts, completions: [c.count("X") / max(len(c), 4) for c in completions]
kw = dict(reward=reward, prompts=["X:", "AB:", "BXAX:", "A:"])
def weights(t):
    models = [t.policy] + ([t.value_model] if kind == "ppo" else [])
    return torch.cat([full(p).detach().double().reshape(-1) for m in models for p in m.parameters()]).tolist()
def moments(t):
    st = full_optimizer_state(t.optimizer)["state"]
    return torch.cat([v.double().reshape(-1) for s in st.values() for k, v in s.items() if k == "exp_avg"]).tolist()
if mode == "train":
    cfg = LMConfig(learning_rate=3e-3, batch_prompts=4, group_size=2, max_new_tokens=6, beta=0.04, fsdp=True,
                   save_every=1, tensorboard=False, console=False)
    t = Trainer(build_tiny_llama(tok, seed=0), tok, config=cfg, run_dir=run_dir, **kw)
    t.train(2)
    ids = torch.tensor([[1, 2, 3, 4, 2]])
    with torch.no_grad():
        logits = t.policy(input_ids=ids).logits.double().tolist()  # sharded forward: every rank takes part
else:
    t = Trainer.resume(run_dir, build_tiny_llama(tok, seed=0), tok, **kw)
    logits = None
out = {"weights": weights(t), "moments": moments(t), "logits": logits, "iteration": t.iteration,
       "world": dist.get_world_size() if dist.is_initialized() else 1}
if mode == "resume":
    t.step()  # and it trains on
    out["after"] = t.iteration
t.close()
if not dist.is_initialized() or dist.get_rank() == 0:
    json.dump(out, open(run_dir + f"/{mode}_{out['world']}.json", "w"))
'''


@pytest.mark.slow
@pytest.mark.parametrize("kind", RESUME_KINDS)
def test_a_sharded_run_resumes_on_2_and_1_ranks_and_exports_for_from_pretrained(tmp_path, kind, two_ranks):
    """fsdp on 2 ranks checkpoints each rank's shards of the weights and AdamW moments (lm.sharded_checkpoint); a
    resume on 2 ranks and in 1 process (resharded by DCP into whole tensors) holds exactly the saved weights and
    moments and trains on; policy/, gathered at the last save, loads with from_pretrained in one process and gives
    the sharded model's logits."""
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    import torch
    from transformers import AutoModelForCausalLM

    run = two_ranks / f"run_{kind}"  # trained by the fixture's launch; only this test resumes it
    _torchrun(tmp_path, SAVE_SCRIPT, kind, str(run), "resume")
    proc = subprocess.run([sys.executable, str(tmp_path / "script.py"), kind, str(run), "resume"],  # 1 process
                          env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = json.loads((run / "train_2.json").read_text())
    for world in (2, 1):
        resumed = json.loads((run / f"resume_{world}.json").read_text())
        assert resumed["iteration"] == 2 and resumed["after"] == 3, world
        assert resumed["weights"] == saved["weights"], world  # bit-exact: the shards, resharded on load
        assert resumed["moments"] == saved["moments"], world
    model = AutoModelForCausalLM.from_pretrained(run / "policy")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4, 2]])).logits.double()
    diff = float((logits - torch.tensor(saved["logits"])).abs().max())
    assert diff < 1e-5, diff


@pytest.mark.slow
def test_bench_lm_scale_smoke_halves_the_per_rank_bytes(tmp_path):
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_lm_scale.py"
    proc = subprocess.run([sys.executable, str(bench), "--smoke"], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ratio = float(proc.stdout.rsplit("ratio 2 ranks / 1 rank (the larger rank):", 1)[1])
    assert 0.45 < ratio < 0.55, proc.stdout
