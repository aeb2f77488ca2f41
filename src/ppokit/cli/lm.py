"""``ppokit lm ppo|grpo|dpo|sft|rm|demo``: train a local Hugging Face causal LM with PPO-RLHF, GRPO, DPO or SFT,
or a reward model from it.

``ppokit lm grpo --model DIR --reward mymod:fn --prompts prompts.jsonl`` reads any directory ``from_pretrained``
reads (nothing is downloaded), imports the reward function from the current directory (the user typed its name),
trains and saves the policy into the run directory. ``ppokit lm demo`` is the self-contained CPU demo.

Every ``LMConfig`` field is a flag (``--kl-coef``, ``--group-size``, ...). Building that parser needs torch, and
``ppokit --help`` must stay light (tests/test_startup.py), so ``ppokit lm ALGO`` is registered empty and builds
its full parser only when it is the subcommand being parsed (``_Deferred``).
Bad input (model dir, reward, prompts, pairs, config value) is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

LM_EXTRA_HINT = "ppokit lm needs the language-model extra: pip install -e '.[lm]'"
RUN_FILES = ("metrics.csv", "lm_run.json", "trainer_state.pt")  # what an LM trainer writes into its run dir
# The files a tokenizer is read from (tokenizers' JSON, GPT-2/BPE, SentencePiece, WordPiece): without any of them,
# AutoTokenizer builds an empty tokenizer from config.json alone, and every prompt encodes to no tokens.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt",
                   "spiece.model")
ALGOS = ("ppo", "grpo", "dpo", "sft", "rm")
# The data flags each command reads (the others read --reward and --prompts).
DATA_FLAGS = {"dpo": ("pairs",), "rm": ("pairs",), "sft": ("data",)}
DEFAULT_ITERATIONS = 20


class _Deferred(argparse.ArgumentParser):
    """A subcommand parser built empty (cheap for ``ppokit --help``) that parses its command line with the full
    parser (``_full_parser``: every LMConfig field a flag) only when this subcommand is the one being run; the
    result is ``namespace.lm_args``. Unknown flags and ``--help`` behave as argparse's always do."""

    def parse_known_args(self, args=None, namespace=None):
        namespace = namespace if namespace is not None else argparse.Namespace()
        for key, value in self._defaults.items():  # handler, lm_command (set_defaults)
            setattr(namespace, key, value)
        full = _full_parser(self._defaults["lm_command"])
        namespace.lm_args = full.parse_args(list(args if args is not None else sys.argv[1:]))
        return namespace, []


def add_parser(sub) -> None:
    p = sub.add_parser("lm", help="language models: PPO-RLHF, GRPO and DPO on a local model directory; the demo",
                       description="Train a local Hugging Face causal LM (a directory from_pretrained reads) with "
                                   "PPO-RLHF, GRPO or DPO, or run the CPU demo. `ppokit lm ALGO --help` lists "
                                   "every option. Needs pip install -e '.[lm]'.")
    lm_sub = p.add_subparsers(dest="lm_command", metavar="ALGO", parser_class=_Deferred)
    helps = {"ppo": "PPO-RLHF: per-token KL to pi_ref in the reward, a value model, GAE over response tokens",
             "grpo": "GRPO: G completions per prompt, group-normalised advantages, no critic",
             "dpo": "DPO: preference pairs (prompt, chosen, rejected), no reward function, no sampling",
             "sft": "SFT: supervised fine-tuning on prompt/completion (or conversational) rows, completion loss only",
             "rm": "reward model: Bradley-Terry on preference pairs, saved to RUN_DIR/reward_model",
             "demo": "the self-contained CPU demo: SFT a tiny GPT-2, then PPO, GRPO and DPO (under a minute)"}
    for name, text in helps.items():
        q = lm_sub.add_parser(name, help=text, add_help=False)
        q.set_defaults(handler=run, lm_command=name)
    p.set_defaults(handler=_no_algo, lm_parser=p)


def _no_algo(args: argparse.Namespace) -> int:
    args.lm_parser.print_help()
    return 2


# ---------------------------------------------------------------- the full parsers (built in the handler)
def _config_flags(parser: argparse.ArgumentParser) -> None:
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


def _full_parser(command: str) -> argparse.ArgumentParser:
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
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of every weight; "
                                                       "pi_ref is then the base model with the adapter disabled")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default: 8)")
    _config_flags(p)
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


# ---------------------------------------------------------------- inputs, each refused in one line
class InputError(Exception):
    """Bad user input: printed as one ``error:`` line, exit code 2."""


