"""The inputs of ``ppokit lm ALGO`` read from disk or imported (model directory, reward functions and models, data
files, LoRA), each refused in one ``error:`` line naming its flag (``InputError``), before any training starts."""

from __future__ import annotations

import sys

# The files a tokenizer is read from (tokenizers' JSON, GPT-2/BPE, SentencePiece, WordPiece): without any of them,
# AutoTokenizer builds an empty tokenizer from config.json alone, and every prompt encodes to no tokens.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt",
                   "spiece.model")


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
        raise InputError(f"--model {path}: cannot be loaded: {type(exc).__name__}: {first_line(exc)}") from None
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
                         f"{first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        raise InputError(f"--reward {spec}: importing {module_name} failed: {type(exc).__name__}: "
                         f"{first_line(exc)}") from None
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
            raise InputError(first_line(exc)) from None
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
        raise InputError(f"--{flag} {path}: {first_line(exc).removeprefix(flag + ': ')}") from None
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
        raise InputError(f"--lora: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

