"""A CPU demo that really learns: SFT a tiny GPT-2 on a weak prior, then PPO, GRPO and DPO sharpen it.

The task (issue 11, item 9). The prompt is ``X:``; a response is a string of the letters ``RESPONSE_LETTERS``
ended by EOS. The SFT data draws each letter as ``X`` with probability 0.35 (else uniformly among the others), so the
supervised model has a weak prior for X. The reward is ``count(X) / max(len, 8)`` for a well-formed response and -1
for a malformed one; the length floor of 8 means a short all-X answer does not score 1 (the reward hack of short
answers is closed), and the best response is 8 to 15 X's. RL should move the eval reward from ~0.35 (SFT) towards 1
while the responses stay well formed and at least 8 long.

Everything here runs on one CPU thread in well under a minute: ``ppokit lm demo`` or ``python examples/lm_demo.py``.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

PROMPT = "X:"
TARGET = "X"
RESPONSE_LETTERS = "ABCDEFGX"
# The tokenizer also knows ':' and ' ', so a response can be malformed (a ':' or a space inside it).
ALPHABET = RESPONSE_LETTERS + ": "
P_TARGET = 0.35  # SFT prior: each response letter is X with this probability
SFT_LENGTHS = (8, 12)  # SFT response lengths, inclusive
LENGTH_FLOOR = 8  # reward = count(X) / max(len, LENGTH_FLOOR)
MAX_NEW_TOKENS = 16  # a response that has not ended after this many tokens is cut (and so malformed)
MAX_LEN = MAX_NEW_TOKENS - 1  # longest well-formed response: MAX_LEN letters + EOS
MALFORMED_REWARD = -1.0


# ---------------------------------------------------------------- the task
def is_well_formed(completion: str) -> bool:
    """The one definition of a well-formed response: 1..MAX_LEN characters, every one a response letter.

    A response that was cut at ``MAX_NEW_TOKENS`` without EOS decodes to ``MAX_NEW_TOKENS`` characters, so the
    length bound also says "it ended"; the reward needs no side channel to know that."""
    return 1 <= len(completion) <= MAX_LEN and all(c in RESPONSE_LETTERS for c in completion)


def score(completion: str) -> float:
    """``count(X) / max(len, 8)`` for a well-formed response, ``MALFORMED_REWARD`` otherwise."""
    if not is_well_formed(completion):
        return MALFORMED_REWARD
    return completion.count(TARGET) / max(len(completion), LENGTH_FLOOR)


def reward(prompts: list[str], completions: list[str], **info) -> list[float]:
    """The demo's reward function in the trainers' ``reward_fn(prompts, completions, **info)`` form."""
    return [score(c) for c in completions]


def length_reward(prompts: list[str], completions: list[str], **info) -> list[float]:
    """A hackable reward (longer is better, whatever the letters): with no KL anchor the policy runs away from
    pi_ref to collect it. Used to show ``ppokit doctor`` recognising reward hacking."""
    return [float(len(c)) / MAX_NEW_TOKENS for c in completions]


def sft_responses(n: int, rng: random.Random) -> list[str]:
    """``n`` SFT responses: lengths uniform in ``SFT_LENGTHS``, each letter X with probability ``P_TARGET``."""
    others = RESPONSE_LETTERS.replace(TARGET, "")
    out = []
    for _ in range(n):
        length = rng.randint(*SFT_LENGTHS)
        out.append("".join(TARGET if rng.random() < P_TARGET else rng.choice(others) for _ in range(length)))
    return out


# ---------------------------------------------------------------- supervised fine-tuning
def sft_batch(tokenizer, responses: list[str]) -> dict[str, torch.Tensor]:
    """``PROMPT + response + EOS`` right-padded to ``[B, T]``, labels -100 on the prompt and the padding.

    The loss is masked to the response (and its EOS): the model learns what to answer, not to predict the prompt.
    Right padding is safe here (positions start at 0 for every row); generation pads on the left."""
    prompt_ids = tokenizer(PROMPT).input_ids
    rows = [prompt_ids + tokenizer(r).input_ids + [tokenizer.eos_token_id] for r in responses]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row)
        labels[i, len(prompt_ids):len(row)] = torch.tensor(row[len(prompt_ids):])
        attention_mask[i, :len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def supervised_finetune(model, tokenizer, *, steps: int, batch_size: int = 32, learning_rate: float = 3e-3,
                        seed: int = 0) -> list[float]:
    """``steps`` AdamW steps of next-token cross-entropy on fresh SFT samples; returns the loss per step."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        batch = sft_batch(tokenizer, sft_responses(batch_size, rng))
        loss = model(**batch).loss  # HF shifts labels by one and ignores -100
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


