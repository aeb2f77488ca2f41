"""Learning-rate schedules with warmup for the LM trainers (``LMConfig.lr_scheduler``, ``warmup_steps``).

The factor multiplying ``learning_rate`` at step ``k`` (0-based) of ``total``, the formulas of transformers'
``get_constant_schedule_with_warmup``, ``get_linear_schedule_with_warmup`` and ``get_cosine_schedule_with_warmup``
(one half cosine, ``num_cycles=0.5``), which tests/test_lm_lr_schedule.py compares step by step:

* warmup, every kind: ``k / max(1, warmup)`` while ``k < warmup`` (0 at the first step, as transformers);
* ``constant``: 1 after the warmup;
* ``linear``: ``max(0, (total - k) / max(1, total - warmup))``;
* ``cosine``: ``max(0, 0.5 * (1 + cos(pi * p)))`` with ``p = (k - warmup) / max(1, total - warmup)``.

A step is one iteration of the trainer: one optimizer step for DPO, SFT and the reward model (so the LR is
transformers' per step), the whole update of an iteration for PPO and GRPO, whose minibatch steps share one LR
(their count varies with the KL early stop; the Gymnasium trainer's ``anneal_lr`` also moves per iteration).
The step is the trainer's iteration counter and the horizon is checkpointed, so a resumed run continues the
schedule where it stopped.
"""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULERS", "lr_factor"]

LR_SCHEDULERS = ("constant", "linear", "cosine")


def lr_factor(kind: str, step: int, warmup: int, total: int) -> float:
    """The multiplier of the base learning rate at ``step`` (module docstring); ``total`` is unused by constant."""
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    if kind == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"lr_factor: unknown schedule {kind!r}; choose one of {', '.join(LR_SCHEDULERS)}")
