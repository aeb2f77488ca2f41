"""``ppokit lm ppo|grpo|dpo|sft|rm``: build the trainer from the parsed flags (a new run or ``--resume``), train it
up to ``--iterations`` and print the summary line."""

from __future__ import annotations

import argparse

from ppokit.cli.lm_flags import DATA_FLAGS, DEFAULT_ITERATIONS, config_from_args, given_config_flags
from ppokit.cli.lm_inputs import (
    InputError,
    apply_lora,
    check_model_dir,
    first_line,
    load_model_dir,
    load_rewards,
    load_rows,
)

RUN_FILES = ("metrics.csv", "lm_run.json", "trainer_state.pt")  # what an LM trainer writes into its run dir


def default_run_dir(command: str, seed: int):
    import time
    from pathlib import Path

    base = Path("runs") / f"lm_{command}__s{seed}__{time.strftime('%Y%m%d-%H%M%S')}"
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}_{k}")
    return path



def resume_inputs(command: str, full: argparse.Namespace):
    """``(run_dir, inputs)`` for ``--resume``: the run's recorded inputs (lm_run.json's ``cli``) with the ones given
    now; InputError for what cannot be continued."""
    import json
    from pathlib import Path

    run_dir = Path(full.resume)
    if not (run_dir / "trainer_state.pt").is_file():
        raise InputError(f"--resume {run_dir}: no LM checkpoint there (trainer_state.pt); give the run dir of a "
                         "ppokit lm run that saved at least once")
    try:
        meta = json.loads((run_dir / "lm_run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = {}
    meta = meta if isinstance(meta, dict) else {}
    if meta.get("algo") not in (None, command):
        raise InputError(f"--resume {run_dir}: holds a ppokit lm {meta['algo']} run; continue it with ppokit lm "
                         f"{meta['algo']} --resume {run_dir}")
    given = given_config_flags(full)
    if given:
        raise InputError(f"{given[0]}: --resume continues the run with its saved config; start a new run "
                         "(another --run-dir) to change it")
    if full.run_dir:
        raise InputError("--run-dir: --resume continues in the run dir it names; drop --run-dir")
    recorded = meta.get("cli") if isinstance(meta.get("cli"), dict) else {}
    inputs = {"model": full.model or recorded.get("model"), "lora": bool(recorded.get("lora", full.lora)),
              "lora_r": int(recorded.get("lora_r", full.lora_r)),
              "iterations": full.iterations or recorded.get("iterations") or DEFAULT_ITERATIONS}
    if full.lora and not inputs["lora"]:
        raise InputError(f"--lora: the run in {run_dir} trained every weight, not a LoRA adapter; drop --lora")
    keys = DATA_FLAGS.get(command, ("prompts",))
    for key in keys:
        inputs[key] = getattr(full, key) or recorded.get(key)
    if command == "rm":
        inputs["eval_frac"] = float(recorded.get("eval_frac", full.eval_frac))
    if command not in DATA_FLAGS:
        inputs["reward"] = full.reward or []
        inputs["reward_model"] = full.reward_model or list(recorded.get("reward_model") or [])
        inputs["reward_weights"] = full.reward_weights or recorded.get("reward_weights")
        used = recorded.get("reward")
        if not full.reward and used:
            # As for env ids in checkpoints (checkpoint.check_stored_env_id): what a run dir names is never imported.
            shown = used if isinstance(used, str) else " ".join(used)
            raise InputError(f"--reward: give the reward function again with --resume (the run used {shown}); "
                             "ppokit never imports a module named only by a run dir")
        if not inputs["reward"] and not inputs["reward_model"]:
            raise InputError("--reward: give the reward function again with --resume; ppokit never imports a "
                             "module named only by a run dir")
    for key in ("model", *keys):
        if not isinstance(inputs[key], str):
            raise InputError(f"--{key}: required with --resume {run_dir} (its lm_run.json does not record it)")
    return run_dir, inputs


def rank_argv(argv: list[str], run_dir) -> list[str]:
    """``argv`` (a ``ppokit lm ALGO`` command line) for each rank of ``--nproc``: without ``--nproc K`` (or an
    abbreviation argparse accepted), with ``--run-dir`` when the run dir was chosen here (a default one is named by
    the clock, which each rank would read apart)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if len(name) > 3 and "--nproc".startswith(name):
            skip = "=" not in arg
            continue
        out.append(arg)
    if run_dir is not None and "--run-dir" not in {a.split("=", 1)[0] for a in out}:
        out.append(f"--run-dir={run_dir}")
    return out


def train(command: str, full: argparse.Namespace) -> int:
    from pathlib import Path

    from ppokit.core import schema as S
    from ppokit.runtime import distributed
    from ppokit.runtime.launcher import launch

    if full.iterations is not None and full.iterations < 1:
        raise InputError(f"--iterations {full.iterations}: must be a positive integer")
    if full.nproc is not None and full.nproc < 1:
        raise InputError(f"--nproc {full.nproc}: must be a positive number of processes")
    if full.resume:
        run_dir, inputs = resume_inputs(command, full)
        config = None
    else:
        config = config_from_args(full)  # before any model is loaded: a bad value costs nothing
        for key in ("model", *DATA_FLAGS.get(command, ("reward", "prompts"))):
            if not getattr(full, key) and not (key == "reward" and getattr(full, "reward_model", None)):
                raise InputError(f"--{key}: required (ppokit lm {command} --help lists the options)")
        data_inputs = ({k: getattr(full, k) for k in DATA_FLAGS[command]} if command in DATA_FLAGS else
                       {"reward": full.reward or [], "reward_weights": full.reward_weights, "prompts": full.prompts,
                        "reward_model": [str(Path(d).resolve()) for d in full.reward_model or []]})
        inputs = {"model": full.model, "lora": full.lora, "lora_r": full.lora_r,
                  "iterations": full.iterations or DEFAULT_ITERATIONS, **data_inputs}
        if command == "rm":
            inputs["eval_frac"] = full.eval_frac
        run_dir = Path(full.run_dir) if full.run_dir else default_run_dir(command, config.seed)
        held = [name for name in RUN_FILES if (run_dir / name).exists()]
        if held:  # the trainer appends to metrics.csv: a second run there would mix two runs' rows
            raise InputError(f"--run-dir {run_dir}: already holds a run ({', '.join(held)}); continue it with "
                             f"--resume {run_dir}, choose another directory or remove it")
    check_model_dir(inputs["model"])
    reward = None
    for key in DATA_FLAGS.get(command, ("prompts",)):
        load_rows(key, inputs[key])  # a bad file is refused before the model is loaded
    if full.nproc is not None and full.nproc > 1 and not distributed.launched():
        # This process only waits for torchrun's ranks (ppokit train --nproc's launcher: signals passed on, a lost
        # rank named in one line, no rank left behind); each rank runs this command without --nproc.
        return launch(full.nproc, ["lm", command, *rank_argv(full.argv, None if full.resume else run_dir)])
    if command not in DATA_FLAGS:
        reward = load_rewards(inputs["reward"], inputs["reward_model"], inputs["reward_weights"],
                              config.device if config is not None else "cpu")
    model, tokenizer = load_model_dir(inputs["model"], device=config.device if config is not None else "cpu")
    if inputs["lora"]:
        model = apply_lora(model, inputs["lora_r"])

    from ppokit.lm import DPOTrainer, GRPOTrainer, PPOTrainer, RewardModelTrainer, SFTTrainer
    from ppokit.lm.checks import PromptError

    cls = {"ppo": PPOTrainer, "grpo": GRPOTrainer, "dpo": DPOTrainer, "sft": SFTTrainer,
           "rm": RewardModelTrainer}[command]
    data_flag = DATA_FLAGS.get(command, ("prompts",))[0]
    data_kw = ({"pairs": inputs["pairs"]} if command == "dpo" else {"data": inputs["data"]} if command == "sft"
               else {"pairs": inputs["pairs"], "eval_frac": inputs["eval_frac"]} if command == "rm"
               else {"reward": reward, "prompts": inputs["prompts"]})
    try:  # the trainers check the data, the generation budget and the memory before any work
        if full.resume:
            trainer = cls.resume(run_dir, model, tokenizer, **data_kw)
        else:
            trainer = cls(model, tokenizer, config=config, run_dir=run_dir, **data_kw)
    except PromptError as exc:
        raise InputError(f"--{data_flag} {inputs[data_flag]}: {first_line(exc)}") from None
    except ValueError as exc:  # ConfigError (max_new_tokens, memory) and bad rows included: each names its field
        text = first_line(exc)
        raise InputError("--" + text if text.startswith(f"{data_flag} {inputs[data_flag]} ") else text) from None
    # Recorded in lm_run.json, so that --resume needs only the reward again; paths absolute (the cwd may change).
    trainer.run_info = {**inputs, **{k: str(Path(inputs[k]).resolve()) for k in ("model", "pairs", "prompts",
                                                                                 "data") if k in inputs}}
    total = inputs["iterations"]
    say = print if trainer.dist.is_main else (lambda *a, **k: None)  # under torchrun: rank 0 tells
    if trainer.iteration >= total:
        trainer.close()
        say(f"ppokit lm {command}: {run_dir} is already at iteration {trainer.iteration} of {total}; give a "
              "larger --iterations to continue it")
        return 0
    try:
        if command == "dpo":
            before = trainer.preference_accuracy(trainer.pairs, implicit=True)
            trainer.train(total - trainer.iteration)
            after = trainer.preference_accuracy(trainer.pairs, implicit=True)
            summary = (f"preference accuracy {before:.3f} -> {after:.3f} on the {len(trainer.pairs)} pairs (DPO's "
                       "implicit reward beta log pi/pi_ref, chosen over rejected)")
        elif command == "sft":
            nll = [m[S.SFT_NLL] for m in trainer.train(total - trainer.iteration)]
            summary = f"completion NLL {nll[0]:.4g} (first step) -> {nll[-1]:.4g} (last)" if nll else "no step"
        elif command == "rm":
            trainer.train(total - trainer.iteration)
            summary = (f"held-out pair accuracy {trainer.accuracy():.3f} on {len(trainer.eval_rows)} pairs; saved "
                       f"{run_dir / 'reward_model'} (AutoModelForSequenceClassification)")
        else:
            summary = score_summary(trainer.train(total - trainer.iteration))
    finally:
        trainer.close()
    again = f"ppokit lm {command} --resume {run_dir}" + "".join(f" --reward {r}" for r in inputs.get("reward", []))
    if trainer.interrupted:
        import signal

        say(f"ppokit lm {command}: stopped by {trainer.interrupted} after iteration {trainer.iteration} of {total}; "
              f"saved {run_dir / 'trainer_state.pt'}; continue with: {again}")
        return 128 + int(signal.Signals[trainer.interrupted])
    say(f"ppokit lm {command}: {trainer.iteration} iterations, {summary}")
    say(f"saved: {run_dir / trainer.model_dir} (from_pretrained reads it); diagnose: ppokit doctor {run_dir}")
    return 0


def score_summary(history) -> str:
    from ppokit.core import schema as S

    name = getattr(S, "SCORE_MEAN", "charts/score_mean")
    scores = [float(m[name]) for m in history or [] if isinstance(m, dict) and name in m]
    if not scores:
        return "no score logged"
    return f"score mean {scores[0]:.4g} (first iteration) -> {scores[-1]:.4g} (last)"
