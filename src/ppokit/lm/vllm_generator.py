"""``VLLMGenerator``: the ``Generator`` backend of ``sampler="vllm"`` (extra ``vllm``, CUDA machines only).

vLLM (Kwon et al. 2023, PagedAttention) samples completions much faster than a decoding loop in the trainer's
process once the model and the batch are large. It runs beside the trainer on the same GPU:

1. on the first call the policy's weights (a LoRA policy's merged into its base) and its ``config.json`` are
   written to a temporary directory, and ``vllm.LLM`` is built from it, in this process
   (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so weights can be handed over without copying them between processes),
   with ``GPU_MEMORY_FRACTION`` of the GPU for its KV cache and the policy's dtype;
2. before every call after an update the engine's weights are replaced by the policy's (``load_weights`` on the
   engine's model, with Hugging Face parameter names): the optimizer's in-place steps bump every trained
   parameter's version counter, so a changed sum of versions means the weights moved;
3. sampling is pure: ``temperature``, ``top_p = 1``, ``top_k`` off, no penalty, at most ``max_new_tokens``,
   stopping at ``stop_token_ids``; each request's seed is drawn from torch's global generator, which the
   trainers seed and checkpoint, so a seed still gives one run.

The engine's log-probs are not used: the rollout recomputes pi_old with the trainer's model (``rollout.sample``),
so the ratio's denominator is the trainer's, and a kernel difference between the two (bfloat16 engines) is at most
a slight off-policy gap, never a wrong ratio. Without CUDA or without vllm, asking for it is one line naming why
(``vllm_problem``, checked by ``LMConfig.validate`` before any model is loaded).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from ppokit.lm.generation import SamplingSettings, warn_ignored_generation_config

__all__ = ["VLLMGenerator", "vllm_problem", "GPU_MEMORY_FRACTION"]

# The share of the GPU vLLM may take for its weights and KV cache; the rest is the trainer's (policy, reference,
# optimizer state, activations). TRL's colocated vLLM defaults to the same 0.3 (vllm_gpu_memory_utilization).
GPU_MEMORY_FRACTION = 0.3
_SEED_MAX = 2**31 - 1


def vllm_problem(device: str) -> str | None:
    """Why ``sampler="vllm"`` cannot run here (one clause naming each missing piece), or None when it can."""
    reasons = []
    if importlib.util.find_spec("vllm") is None:
        reasons.append("the vllm package is not installed (pip install -e '.[vllm]', on a CUDA machine)")
    if not torch.cuda.is_available():
        reasons.append("this machine has no CUDA device")
    elif not str(device).startswith("cuda"):
        reasons.append(f"device is {device!r}: set device cuda (the engine runs beside the policy on its GPU)")
    if not reasons:
        return None
    return "vllm needs a CUDA device and the vllm extra: " + "; ".join(reasons) + " (sampler cached runs anywhere)"


def hf_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The policy's weights under Hugging Face names; a LoRA (peft) policy's adapter merged into the base weights
    while they are read (a generator: consume it before the next training step)."""
    merge = getattr(model, "merge_adapter", None)
    if merge is None:
        yield from model.state_dict().items()
        return
    merge()
    try:
        for name, t in model.state_dict().items():
            if "lora_" in name:
                continue
            yield name.removeprefix("base_model.model.").replace(".base_layer", ""), t
    finally:
        model.unmerge_adapter()


def _version(model: nn.Module) -> int:
    return sum(p._version for p in model.parameters())


class VLLMGenerator:
    """``Generator`` over a ``vllm.LLM`` built from the policy on its first call (module docstring)."""

    def __init__(self):
        self.llm: Any = None
        self._synced: tuple[int, int] | None = None  # (id(model), parameter version sum) the engine holds
        self._dir: tempfile.TemporaryDirectory | None = None
        self._warned: set[int] = set()

    def _build(self, model: nn.Module) -> None:
        from safetensors.torch import save_file

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (step 1)
        import vllm

        self._dir = tempfile.TemporaryDirectory(prefix="ppokit-vllm-")
        d = Path(self._dir.name)
        config = getattr(model, "get_base_model", lambda: model)().config
        config.save_pretrained(d)
        # Cloned to the CPU: safetensors refuses tensors sharing memory (tied embeddings).
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in hf_weights(model)},
                  str(d / "model.safetensors"))
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.llm = vllm.LLM(model=str(d), dtype=dtype, seed=0, gpu_memory_utilization=GPU_MEMORY_FRACTION,
                            enforce_eager=True, skip_tokenizer_init=True)

    def sync(self, model: nn.Module) -> None:
        """Load the policy's current weights into the engine (step 2)."""
        weights = list(hf_weights(model))
        apply = getattr(self.llm, "apply_model", None)
        if apply is not None:
            apply(lambda m: m.load_weights(weights))
        else:  # vLLM releases before LLM.apply_model
            self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)

    def generate(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                 settings: SamplingSettings) -> Tensor:
        from vllm import SamplingParams

        warn_ignored_generation_config(model, settings, self._warned)
        state = (id(model), _version(model))
        if self.llm is None:
            self._build(model)
        elif state != self._synced:
            self.sync(model)
        self._synced = state
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        seeds = torch.randint(_SEED_MAX, (len(prompts),)).tolist()  # torch's seeded stream (step 3)
        stops = list(settings.stop_token_ids)
        params = [SamplingParams(n=1, temperature=settings.temperature, top_p=1.0, top_k=-1, min_p=0.0,
                                 repetition_penalty=1.0, max_tokens=settings.max_new_tokens, stop_token_ids=stops,
                                 ignore_eos=True, detokenize=False, seed=int(s)) for s in seeds]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        rows = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            # A stop token ends the completion and belongs to it (the response mask runs through it).
            if c.finish_reason == "stop" and (not ids or ids[-1] not in stops):
                ids.append(c.stop_reason if isinstance(c.stop_reason, int) else settings.eos_token_id)
            rows.append(ids)
        R = max(1, max(len(r) for r in rows))
        block = torch.full((len(rows), R), settings.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            block[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        return block.to(prompt_ids.device)
