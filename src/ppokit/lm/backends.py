"""The ``Generator`` a config's ``sampler`` names: ``cached`` (``sampling.CachedSampler``, ppokit's own decoding
loop), ``hf`` (``generation.HFGenerator``, ``model.generate``) or ``vllm`` (``vllm_generator.VLLMGenerator``, a
vLLM engine on a CUDA machine). Each samples the plain tempered distribution; the trainer recomputes every
log-probability itself, so the choice changes speed, never the math."""

from __future__ import annotations

from typing import Any

__all__ = ["SAMPLERS", "make_generator"]

SAMPLERS = ("cached", "hf", "vllm")


def make_generator(sampler: str) -> Any:
    """A new backend for ``sampler`` (one of ``SAMPLERS``; ``LMConfig.validate`` has checked it can run here)."""
    if sampler == "cached":
        from ppokit.lm.sampling import CachedSampler

        return CachedSampler()
    if sampler == "hf":
        from ppokit.lm.generation import HFGenerator

        return HFGenerator()
    if sampler == "vllm":
        from ppokit.lm.vllm_generator import VLLMGenerator

        return VLLMGenerator()
    raise ValueError(f"sampler: unknown backend {sampler!r}; choose one of {', '.join(SAMPLERS)}")
