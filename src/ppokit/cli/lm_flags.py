"""Every flag of ``ppokit lm ALGO``: the command's own inputs (``--model``, ``--prompts``, ``--reward``, ...) and one
kebab-case flag per ``LMConfig`` field (``--kl-coef``, ``--group-size``, ...), with the parsing of their values.

A new LM flag is added here: ``full_parser`` for an input of the command, an ``LMConfig`` field for a training
setting (it becomes a flag by itself). Heavy imports (torch, through LMConfig) happen inside the functions, so that
``ppokit --help`` stays light (tests/test_startup.py).
"""

from __future__ import annotations

import argparse

ALGOS = ("ppo", "grpo", "dpo", "sft", "rm")
# The data flags each command reads (the others read --reward and --prompts).
DATA_FLAGS = {"dpo": ("pairs",), "rm": ("pairs",), "sft": ("data",)}
DEFAULT_ITERATIONS = 20


def config_flags(parser: argparse.ArgumentParser) -> None:
    """One kebab-case flag per ``LMConfig`` field, help from the field's metadata; values parsed by type."""
    import dataclasses

    from ppokit.lm.config import LMConfig

    group = parser.add_argument_group("LMConfig fields")
    for f in dataclasses.fields(LMConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        if str(f.type) == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=help_text)


def full_parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"ppokit lm {command}")
    if command == "demo":
        p.add_argument("--seed", type=int, default=1, help="seed of the whole demo (default: 1)")
        p.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
        p.add_argument("--out", metavar="DIR", default="runs/lm_demo",
                       help="directory for the plot and the PPO/GRPO run directories (default: runs/lm_demo)")
        p.add_argument("--quiet", action="store_true", help="print only the summary")
        p.add_argument("--rlhf", action="store_true",
                       help="also run the InstructGPT chain: a reward model trained on SFT preference pairs, then "
                            "PPO against it (about as long again)")
        return p
    if command == "export":
        p.add_argument("run_dir", metavar="RUN_DIR", help="the run dir of an --fsdp run (its trainer_state.pt "
                                                          "names its shards)")
        p.add_argument("out", metavar="OUT", help="a new directory for the save_pretrained policy")
        p.add_argument("--model", metavar="DIR", help="the model directory the run started from (its "
                                                      "architecture and tokenizer; default: the run's, from "
                                                      "lm_run.json)")
        return p
    p.add_argument("--model", metavar="DIR", help="model directory (from_pretrained; no download); required, "
                                                  "except with --resume (default: the run's)")
    if command in ("dpo", "rm"):
        p.add_argument("--pairs", metavar="FILE", help='JSONL of {"prompt": ..., "chosen": ..., "rejected": ...} '
                                                       "preference pairs (strings or chat messages), or a "
                                                       "save_to_disk directory; required, except with --resume")
        if command == "rm":
            p.add_argument("--eval-frac", type=float, default=0.1,
                           help="share of the pairs held out for the logged accuracy (default: 0.1)")
    elif command == "sft":
        p.add_argument("--data", metavar="FILE", help='JSONL of {"prompt": ..., "completion": ...} or {"messages": '
                                                      "[...]} rows, or a save_to_disk directory; required, except "
                                                      "with --resume")
    else:
        p.add_argument("--reward", metavar="MODULE:FUNCTION", action="append",
                       help="reward_fn(prompts, completions, **info) -> list[float], imported from the current "
                            "directory (or installed packages); repeat it for several; required (or --reward-model), "
                            "with --resume too (a run dir never chooses what is imported)")
        p.add_argument("--reward-model", metavar="DIR", action="append",
                       help="a sequence-classification reward model directory (one label, its own tokenizer; "
                            "the completion is re-tokenized for it); repeatable")
        p.add_argument("--reward-weights", metavar="W1,W2,...",
                       help="one weight per --reward, then per --reward-model, in order (default: all 1); the "
                            "score is the weighted sum, each term logged as lm/reward/<name>")
        p.add_argument("--prompts", metavar="FILE", help='prompts: a JSONL file ({"prompt": ...} per line; a prompt '
                                                         "may be chat messages, other fields reach the reward as "
                                                         "keyword lists), a text file (one per line) or a "
                                                         "save_to_disk directory; required, except with --resume")
    p.add_argument("--iterations", type=int, default=None,
                   help=f"training iterations in all (DPO: optimizer steps; default: {DEFAULT_ITERATIONS}); "
                        "with --resume the run continues up to this count (default: the run's)")
    p.add_argument("--run-dir", metavar="DIR", help="run directory (default: runs/lm_<algo>__s<seed>__<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run saved in RUN_DIR (its trainer_state.pt) "
                                                       "with its config, exactly as if it had not stopped")
    p.add_argument("--nproc", type=int, default=None, metavar="K",
                   help="K ranks on this machine: re-launches this command under torchrun --standalone "
                        "--nproc_per_node=K (as ppokit train --nproc does), data-parallel, or sharded with --fsdp; "
                        "batch_prompts is per rank. For several machines run torchrun yourself with --run-dir")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of every weight; "
                                                       "pi_ref is then the base model with the adapter disabled")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default: 8)")
    config_flags(p)
    return p


def _parse_value(text: str, kind: str, name: str):
    """A flag's text as the field's type (``none`` for an optional field); ConfigError naming the field."""
    from ppokit.core.errors import ConfigError

    if "None" in kind and text.strip().lower() in ("none", "null", ""):
        return None
    base = kind.split("|")[0].strip()
    from ppokit.config.ppo_config import _BadValue, _int  # PPOConfig's flag parsing: "1e5" is an integer too

    try:
        if base == "int":
            return _int(text, text=True)
        if base == "float":
            return float(text)
    except (ValueError, OverflowError, _BadValue):
        raise ConfigError(name, f"must be {'an integer' if base == 'int' else 'a number'}, got {text!r}") from None
    return text


def config_from_args(args: argparse.Namespace, **fixed):
    """A validated ``LMConfig`` from the flags that were given (others keep their defaults) plus ``fixed``."""
    import dataclasses

    from ppokit.lm.config import LMConfig

    data = dict(fixed)
    for f in dataclasses.fields(LMConfig):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        data[f.name] = value if isinstance(value, bool) else _parse_value(value, str(f.type), f.name)
    return LMConfig.from_dict(data)



def given_config_flags(full: argparse.Namespace) -> list[str]:
    import dataclasses

    from ppokit.lm.config import LMConfig

    return ["--" + f.name.replace("_", "-") for f in dataclasses.fields(LMConfig) if getattr(full, f.name, None)
            is not None]