# ---------------------------------------------------------------- evaluation (one sampler for every stage)
@torch.no_grad()
def sample(model, tokenizer, n: int, *, seed: int, temperature: float = 1.0) -> list[str]:
    """``n`` responses to ``PROMPT`` by plain ancestral sampling (top_k=0, top_p=1), decoded up to the first EOS.

    Every prompt is the same, so there is no padding and no position-id question. The global RNG is forked, so
    evaluating does not change what training draws next."""
    ids = torch.tensor([tokenizer(PROMPT).input_ids] * n)
    was_training = model.training
    model.eval()  # transformers' generate in train mode (gradient checkpointing: no KV cache) is another path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                             top_p=1.0, temperature=temperature, max_new_tokens=MAX_NEW_TOKENS,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.train(was_training)
    texts = []
    for row in out[:, ids.shape[1]:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[:row.index(tokenizer.eos_token_id)]
        texts.append(tokenizer.decode(row, skip_special_tokens=False))
    return texts


def evaluate(model, tokenizer, n: int = 256, *, seed: int = 12345) -> dict:
    """Eval reward, well-formed fraction, mean length and X fraction over ``n`` samples, plus four samples."""
    texts = sample(model, tokenizer, n, seed=seed)
    formed = [t for t in texts if is_well_formed(t)]
    return {
        "reward": sum(score(t) for t in texts) / n,
        "well_formed": len(formed) / n,
        "mean_length": sum(len(t) for t in texts) / n,
        "x_frac": sum(t.count(TARGET) for t in formed) / max(1, sum(len(t) for t in formed)),
        "samples": texts[:4],
    }


# ---------------------------------------------------------------- preference pairs for DPO
def preference_pairs(texts: list[str], *, min_gap: float = 0.1) -> list[tuple[str, str, str]]:
    """``(PROMPT, chosen, rejected)`` pairs from consecutive samples, the higher-scoring one chosen; pairs closer
    than ``min_gap`` in score are dropped (a near-tie is no preference)."""
    pairs = []
    for a, b in zip(texts[0::2], texts[1::2]):
        sa, sb = score(a), score(b)
        if abs(sa - sb) >= min_gap:
            pairs.append((PROMPT, a, b) if sa > sb else (PROMPT, b, a))
    return pairs


# ---------------------------------------------------------------- the demo
@dataclass
class DemoSettings:
    """Budgets and hyper-parameters of the demo (tuned on one CPU thread: the whole demo in well under a minute)."""

    sft_steps: int = 300
    sft_learning_rate: float = 3e-3
    iterations: int = 40  # PPO and GRPO iterations
    ppo_learning_rate: float = 1e-3
    kl_coef: float = 0.05
    grpo_learning_rate: float = 1e-3
    beta: float = 0.04
    dpo_samples: int = 512  # SFT samples paired up for DPO
    dpo_steps: int = 60
    dpo_learning_rate: float = 1e-3
    dpo_beta: float = 0.1
    eval_samples: int = 256
    rm_steps: int = 60  # the InstructGPT chain: reward-model steps on the SFT preference pairs, then PPO on it
    rm_learning_rate: float = 3e-3
    extra: dict = field(default_factory=dict)  # further LMConfig fields for every trainer


def lm_config(seed: int, settings: DemoSettings, **fields):
    """The demo's ``LMConfig``: 8 prompts x 8 completions, 16 new tokens, 2 epochs of 2 minibatches, one thread."""
    from ppokit.lm.config import LMConfig

    base = dict(seed=seed, batch_prompts=8, group_size=8, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0,
                update_epochs=2, num_minibatches=2, torch_threads=1, log_every=10, console=False,
                tensorboard=False)
    return LMConfig(**{**base, **settings.extra, **fields})


# What a trainer writes into its run dir; the demo clears these before it writes a stage again (the trainers
# append to metrics.csv, and the demo's output is meant to be rewritten by each run).
_RUN_OUTPUTS = ("metrics.csv", "lm_run.json", "alerts.jsonl", "trainer_state.pt")


def _fresh(run_dir: Path | None) -> Path | None:
    if run_dir is not None:
        for name in _RUN_OUTPUTS:
            (run_dir / name).unlink(missing_ok=True)
        if (run_dir / "tb").is_dir():
            import shutil

            shutil.rmtree(run_dir / "tb")
    return run_dir


def _rl_stage(cls, sft_model, tokenizer, config, run_dir, iterations: int, before: dict, eval_seed: int) -> dict:
    from ppokit.core import schema as S

    run_dir = _fresh(run_dir)
    model = copy.deepcopy(sft_model)
    trainer = cls(model, tokenizer, reward=reward, prompts=[PROMPT] * config.batch_prompts, config=config,
                  run_dir=run_dir)
    started = time.perf_counter()
    history = trainer.train(iterations)
    seconds = time.perf_counter() - started
    trainer.close()
    after = evaluate(trainer.policy, tokenizer, seed=eval_seed)
    return {
        "reward_before": before["reward"], "reward_after": after["reward"],
        "well_formed_after": after["well_formed"], "mean_length_after": after["mean_length"],
        "x_frac_after": after["x_frac"], "seconds": seconds, "iterations": iterations,
        "score_curve": [m[S.SCORE_MEAN] for m in history],
        "kl_ref_curve": [m.get(S.KL_REF, math.nan) for m in history],
        "samples_after": after["samples"], "run_dir": None if run_dir is None else str(run_dir),
    }


def run_demo(seed: int = 1, json_path: str | Path | None = None, out_dir: str | Path | None = "runs/lm_demo",
             quiet: bool = False, settings: DemoSettings | None = None,
             stages=("ppo", "grpo", "dpo")) -> dict:
    """SFT, then PPO, GRPO and DPO from the same SFT model; prints the curves and samples; returns the results.

    ``out_dir`` gets ``lm_demo.png`` and the PPO/GRPO/DPO run directories (``ppokit doctor OUT/ppo`` works on
    them); None writes nothing. ``json_path`` gets the results as JSON (the issue's schema)."""
    from ppokit.lm.dpo import DPOTrainer
    from ppokit.lm.grpo import GRPOTrainer
    from ppokit.lm.ppo import PPOTrainer
    from ppokit.lm.tiny import build_tiny

    _quiet_transformers()
    settings = settings or DemoSettings()
    torch.set_num_threads(1)
    out = None if out_dir is None else Path(out_dir)
    say = (lambda *a: None) if quiet else print
    results: dict = {"seed": seed}
    total = time.perf_counter()

    # 1. Supervised fine-tuning: the weak prior (X with probability 0.35).
    model, tokenizer = build_tiny(ALPHABET, seed=seed)
    started = time.perf_counter()
    losses = supervised_finetune(model, tokenizer, steps=settings.sft_steps,
                                 learning_rate=settings.sft_learning_rate, seed=seed)
    sft = evaluate(model, tokenizer, settings.eval_samples, seed=seed + 1000)
    results["sft"] = {"reward": sft["reward"], "well_formed": sft["well_formed"], "mean_length": sft["mean_length"],
                      "x_frac": sft["x_frac"], "steps": settings.sft_steps, "final_loss": losses[-1],
                      "seconds": time.perf_counter() - started, "samples": sft["samples"], "loss_curve": losses}
    say(f"SFT  {settings.sft_steps} steps, {results['sft']['seconds']:.1f} s: loss {losses[0]:.2f} -> "
        f"{losses[-1]:.2f}; eval reward {sft['reward']:.3f}, well-formed {sft['well_formed']:.0%}, mean length "
        f"{sft['mean_length']:.1f}")
    say(f"     samples: {'  '.join(sft['samples'])}")

    # 2./3. PPO-RLHF and GRPO, each from the SFT model (pi_ref = the SFT model).
    rl = {"ppo": (PPOTrainer, dict(learning_rate=settings.ppo_learning_rate, kl_coef=settings.kl_coef)),
          "grpo": (GRPOTrainer, dict(learning_rate=settings.grpo_learning_rate, beta=settings.beta))}
    for name in ("ppo", "grpo"):
        if name not in stages:
            continue
        cls, fields = rl[name]
        config = lm_config(seed, settings, **fields)
        r = _rl_stage(cls, model, tokenizer, config, None if out is None else out / name, settings.iterations,
                      sft, seed + 1000)
        results[name] = r
        say(f"{name.upper():4} {r['iterations']} iterations, {r['seconds']:.1f} s: eval reward "
            f"{r['reward_before']:.3f} -> {r['reward_after']:.3f}, well-formed {r['well_formed_after']:.0%}, mean "
            f"length {r['mean_length_after']:.1f}")
        say(f"     score per iteration: {_curve_text(r['score_curve'])}")
        say(f"     samples: {'  '.join(r['samples_after'])}")

    # 4. DPO on preference pairs made from SFT samples ranked by the reward (held-out pairs for the accuracy).
    if "dpo" in stages:
        results["dpo"] = _dpo_stage(DPOTrainer, model, tokenizer, seed, settings, None if out is None else out / "dpo")
        d = results["dpo"]
        say(f"DPO  {d['steps']} steps on {d['pairs_train']} pairs, {d['seconds']:.1f} s: preference accuracy "
            f"(held-out) {d['pref_acc_before']:.3f} -> {d['pref_acc_after']:.3f}; eval reward "
            f"{d['reward_before']:.3f} -> {d['reward_after']:.3f}")
        say(f"     samples: {'  '.join(d['samples_after'])}")

    # 5. The InstructGPT chain: a reward model trained on the SFT preference pairs, then PPO against it.
    if "rlhf" in stages:
        results["rlhf"] = r = _rlhf_stage(model, tokenizer, seed, settings, sft, out)
        say(f"RM   {settings.rm_steps} steps on {r['rm_pairs']} pairs: held-out pair accuracy {r['rm_accuracy']:.3f}; "
            f"PPO on it {r['iterations']} iterations: eval reward {r['reward_before']:.3f} -> {r['reward_after']:.3f}")
        say(f"     samples: {'  '.join(r['samples_after'])}")

    results["seconds_total"] = time.perf_counter() - total
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        results["plot"] = str(write_plot(results, out / "lm_demo.png"))
        say(f"plot: {results['plot']}")
    say(f"total {results['seconds_total']:.1f} s")
    if json_path is not None:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def _dpo_stage(cls, sft_model, tokenizer, seed: int, settings: DemoSettings, run_dir) -> dict:
    texts = sample(sft_model, tokenizer, settings.dpo_samples, seed=seed + 2000)
    pairs = preference_pairs(texts)
    split = max(1, len(pairs) // 4)
    held_out, train_pairs = pairs[:split], pairs[split:]
    config = lm_config(seed, settings, learning_rate=settings.dpo_learning_rate, beta=settings.dpo_beta,
                       batch_prompts=16)
    trainer = cls(copy.deepcopy(sft_model), tokenizer, pairs=train_pairs, config=config, run_dir=_fresh(run_dir))
    before = trainer.preference_accuracy(held_out)
    reward_before = evaluate(sft_model, tokenizer, settings.eval_samples, seed=seed + 1000)["reward"]
    started = time.perf_counter()
    trainer.train(settings.dpo_steps)
    seconds = time.perf_counter() - started
    trainer.close()
    after_eval = evaluate(trainer.policy, tokenizer, settings.eval_samples, seed=seed + 1000)
    return {"pref_acc_before": before, "pref_acc_after": trainer.preference_accuracy(held_out),
            "reward_before": reward_before, "reward_after": after_eval["reward"],
            "well_formed_after": after_eval["well_formed"], "mean_length_after": after_eval["mean_length"],
            "steps": settings.dpo_steps, "pairs_train": len(train_pairs), "pairs_held_out": len(held_out),
            "seconds": seconds, "samples_after": after_eval["samples"],
            "run_dir": None if run_dir is None else str(run_dir)}


def _curve_text(values: list[float], points: int = 10) -> str:
    """Every len/points-th value, e.g. ``0.38 0.52 ... 0.91``."""
    step = max(1, len(values) // points)
    shown = values[::step]
    if (len(values) - 1) % step:
        shown.append(values[-1])
    return " ".join(f"{v:.2f}" for v in shown)


def write_plot(results: dict, path: Path) -> Path:
    """Four panels: the SFT loss, the PPO/GRPO score per iteration, eval reward per stage, DPO accuracy."""
    from ppokit.diagnostics.plots import _new_figure

    fig = _new_figure(figsize=(11.0, 7.0), layout="constrained")
    (ax_sft, ax_rl), (ax_eval, ax_dpo) = fig.subplots(2, 2)
    ax_sft.plot(results["sft"]["loss_curve"], color="tab:gray", lw=1)
    ax_sft.set(title="SFT cross-entropy (response tokens)", xlabel="step", ylabel="nats/token")
    for name, color in (("ppo", "tab:blue"), ("grpo", "tab:orange")):
        if name in results:
            ax_rl.plot(range(1, len(results[name]["score_curve"]) + 1), results[name]["score_curve"], color=color,
                       label=name.upper())
    ax_rl.axhline(results["sft"]["reward"], color="tab:gray", ls="--", lw=1, label="SFT eval reward")
    ax_rl.set(title="training score (mean reward of the rollout)", xlabel="iteration", ylabel="score")
    ax_rl.legend(fontsize=8)
    stages = [("SFT", results["sft"]["reward"])] + [(n.upper(), results[n]["reward_after"])
                                                   for n in ("ppo", "grpo", "dpo") if n in results]
    ax_eval.bar([s for s, _ in stages], [v for _, v in stages], color="tab:green")
    ax_eval.set(title=f"eval reward ({'count(X) / max(len, 8)'}; malformed -1)", ylabel="reward", ylim=(0, 1))
    if "dpo" in results:
        d = results["dpo"]
        ax_dpo.bar(["before", "after"], [d["pref_acc_before"], d["pref_acc_after"]], color="tab:purple")
    ax_dpo.set(title="DPO preference accuracy (held-out pairs)", ylabel="accuracy", ylim=(0, 1))
    for ax in (ax_sft, ax_rl, ax_eval, ax_dpo):
        ax.grid(alpha=0.25)
    fig.savefig(path, dpi=90)
    return path


def _quiet_transformers() -> None:
    """transformers' progress bars and advice lines would bury the demo's output."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def reward_model_reward(reward_model, tokenizer):
    """A reward function scoring ``prompt + completion`` with a trained reward model (``supervised.score_texts``,
    right-padded): the demo's stand-in for ``ppokit lm ppo --reward-model DIR``."""
    from ppokit.lm.supervised import score_texts

    def rm_reward(prompts: list[str], completions: list[str], **info) -> list[float]:
        with torch.no_grad():
            return score_texts(reward_model, tokenizer, [p + c for p, c in zip(prompts, completions)]).tolist()

    return rm_reward


def _rlhf_stage(sft_model, tokenizer, seed: int, settings: DemoSettings, sft: dict, out: Path | None) -> dict:
    """SFT -> reward model (Bradley-Terry on pairs of SFT samples ranked by the demo's score) -> PPO on the
    reward model's score; evaluated with the true score."""
    from ppokit.core import schema as S
    from ppokit.lm.ppo import PPOTrainer
    from ppokit.lm.supervised import RewardModelTrainer

    pairs = preference_pairs(sample(sft_model, tokenizer, settings.dpo_samples, seed=seed + 3000))
    rm_dir = None if out is None else _fresh(out / "rm")
    rm = RewardModelTrainer(copy.deepcopy(sft_model), tokenizer, pairs, run_dir=rm_dir, eval_frac=0.2,
                            config=lm_config(seed, settings, batch_prompts=16,
                                             learning_rate=settings.rm_learning_rate))
    started = time.perf_counter()
    rm.train(settings.rm_steps)
    rm.close()
    accuracy = rm.accuracy()
    rm.policy.eval()
    run_dir = None if out is None else _fresh(out / "rlhf_ppo")
    config = lm_config(seed, settings, learning_rate=settings.ppo_learning_rate, kl_coef=settings.kl_coef)
    trainer = PPOTrainer(copy.deepcopy(sft_model), tokenizer, reward=reward_model_reward(rm.policy, tokenizer),
                         prompts=[PROMPT] * config.batch_prompts, config=config, run_dir=run_dir)
    history = trainer.train(settings.iterations)
    trainer.close()
    after = evaluate(trainer.policy, tokenizer, seed=seed + 1000)
    return {"rm_pairs": len(pairs), "rm_accuracy": accuracy, "rm_steps": settings.rm_steps,
            "reward_before": sft["reward"], "reward_after": after["reward"], "iterations": settings.iterations,
            "rm_score_curve": [m[S.SCORE_MEAN] for m in history], "samples_after": after["samples"],
            "seconds": time.perf_counter() - started,
            "run_dir": None if run_dir is None else str(run_dir)}