def check_model_dir(path: str):
    """The directory as a Path when it looks like a model directory (cheap: before anything is imported)."""
    from pathlib import Path

    d = Path(path)
    if not d.is_dir():
        raise InputError(f"--model {path}: no such directory (give a local model directory; nothing is downloaded)")
    if not (d / "config.json").is_file():
        raise InputError(f"--model {path}: not a model directory (no config.json; save one with save_pretrained)")
    return d


def load_model_dir(path: str, *, device: str = "cpu"):
    """``(model, tokenizer)`` from a local model directory; InputError when it is not one."""
    d = check_model_dir(path)
    if not any((d / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(f"--model {path}: has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save the "
                         "tokenizer into it with tokenizer.save_pretrained(DIR)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI's stderr holds its own lines only (one line per error)
    try:
        tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).to(device)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, ... for bad dirs
        raise InputError(f"--model {path}: cannot be loaded: {type(exc).__name__}: {_first_line(exc)}") from None
    return model, tokenizer


def load_reward(spec: str):
    """The callable named by ``module:function``, the module imported with the current directory first on the path.

    Importing runs the user's module; that is what they asked for by typing its name (as ``--env mymod:Env``)."""
    import importlib
    import os

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"--reward {spec}: expected MODULE:FUNCTION, e.g. mymod:reward_fn")
    if module_name.endswith(".py"):
        raise InputError(f"--reward {spec}: name the module, not the file: {module_name[:-3]}:{attr}")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name.split(".")[0] or exc.name == module_name:
            raise InputError(f"--reward {spec}: no module {module_name!r} in {cwd} or the installed packages") \
                from None
        raise InputError(f"--reward {spec}: importing {module_name} failed: {type(exc).__name__}: "
                         f"{_first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        raise InputError(f"--reward {spec}: importing {module_name} failed: {type(exc).__name__}: "
                         f"{_first_line(exc)}") from None
    finally:
        if added:
            sys.path.remove(cwd)
    fn = getattr(module, attr, None)
    if fn is None:
        raise InputError(f"--reward {spec}: module {module_name} has no attribute {attr!r}")
    if not callable(fn):
        raise InputError(f"--reward {spec}: {attr} is a {type(fn).__name__}, not a function")
    return fn


def parse_weights(text: str | None, n: int) -> list[float]:
    """``--reward-weights`` as ``n`` finite numbers (all 1.0 when not given); InputError otherwise."""
    import math

    if text is None:
        return [1.0] * n
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise InputError(f"--reward-weights {text}: expected comma-separated numbers, e.g. 1,0.5") from None
    if len(weights) != n:
        raise InputError(f"--reward-weights {text}: {len(weights)} weights for {n} rewards (--reward, then "
                         "--reward-model, in order); give one per reward")
    if not all(math.isfinite(w) for w in weights):
        raise InputError(f"--reward-weights {text}: every weight must be a finite number")
    return weights


def load_rewards(specs: list[str], model_dirs: list[str], weights: str | None, device: str = "cpu"):
    """The reward the trainer gets: one function or reward model alone, or the weighted list of all of them."""
    from ppokit.lm.reward_models import load_reward_model

    terms = [load_reward(spec) for spec in specs]
    for d in model_dirs:
        try:
            terms.append(load_reward_model(d, device=device))
        except ValueError as exc:
            raise InputError(_first_line(exc)) from None
    w = parse_weights(weights, len(terms))
    if len(terms) == 1 and w == [1.0]:
        return terms[0]
    return list(zip(terms, w))


def load_rows(flag: str, path: str) -> list:
    """The rows of a JSONL/text file or a ``save_to_disk`` directory (``ppokit.lm.data.read_rows``), read before
    any model is loaded; InputError naming the flag and the file."""
    from ppokit.lm.data import read_rows

    try:
        rows = read_rows(path, flag)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError) as exc:
        raise InputError(f"--{flag} {path}: {_first_line(exc).removeprefix(flag + ': ')}") from None
    if not rows:
        raise InputError(f"--{flag} {path}: no rows in the file")
    return rows


