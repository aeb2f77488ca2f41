"""ppokit.lm: PPO-RLHF, GRPO and DPO on any Hugging Face causal LM (``pip install -e ".[lm]"``; LoRA: ``.[lora]``).

Imported lazily: ``import ppokit`` never imports this package, and ``ppokit.lm`` imports transformers only when a
trainer is used (``LMConfig`` does not need it)::

    from ppokit.lm import LMConfig, GRPOTrainer
    trainer = GRPOTrainer(model, tokenizer, reward=my_reward, prompts="prompts.jsonl", config=LMConfig(...))
    history = trainer.train(40)

Modules, one job each: ``config`` (LMConfig, validation, guard rails), ``prompts`` (lists, iterables, files), ``data`` (TRL's dataset conventions:
Datasets, chat templates, extra columns),
``generation`` (the Generator interface and its HF backend), ``logprobs`` (position ids, response masks, token
log-probs, KL estimators), ``rollout`` (sampling a batch), ``rewards`` (functions, weighted lists, reward models),
``step`` (the epoch loop's UpdateStep over token minibatches), ``base`` (pi_ref, seeding, save/resume),
``durable`` (the loop's checkpoints, signals and failures; the run dir and its logging), ``checks`` (context,
tokenizer and memory before any work),
``ppo``, ``grpo``, ``dpo`` (the trainers), ``supervised`` (SFT and the reward model); ``tiny`` and ``demo`` (a tiny GPT-2 and the CPU demo).
"""

from __future__ import annotations

_LAZY = {
    "LMConfig": "ppokit.lm.config",
    "ConfigError": "ppokit.lm.config",
    "load_prompts": "ppokit.lm.prompts",
    "PPOTrainer": "ppokit.lm.ppo",
    "GRPOTrainer": "ppokit.lm.grpo",
    "DPOTrainer": "ppokit.lm.dpo",
    "SFTTrainer": "ppokit.lm.supervised",
    "RewardModelTrainer": "ppokit.lm.supervised",
    "Generator": "ppokit.lm.generation",
    "HFGenerator": "ppokit.lm.generation",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ppokit.lm' has no attribute {name!r}")
