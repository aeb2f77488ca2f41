"""``sampler="vllm"``: where it cannot run (no CUDA, or no vllm) asking for it is one line naming why, from the
CLI (exit code 2, no traceback) and from Python (a ConfigError naming the field); on a CUDA machine with the vllm
extra, the engine samples the model's own distribution and holds the policy's weights after an update."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

from ppokit.core.errors import ConfigError  # noqa: E402
from ppokit.lm.config import LMConfig  # noqa: E402

HAS_VLLM = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs CUDA and the vllm extra")


def test_asking_for_vllm_where_it_cannot_run_is_one_line_naming_why(capsys):
    from ppokit.cli import main

    # The default device is the CPU: refused on every machine, before any model directory is read.
    rc = main(["lm", "grpo", "--model", "no-such-dir", "--reward", "r:f", "--prompts", "p.jsonl", "--sampler", "vllm"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1, err
    line = err[0]
    assert line.startswith("error: ") and "sampler" in line and "vllm needs a CUDA device and the vllm extra" in line
    assert "Traceback" not in line and "no-such-dir" not in line
    if not torch.cuda.is_available():
        assert "no CUDA device" in line
    if importlib.util.find_spec("vllm") is None:
        assert "pip install -e '.[vllm]'" in line
    if HAS_VLLM:
        assert "set device cuda" in line


def test_the_python_api_refuses_it_with_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match="sampler.*vllm needs a CUDA device") as info:
        LMConfig(sampler="vllm").validate()
    assert info.value.field == "sampler"


# ---------------------------------------------------------------- on a CUDA machine with the vllm extra
def _tiny_on_cuda():
    from ppokit.lm.tiny import TinySize, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer("ab:")
    # Head size 64: every vLLM attention backend takes it (the demo model's 16 is not).
    return build_tiny_model(tok, TinySize(n_layer=2, n_embd=128, n_head=2), seed=0).cuda(), tok


@pytest.mark.allow_skip
@needs_vllm
def test_vllm_samples_the_models_first_token_distribution():
    from ppokit.lm.generation import SamplingSettings
    from ppokit.lm.rollout import encode_prompts
    from ppokit.lm.vllm_generator import VLLMGenerator

    model, tok = _tiny_on_cuda()
    settings = SamplingSettings(1, 1.0, tok.eos_token_id, tok.pad_token_id)
    n = 4000
    ids, mask = encode_prompts(tok, ["ab:"] * n, tok.pad_token_id, torch.device("cuda"))
    torch.manual_seed(0)
    out = VLLMGenerator().generate(model, ids, mask, settings)
    assert out.shape == (n, 1)
    with torch.no_grad():
        probs = torch.softmax(model(ids[:1], attention_mask=mask[:1]).logits[0, -1].float(), -1).cpu()
    freq = torch.bincount(out[:, 0].cpu(), minlength=len(probs)).double() / n
    # Binomial standard error sqrt(p(1-p)/n) <= 0.008 at n = 4000: 5 of them is a bound no correct sampler reaches.
    assert (freq - probs.double()).abs().max() < 0.04


@pytest.mark.allow_skip
@needs_vllm
def test_a_grpo_iteration_on_vllm_trains_and_the_engine_holds_the_updated_weights():
    from ppokit.lm import GRPOTrainer

    model, tok = _tiny_on_cuda()
    cfg = LMConfig(device="cuda", sampler="vllm", batch_prompts=2, group_size=4, max_new_tokens=6, beta=0.0,
                   learning_rate=1e-2, update_epochs=1, num_minibatches=1, tensorboard=False, console=False)
    t = GRPOTrainer(model, tok, reward=lambda p, c: [float(x.count("a")) for x in c], prompts=["ab:", "ba:"],
                    config=cfg)
    start = {n: p.detach().float().cpu() for n, p in t.policy.named_parameters()}
    t.train(2)  # the second iteration's rollout syncs the weights the first one's update changed
    t.generate(["ab:"])  # and this call the second update's
    policy = {n: p.detach().float().cpu() for n, p in t.policy.named_parameters()}
    engine = t.backend.llm.apply_model(lambda m: {n: p.detach().float().cpu() for n, p in m.named_parameters()})[0]
    # The embeddings and the layer norms: vLLM keeps GPT-2's other (Conv1D) weights transposed or fused.
    shared = [n for n in engine if n in policy and (n.endswith(("wte.weight", "wpe.weight")) or policy[n].dim() == 1)]
    assert any(n.endswith("wte.weight") for n in shared), sorted(engine)
    for name in shared:
        assert torch.allclose(engine[name], policy[name], atol=1e-6), name
    wte = next(n for n in shared if n.endswith("wte.weight"))
    assert not torch.equal(policy[wte], start[wte])  # the updates moved them: a real sync was needed