def apply_lora(model, r: int):
    """Wrap ``model`` in a LoRA adapter of rank ``r`` (peft picks the target modules for known architectures)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise InputError("--lora needs peft: pip install -e '.[lora]'") from None
    if r < 1:
        raise InputError(f"--lora-r {r}: must be a positive integer")
    try:
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM"))
    except ValueError as exc:  # an architecture peft has no default target modules for
        raise InputError(f"--lora: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---------------------------------------------------------------- handler
def run(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"error: {LM_EXTRA_HINT}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    command, full = args.lm_command, args.lm_args
    from ppokit.core.errors import ConfigError
    from ppokit.lm.durable import RUN_FAILURES
    from ppokit.runtime.checkpoint import CheckpointError
    from ppokit.runtime.logger import SinkError
    from ppokit.runtime.rundir import RunDirError

    try:
        if command == "demo":
            from ppokit.lm.demo import run_demo

            run_demo(seed=full.seed, json_path=full.json, out_dir=full.out, quiet=full.quiet,
                     stages=("ppo", "grpo", "dpo", *(("rlhf",) if full.rlhf else ())))
            return 0
        return _train(command, full)
    except (InputError, ConfigError, RunDirError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (*RUN_FAILURES, SinkError) as exc:  # the reward, a prompt or a sink failed mid-run; the last
        print(f"error: {exc}", file=sys.stderr)  # finished iteration is saved (the message says where)
        return 1
    except KeyboardInterrupt:
        # Before training (loading the model) or a second Ctrl-C: the last checkpoint, if any, is intact.
        print("interrupted; the run dir keeps its last checkpoint", file=sys.stderr)
        return 130


def _default_run_dir(command: str, seed: int):
    import time
    from pathlib import Path

    base = Path("runs") / f"lm_{command}__s{seed}__{time.strftime('%Y%m%d-%H%M%S')}"
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}_{k}")
    return path


def _given_config_flags(full: argparse.Namespace) -> list[str]:
    import dataclasses

    from ppokit.lm.config import LMConfig

    return ["--" + f.name.replace("_", "-") for f in dataclasses.fields(LMConfig) if getattr(full, f.name, None)
            is not None]


def _resume_inputs(command: str, full: argparse.Namespace):
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
    given = _given_config_flags(full)
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


def _train(command: str, full: argparse.Namespace) -> int:
    from pathlib import Path

    from ppokit.core import schema as S

    if full.iterations is not None and full.iterations < 1:
        raise InputError(f"--iterations {full.iterations}: must be a positive integer")
    if full.resume:
        run_dir, inputs = _resume_inputs(command, full)
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
        run_dir = Path(full.run_dir) if full.run_dir else _default_run_dir(command, config.seed)
        held = [name for name in RUN_FILES if (run_dir / name).exists()]
        if held:  # the trainer appends to metrics.csv: a second run there would mix two runs' rows
            raise InputError(f"--run-dir {run_dir}: already holds a run ({', '.join(held)}); continue it with "
                             f"--resume {run_dir}, choose another directory or remove it")
    check_model_dir(inputs["model"])
    reward = None
    for key in DATA_FLAGS.get(command, ("prompts",)):
        load_rows(key, inputs[key])  # a bad file is refused before the model is loaded
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
        raise InputError(f"--{data_flag} {inputs[data_flag]}: {_first_line(exc)}") from None
    except ValueError as exc:  # ConfigError (max_new_tokens, memory) and bad rows included: each names its field
        text = _first_line(exc)
        raise InputError("--" + text if text.startswith(f"{data_flag} {inputs[data_flag]} ") else text) from None
    # Recorded in lm_run.json, so that --resume needs only the reward again; paths absolute (the cwd may change).
    trainer.run_info = {**inputs, **{k: str(Path(inputs[k]).resolve()) for k in ("model", "pairs", "prompts",
                                                                                 "data") if k in inputs}}
    total = inputs["iterations"]
    if trainer.iteration >= total:
        trainer.close()
        print(f"ppokit lm {command}: {run_dir} is already at iteration {trainer.iteration} of {total}; give a "
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
            summary = _score_summary(trainer.train(total - trainer.iteration))
    finally:
        trainer.close()
    again = f"ppokit lm {command} --resume {run_dir}" + "".join(f" --reward {r}" for r in inputs.get("reward", []))
    if trainer.interrupted:
        import signal

        print(f"ppokit lm {command}: stopped by {trainer.interrupted} after iteration {trainer.iteration} of {total}; "
              f"saved {run_dir / 'trainer_state.pt'}; continue with: {again}")
        return 128 + int(signal.Signals[trainer.interrupted])
    print(f"ppokit lm {command}: {trainer.iteration} iterations, {summary}")
    print(f"saved: {run_dir / trainer.model_dir} (from_pretrained reads it); diagnose: ppokit doctor {run_dir}")
    return 0


def _score_summary(history) -> str:
    from ppokit.core import schema as S

    name = getattr(S, "SCORE_MEAN", "charts/score_mean")
    scores = [float(m[name]) for m in history or [] if isinstance(m, dict) and name in m]
    if not scores:
        return "no score logged"
    return f"score mean {scores[0]:.4g} (first iteration) -> {scores[-1]:.4g} (last)"
