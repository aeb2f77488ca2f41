"""``LMConfig``: every knob of a language-model run (PPO-RLHF, GRPO, DPO), validated like ``PPOConfig``.

One dataclass for the three trainers (a field a trainer does not use is ignored by it: ``beta`` by PPO, the value
fields by GRPO and DPO). Each field's ``help`` is its documentation (and the CLI's ``--help`` line). ``validate``
raises ``ppokit.config.ppo_config.ConfigError`` naming the first invalid field and the reason, before any model is touched.

The guard rails are the Gymnasium trainer's (``ppokit.config.ppo_config.SAFE_LIMITS``): more than 30 epochs over a rollout or
a clip range above 0.3 is refused, and so is PPO without advantage whitening or without KL / clip-fraction
monitoring, unless ``unsafe=True`` (an ablation, stamped as such in the run's config).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ppokit.config.ppo_config import SAFE_LIMITS, ConfigError
from ppokit.core.reductions import REDUCTION_MODES
from ppokit.core.schema import KL_STOP_FACTOR
from ppokit.lm.backends import SAMPLERS

__all__ = ["LMConfig", "ConfigError", "KL_ESTIMATORS", "SCALE_REWARDS"]

KL_ESTIMATORS = ("k1", "k3")
DTYPES = ("fp32", "bf16", "fp16")  # the keys of ppokit.lm.precision.DTYPES
SCALE_REWARDS = ("group", "batch", "none")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce++")
_SEED_MAX = 2**32 - 1


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class LMConfig:
    """Every knob of a ppokit.lm run; derived sizes are properties."""

    # --- system ---
    seed: int = _f(1, f"random seed (sampling, minibatch order, prompt order), in [0, {_SEED_MAX}]")
    device: str = _f("cpu", "torch device of the models: cpu, cuda, cuda:N or mps")
    torch_threads: int = _f(1, "torch intra-op threads")
    dtype: str = _f("fp32", "precision of the forward passes: bf16 or fp16 run them under torch.autocast with the "
                    "trainable weights kept float32 (master weights; fp16 with a GradScaler), fp32 without autocast")
    # --- optimizer ---
    learning_rate: float = _f(1e-5, "AdamW learning rate of the policy (and of the value model), in [0, 1]")
    weight_decay: float = _f(0.0, "AdamW weight decay, in [0, 1]")
    max_grad_norm: float = _f(1.0, "global gradient-norm clip (policy and value model together), > 0")
    lr_scheduler: str = _f("constant", "learning-rate schedule over the run's iterations after warmup_steps: constant, "
                           "linear (to 0) or cosine (a half cosine to 0), transformers' formulas (ppokit.lm.lr_schedule)")
    warmup_steps: int = _f(0, "iterations of linear learning-rate warmup from 0 (DPO, SFT, RM: optimizer steps), >= 0")
    schedule_iterations: int | None = _f(None, "iterations the linear / cosine schedule decays over (none: the "
                                         "iteration count of the run's first train() call, e.g. --iterations), >= 1")
    # --- rollout ---
    batch_prompts: int = _f(8, "prompts per iteration (DPO: preference pairs per optimizer step)")
    group_size: int = _f(8, "completions sampled per prompt (GRPO's G; PPO samples as many)")
    max_new_tokens: int = _f(16, "generation budget per completion, in tokens")
    temperature: float = _f(1.0, "sampling temperature; log-probs are those of the tempered distribution "
                            "that sampled (pure sampling: top_k = 0, top_p = 1)")
    sampler: str = _f("cached", "generation backend: cached (ppokit's own decoding loop over the model's KV cache), "
                      "hf (transformers' model.generate) or vllm (a vLLM engine on the policy's GPU, weights synced "
                      "after each update; extra vllm, CUDA only); all sample the same distribution")
    missing_eos_penalty: float | None = _f(None, "subtracted from the score of a completion that never emitted "
                                           "the EOS token (none: no penalty), >= 0")
    # --- update ---
    update_epochs: int = _f(2, "epochs K over each rollout (at most 30 unless unsafe)")
    num_minibatches: int = _f(2, "minibatches per epoch (at most the rollout's completions)")
    clip_coef: float = _f(0.2, "clip range eps of the surrogate (at most 0.3 unless unsafe)")
    target_kl: float | None = _f(None, f"stop the epochs when approx KL to pi_old > {KL_STOP_FACTOR} * target_kl "
                                 "(none: never)")
    loss_reduction: str = _f("token_mean", "how per-token losses become one scalar: "
                             + ", ".join(m for m in REDUCTION_MODES if m != "mean")
                             + " (see ppokit.core.reductions.reduce)")
    policy_loss: str = _f("ppo", "PPO and GRPO: the policy loss, a name registered in ppokit.lm.losses (ppo: the "
                          "clipped surrogate, with GRPO's beta * k3 KL to pi_ref); DPO always uses dpo")
    loss_type: str | None = _f(None, "TRL's name for the policy loss's normalization, replacing loss_reduction: grpo "
                               "(seq_mean_token_mean), bnpo (token_mean), dr_grpo (seq_mean_token_sum_norm), dapo "
                               "(token sums over the rollout's tokens per minibatch); none: loss_reduction decides")
    epsilon_high: float | None = _f(None, "upper clip eps_high of the ratio, range [1 - clip_coef, 1 + eps_high] "
                                    "(DAPO's clip-higher, typical 0.28); none: clip_coef")
    importance_sampling_level: str = _f("token", "importance ratio per token, or per sequence (GSPO: exp of the mean "
                                        "token log-ratio of the completion)")
    ent_coef: float = _f(0.0, "entropy bonus coefficient, >= 0")
    whiten_advantages: bool = _f(True, "PPO: whiten the advantages over the rollout's response tokens (required "
                                 "unless unsafe)")
    monitor_kl: bool = _f(True, "watch approx KL every iteration (required unless unsafe)")
    monitor_clipfrac: bool = _f(True, "watch the clip fraction every iteration (required unless unsafe)")
    unsafe: bool = _f(False, "allow configs outside the guard rails (an ablation)")
    # --- PPO-RLHF ---
    kl_coef: float = _f(0.05, "PPO: coefficient of the per-token KL(pi || pi_ref) penalty in the reward, >= 0")
    kl_estimator: str = _f("k1", "PPO: per-token KL estimator in the reward: k1 = log pi - log pi_ref, "
                           "k3 = (r - 1) - log r with r = pi_ref / pi (>= 0)")
    adaptive_kl: bool = _f(False, "PPO: adapt kl_coef towards kl_target (Ziegler et al. 2019)")
    kl_target: float = _f(6.0, "PPO adaptive KL: target KL to pi_ref per sequence (nats), > 0")
    kl_horizon: int = _f(10000, "PPO adaptive KL: horizon of the proportional controller, in completions")
    gamma: float = _f(1.0, "PPO: discount over response tokens, in (0, 1]")
    gae_lambda: float = _f(0.95, "PPO: GAE lambda over response tokens, in [0, 1]")
    vf_coef: float = _f(0.1, "PPO: value-loss coefficient, >= 0")
    cliprange_value: float = _f(0.2, "PPO: clip of the value change around the rollout's values, > 0")
    # --- GRPO / DPO ---
    beta: float = _f(0.04, "GRPO: coefficient of the k3 KL to pi_ref in the loss (0: no reference model is "
                     "loaded); DPO: the inverse temperature of the preference loss")
    scale_rewards: str = _f("group", "GRPO: advantage (r - group mean) divided by the group's std (group), the "
                            "batch's std (batch) or not at all (none)")
    adv_eps: float = _f(1e-4, "GRPO: eps in (r - mean) / (std + eps), > 0")
    advantage_estimator: str = _f("grpo", "GRPO: the baseline of a completion's reward: grpo (its group's mean), rloo "
                                  "(the mean of the other G - 1 of its group) or reinforce++ (the batch mean, "
                                  "divided by the batch std: needs scale_rewards batch or none)")
    std_ddof: int = _f(0, "GRPO: delta degrees of freedom of the reward std, 0 (population) or 1 (Bessel's, "
                       "TRL's)")
    drop_zero_std_groups: bool = _f(False, "GRPO: leave the groups whose G rewards are all equal out of the update "
                                    "(DAPO's dynamic sampling; max_resample_rounds refills the batch)")
    max_resample_rounds: int = _f(0, "GRPO with drop_zero_std_groups: extra generation rounds an iteration may take "
                                  "to fill the batch with batch_prompts groups whose rewards differ (DAPO's dynamic "
                                  "sampling); 0: train on the groups left, >= 0")
    mask_truncated_completions: bool = _f(False, "GRPO: leave completions that hit max_new_tokens without a stop "
                                          "token out of the loss (they still count in the group statistics)")
    dpo_loss: str = _f("sigmoid", "DPO: sigmoid (the paper's), ipo (squared, on length-normalized log-probs) or "
                       "hinge (SLiC)")
    label_smoothing: float = _f(0.0, "DPO sigmoid: probability that a preference label is flipped (conservative "
                                "DPO), in [0, 0.5)")
    fused_activations: bool = _f(True, "run the model's tanh-GELU (transformers' NewGELUActivation, gelu_new) as "
                                 "torch's one fused kernel: the same function to rounding (ppokit.lm.kernels)")
    # --- memory ---
    offload_rollout: bool = _f(False, "keep rollout tensors (log-probs, masks, values) in CPU memory and move them "
                               "to the device per minibatch")
    gradient_checkpointing: bool = _f(False, "recompute each transformer block's activations in the backward "
                                      "instead of keeping them (transformers' non-reentrant checkpointing; with "
                                      "fsdp, per sharded block): activation memory of one block, about one more "
                                      "forward of time per update")
    micro_batch_size: int | None = _f(None, "rows per forward pass: the no-gradient passes (pi_old, pi_ref, values, a "
                                      "reward model) run in chunks of this many sequences and every update step "
                                      "accumulates the gradients of its minibatch over them, each weighted by its "
                                      "share of the loss's normalizer (the same gradient as one pass); none: the "
                                      "whole batch at once, > 0")
    fsdp: bool = _f(False, "under torchrun (or --nproc K): shard the policy, pi_ref and the value model over the "
                    "ranks with FSDP2 (fully_shard per transformer block, then the root), so each rank holds 1/K of "
                    "their weights, gradients and AdamW states (ppokit.lm.fsdp); in one process it runs unsharded")
    fsdp_offload: bool = _f(False, "with fsdp: keep each rank's shards of the weights, their gradients and AdamW's "
                            "states in CPU memory (FSDP2's CPUOffloadPolicy), each block's weights copied to the "
                            "device for its forward and backward and AdamW stepping on the CPU; it saves device "
                            "memory only with a GPU (device cuda): on a CPU-only machine everything is in CPU memory "
                            "already and the run is the same, a little slower")
    # --- output ---
    log_every: int = _f(10, "print a metrics table every this many iterations (with a run dir)")
    save_every: int = _f(10, "with a run dir, write a resumable checkpoint (trainer_state.pt and policy/; fsdp "
                         "under torchrun: trainer_state.pt and each rank's shards, policy/ at the end only) every "
                         "this many iterations, at the end, on Ctrl-C / SIGTERM and when the reward fails; a kill "
                         "loses at most this many iterations")
    tensorboard: bool = _f(True, "write TensorBoard event files (with a run dir)")
    console: bool = _f(True, "print metrics and alerts on the console (with a run dir)")
    track: bool = _f(False, "log the metrics and the sample completions (a table) to Weights & Biases, with a run dir "
                     "(needs pip install 'ppokit[wandb]'; WANDB_MODE=offline writes the W&B run into RUN_DIR/wandb)")
    wandb_project: str = _f("ppokit", "Weights & Biases project of track")
    wandb_entity: str | None = _f(None, "Weights & Biases entity (user or team) of track (none: your default)")

    # ---------------------------------------------------------------- derived sizes
    @property
    def rollout_size(self) -> int:
        """Completions per iteration, ``batch_prompts * group_size``."""
        return self.batch_prompts * self.group_size

    # ---------------------------------------------------------------- validation
    def validate(self) -> "LMConfig":
        """Raise ``ConfigError`` for the first invalid field; return self when valid."""
        def need(ok: bool, name: str, reason: str) -> None:
            if not ok:
                raise ConfigError(name, reason)

        for f in dataclasses.fields(self):
            _check_type(f, getattr(self, f.name))
        for name in ("torch_threads", "batch_prompts", "group_size", "max_new_tokens", "update_epochs",
                     "num_minibatches", "log_every", "save_every", "kl_horizon"):
            need(getattr(self, name) >= 1, name, f"must be a positive integer, got {getattr(self, name)!r}")
        from ppokit.lm.lr_schedule import LR_SCHEDULERS

        need(self.lr_scheduler in LR_SCHEDULERS, "lr_scheduler",
             f"must be one of {', '.join(LR_SCHEDULERS)}, got {self.lr_scheduler!r}")
        need(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.schedule_iterations is not None:
            need(self.schedule_iterations >= 1, "schedule_iterations",
                 f"must be a positive integer or none, got {self.schedule_iterations}")
        if self.micro_batch_size is not None:
            need(self.micro_batch_size >= 1, "micro_batch_size",
                 f"must be a positive integer or none, got {self.micro_batch_size!r}")
        need(0 <= self.seed <= _SEED_MAX, "seed", f"must be in [0, {_SEED_MAX}], got {self.seed}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                need(math.isfinite(value), f.name, f"must be a finite number, got {value!r}")
        need(0 <= self.learning_rate <= 1, "learning_rate", f"must be in [0, 1], got {self.learning_rate}")
        need(0 <= self.weight_decay <= 1, "weight_decay", f"must be in [0, 1], got {self.weight_decay}")
        need(self.max_grad_norm > 0, "max_grad_norm", f"must be > 0, got {self.max_grad_norm}")
        need(self.temperature > 0, "temperature", f"must be > 0 (0 would be greedy decoding, whose log-probs are "
             f"not those of a distribution), got {self.temperature}")
        need(self.clip_coef > 0, "clip_coef", f"must be > 0, got {self.clip_coef}")
        need(self.cliprange_value > 0, "cliprange_value", f"must be > 0, got {self.cliprange_value}")
        for name in ("ent_coef", "vf_coef", "kl_coef", "beta"):
            need(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        need(self.adv_eps > 0, "adv_eps", f"must be > 0, got {self.adv_eps}")
        need(self.kl_target > 0, "kl_target", f"must be > 0, got {self.kl_target}")
        need(0 < self.gamma <= 1, "gamma", f"must be in (0, 1], got {self.gamma}")
        need(0 <= self.gae_lambda <= 1, "gae_lambda", f"must be in [0, 1], got {self.gae_lambda}")
        if self.target_kl is not None:
            need(math.isfinite(self.target_kl) and self.target_kl > 0, "target_kl",
                 f"must be > 0 or none, got {self.target_kl!r}")
        if self.missing_eos_penalty is not None:
            need(math.isfinite(self.missing_eos_penalty) and self.missing_eos_penalty >= 0, "missing_eos_penalty",
                 f"must be >= 0 or none (it is subtracted from the score), got {self.missing_eos_penalty!r}")
        need(self.kl_estimator in KL_ESTIMATORS, "kl_estimator",
             f"must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        need(self.sampler in SAMPLERS, "sampler", f"must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.sampler == "vllm":
            from ppokit.lm.vllm_generator import vllm_problem  # torch: not at import (--help)

            problem = vllm_problem(self.device)
            need(problem is None, "sampler", problem or "")
        need(self.scale_rewards in SCALE_REWARDS, "scale_rewards",
             f"must be one of {', '.join(SCALE_REWARDS)}, got {self.scale_rewards!r}")
        from ppokit.lm.losses import DPO_LOSSES, IS_LEVELS, LOSS_TYPES, LOSSES  # torch: not at import (--help)

        if self.loss_type is not None:
            need(self.loss_type in LOSS_TYPES, "loss_type",
                 f"must be one of {', '.join(LOSS_TYPES)} or none, got {self.loss_type!r}")
            default = _default("loss_reduction")
            need(self.loss_reduction in (default, LOSS_TYPES[self.loss_type]), "loss_type",
                 f"{self.loss_type} sets the reduction, and loss_reduction={self.loss_reduction!r} asks for "
                 "another; give one of the two")
        if self.epsilon_high is not None:
            need(self.epsilon_high > 0, "epsilon_high", f"must be > 0 or none, got {self.epsilon_high!r}")
        need(self.importance_sampling_level in IS_LEVELS, "importance_sampling_level",
             f"must be one of {', '.join(IS_LEVELS)}, got {self.importance_sampling_level!r}")
        need(self.advantage_estimator in ADVANTAGE_ESTIMATORS, "advantage_estimator",
             f"must be one of {', '.join(ADVANTAGE_ESTIMATORS)}, got {self.advantage_estimator!r}")
        need(self.advantage_estimator != "reinforce++" or self.scale_rewards != "group", "advantage_estimator",
             "reinforce++ normalizes over the batch (Hu et al. 2025), not per group: set scale_rewards to batch "
             "(or none)")
        need(self.std_ddof in (0, 1), "std_ddof", f"must be 0 or 1, got {self.std_ddof!r}")
        need(self.max_resample_rounds >= 0, "max_resample_rounds", f"must be >= 0, got {self.max_resample_rounds}")
        need(self.max_resample_rounds == 0 or self.drop_zero_std_groups, "max_resample_rounds",
             "resamples the groups drop_zero_std_groups leaves out: set drop_zero_std_groups too")
        need(self.dpo_loss in DPO_LOSSES, "dpo_loss", f"must be one of {', '.join(DPO_LOSSES)}, got {self.dpo_loss!r}")
        need(0 <= self.label_smoothing < 0.5, "label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}")
        need(self.label_smoothing == 0 or self.dpo_loss == "sigmoid", "label_smoothing",
             f"applies to dpo_loss sigmoid only, not {self.dpo_loss}")

        token_losses = sorted(n for n in LOSSES if n != "dpo")
        need(self.policy_loss in token_losses, "policy_loss",
             f"must be one of {', '.join(token_losses)} (ppokit.lm.losses), got {self.policy_loss!r}")
        need(self.loss_reduction in REDUCTION_MODES and self.loss_reduction != "mean", "loss_reduction",
             f"must be one of {', '.join(m for m in REDUCTION_MODES if m != 'mean')}, got {self.loss_reduction!r}")
        need(self.num_minibatches <= self.rollout_size, "num_minibatches",
             f"{self.num_minibatches} minibatches cannot split {self.rollout_size} completions (batch_prompts * "
             f"group_size); use at most {self.rollout_size}")
        from ppokit.config.wandb_names import project_name_problem

        project_problem = project_name_problem(self.wandb_project)
        need(project_problem is None, "wandb_project", project_problem or "")
        if self.track:
            from ppokit.runtime.wandb_sink import require_wandb

            require_wandb()
        from ppokit.config.resources import check_device

        check_device(self.device)
        need(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        need(self.fsdp or not self.fsdp_offload, "fsdp_offload", "offloads FSDP's shards: add --fsdp")
        need(not (self.fsdp and self.dtype == "fp16"), "fsdp",
             "runs with dtype bf16 or fp32 (FSDP2's mixed precision), not fp16; use --dtype bf16")
        from ppokit.lm.precision import autocast_problem

        problem = autocast_problem(self.device, self.dtype)
        need(problem is None, "dtype", problem or "")
        if not self.unsafe:
            violations = self.guard_rail_violations()
            if violations:
                name, reason = violations[0]
                raise ConfigError(name, reason + " (set unsafe=True to run it anyway as an ablation)")
        return self

    def guard_rail_violations(self) -> list[tuple[str, str]]:
        """The (field, reason) pairs of every guard rail this config breaks (``PPOConfig``'s rules)."""
        out = []
        if self.update_epochs > SAFE_LIMITS["update_epochs"]:
            out.append(("update_epochs", f"{self.update_epochs} epochs is an unsafe trust region: K must be <= "
                        f"{SAFE_LIMITS['update_epochs']} (the policy drifts too far from pi_old)"))
        if self.clip_coef > SAFE_LIMITS["clip_coef"]:
            out.append(("clip_coef", f"eps={self.clip_coef} is an unsafe trust region: eps must be <= "
                        f"{SAFE_LIMITS['clip_coef']}; typical 0.2"))
        if not self.whiten_advantages:
            out.append(("whiten_advantages", "advantage whitening is off: PPO-RLHF without it is unstable; set "
                        "whiten_advantages=True"))
        if not self.monitor_kl:
            out.append(("monitor_kl", "KL monitoring is off: every PPO run must watch approx KL"))
        if not self.monitor_clipfrac:
            out.append(("monitor_clipfrac", "clip-fraction monitoring is off: every PPO run must watch it"))
        return out

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LMConfig":
        """A validated config from ``data``; an unknown key raises ``ConfigError`` naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in names:
                raise ConfigError(str(key), f"is not an LMConfig field (known: {', '.join(sorted(names))})")
        return cls(**data).validate()


def _default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(LMConfig) if f.name == name)


def _check_type(f: dataclasses.Field, value: Any) -> None:
    """Strict types: a bool is not a number, an int is accepted for a float field, none only where optional."""
    kind = str(f.type)
    optional = "None" in kind
    if value is None:
        if optional:
            return
        raise ConfigError(f.name, "must be set (none is not allowed)")
    if kind.startswith("bool"):
        ok = isinstance(value, bool)
        want = "true or false"
    elif kind.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool)
        want = "an integer"
    elif kind.startswith("float"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        want = "a number"
    else:
        ok = isinstance(value, str)
        want = "a string"
    if not ok:
        raise ConfigError(f.name, f"must be {want}, got {type(value).__name__} {value!r}")
