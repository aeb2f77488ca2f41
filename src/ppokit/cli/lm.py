"""``ppokit lm ppo|grpo|dpo|sft|rm|demo``: train a local Hugging Face causal LM with PPO-RLHF, GRPO, DPO or SFT,
or a reward model from it.

``ppokit lm grpo --model DIR --reward mymod:fn --prompts prompts.jsonl`` reads any directory ``from_pretrained``
reads (nothing is downloaded), imports the reward function from the current directory (the user typed its name),
trains and saves the policy into the run directory. ``ppokit lm demo`` is the self-contained CPU demo.

Every ``LMConfig`` field is a flag (``--kl-coef``, ``--group-size``, ...). Building that parser needs torch, and
``ppokit --help`` must stay light (tests/test_startup.py), so ``ppokit lm ALGO`` is registered empty and builds
its full parser only when it is the subcommand being parsed (``_Deferred``).

This file registers the commands and runs the handler; the flags are defined in ``lm_flags``, the inputs read in
``lm_inputs``, the training commands run in ``lm_train`` (the demo in ``ppokit.lm.demo``).
Bad input (model dir, reward, prompts, pairs, config value) is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from ppokit.cli.lm_flags import full_parser
from ppokit.cli.lm_inputs import InputError

LM_EXTRA_HINT = "ppokit lm needs the language-model extra: pip install -e '.[lm]'"


class _Deferred(argparse.ArgumentParser):
    """A subcommand parser built empty (cheap for ``ppokit --help``) that parses its command line with the full
    parser (``lm_flags.full_parser``: every LMConfig field a flag) only when this subcommand is the one being run; the
    result is ``namespace.lm_args``. Unknown flags and ``--help`` behave as argparse's always do."""

    def parse_known_args(self, args=None, namespace=None):
        namespace = namespace if namespace is not None else argparse.Namespace()
        for key, value in self._defaults.items():  # handler, lm_command (set_defaults)
            setattr(namespace, key, value)
        full = full_parser(self._defaults["lm_command"])
        argv = list(args if args is not None else sys.argv[1:])
        namespace.lm_args = full.parse_args(argv)
        namespace.lm_args.argv = argv  # what --nproc re-launches on every rank (lm_train.rank_argv)
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
             "demo": "the self-contained CPU demo: SFT a tiny GPT-2, then PPO, GRPO and DPO (under a minute)",
             "export": "the policy of an --fsdp run's latest sharded checkpoint as a save_pretrained directory, "
                       "in one process (a run killed before its final save)"}
    for name, text in helps.items():
        q = lm_sub.add_parser(name, help=text, add_help=False)
        q.set_defaults(handler=run, lm_command=name)
    p.set_defaults(handler=_no_algo, lm_parser=p)


def _no_algo(args: argparse.Namespace) -> int:
    args.lm_parser.print_help()
    return 2


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
    from ppokit.runtime import distributed, launcher
    from ppokit.runtime.checkpoint import CheckpointError
    from ppokit.runtime.logger import SinkError
    from ppokit.runtime.rundir import RunDirError

    if distributed.launched():
        launcher.watch_launcher()  # under --nproc: stop when the launcher is gone, even by kill -9

    try:
        if command == "demo":
            from ppokit.lm.demo import run_demo

            run_demo(seed=full.seed, json_path=full.json, out_dir=full.out, quiet=full.quiet,
                     stages=("ppo", "grpo", "dpo", *(("rlhf",) if full.rlhf else ())))
            return 0
        if command == "export":
            return _export(full)
        from ppokit.cli.lm_train import train

        return train(command, full)
    except distributed.DistributedError as exc:
        # A rank was lost or timed out. Under --nproc, when a peer exited, the launcher's one line names it.
        if exc.peer_exited and launcher.supervised():
            return 1
        print(f"error: {exc}; the run dir keeps its last checkpoint: continue with ppokit lm {command} --resume "
              "RUN_DIR", file=sys.stderr)
        return 1
    except (InputError, ConfigError, RunDirError, CheckpointError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (*RUN_FAILURES, SinkError) as exc:  # the reward, a prompt or a sink failed mid-run; the last
        print(f"error: {exc}", file=sys.stderr)  # finished iteration is saved (the message says where)
        return 1
    except KeyboardInterrupt:
        # Before training (loading the model) or a second Ctrl-C: the last checkpoint, if any, is intact.
        print("interrupted; the run dir keeps its last checkpoint", file=sys.stderr)
        return 130
    finally:
        if distributed.launched():
            distributed.shutdown()



def _export(full: argparse.Namespace) -> int:
    """``ppokit lm export RUN_DIR OUT``: ``lm.sharded_checkpoint.export_policy`` with the run's starting model."""
    import json
    from pathlib import Path

    from ppokit.cli.lm_inputs import load_model_dir
    from ppokit.lm.sharded_checkpoint import export_policy

    run_dir = Path(full.run_dir)
    try:
        meta = json.loads((run_dir / "lm_run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = {}
    cli = meta.get("cli") if isinstance(meta, dict) else None
    cli = cli if isinstance(cli, dict) else {}
    model_dir = full.model or cli.get("model")
    if not isinstance(model_dir, str):
        raise InputError(f"--model: required (the model directory {run_dir} started from; its lm_run.json does "
                         "not record one)")
    if cli.get("lora"):
        raise InputError(f"{run_dir}: a LoRA run's export is its adapter, policy/, written at each train() call's "
                         "last save; resume the run (--resume) to write it")
    model, tokenizer = load_model_dir(model_dir)
    iteration = export_policy(run_dir, model, tokenizer, Path(full.out))
    print(f"ppokit lm export: iteration {iteration} of {run_dir} -> {full.out} (from_pretrained reads it)")
    return 0
