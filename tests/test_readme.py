"""Every README code block runs: the Python blocks execute as written (in a scratch directory), every ``ppokit``
command line of the bash blocks parses with the real argument parser, the cheap ones run, and every ``--flag``
the prose names exists, so a renamed flag or a stale example fails here instead of on a new user's machine."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from ppokit.cli import build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# Commands cheap enough to run for real (a figure; a plan, which probes the env for a few hundred steps).
RUNNABLE = ("objective", "plan")


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text(encoding="utf-8")) if lang == language]


def ppokit_commands() -> list[list[str]]:
    """The argv (after ``ppokit``) of each ``ppokit ...`` line of the README's bash blocks, comments removed."""
    commands = []
    for body in blocks("bash"):
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == "ppokit":
                commands.append(words[1:])
    return commands


def docs_commands() -> list[tuple[str, list[str]]]:
    """``(file, argv)`` of each example ``ppokit ...`` (or ``$ ppokit ...``) line in the code blocks of docs/*.md,
    backslash continuations joined; a usage synopsis (``[--out FILE]``, ``ENV_ID``) is not an example."""
    commands = []
    for doc in sorted(README.parent.glob("docs/*.md")):
        for _, body in FENCE.findall(doc.read_text(encoding="utf-8")):
            lines = body.replace("\\\n", " ").splitlines()
            # A block with "$ " prompts mixes commands and their output: only the prompted lines are commands.
            if any(line.startswith("$ ") for line in lines):
                lines = [line[2:] for line in lines if line.startswith("$ ")]
            for line in lines:
                if line.startswith("ppokit ") and "[" not in line and not re.search(r"\b[A-Z_]{4,}\b", line):
                    commands.append((doc.name, shlex.split(line, comments=True)[1:]))
    return commands


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_readme_has_the_blocks_this_test_reads():
    assert len(blocks("python")) >= 1 and len(blocks("bash")) >= 4
    names = {argv[0] for argv in ppokit_commands() if argv}
    assert {"train", "eval", "objective", "plan", "doctor", "report", "sweep", "compare"} <= names


@pytest.mark.parametrize("argv", ppokit_commands(), ids=lambda argv: " ".join(argv) or "(none)")
def test_every_ppokit_command_line_parses(argv, capsys):
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports the bad flag on stderr and exits 2
        pytest.fail(f"README command `ppokit {shlex.join(argv)}` does not parse: {capsys.readouterr().err.strip()}"
                    f" (exit {exc.code})")
    assert hasattr(args, "handler"), f"`ppokit {shlex.join(argv)}` names no subcommand"


@pytest.mark.parametrize("doc,argv", docs_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v[:3]))
def test_every_ppokit_command_in_the_docs_parses(doc, argv, capsys):
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{doc}: `ppokit {shlex.join(argv)}` does not parse: {capsys.readouterr().err.strip()} "
                    f"(exit {exc.code})")


def test_the_cheap_commands_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ran = []
    for argv in ppokit_commands():
        if argv and argv[0] in RUNNABLE:
            assert main(argv) == 0, argv
            ran.append(argv[0])
    assert set(ran) == set(RUNNABLE)
    assert (tmp_path / "objective.png").stat().st_size > 10_000
    plan = (tmp_path / "plan.toml").read_text()
    assert 'env_id = "MountainCar-v0"' in plan and "total_timesteps = 200000" in plan


def test_every_flag_the_readme_names_exists():
    known = {opt for sp in subparsers().values() for action in sp._actions for opt in action.option_strings}
    known |= {opt for action in build_parser()._actions for opt in action.option_strings}
    # `ppokit lm ALGO` builds its full parser only when it runs (cli.lm._Deferred): ask for each one.
    from ppokit.cli.lm_flags import ALGOS, full_parser

    known |= {opt for algo in (*ALGOS, "demo") for action in full_parser(algo)._actions
              for opt in action.option_strings}
    text = README.read_text(encoding="utf-8")
    named = set()
    for code in re.findall(r"`([^`\n]+)`", text):
        # `--anneal-lr/--no-anneal-lr`, `--vector-mode sync|async`, `--hidden-sizes 64,64`: each --flag token.
        named.update(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", code))
    # (The bash blocks' ppokit lines are checked by parsing them.) Other tools' flags the README mentions:
    not_ppokit = {"--index-url", "--extra-index-url", "--logdir"}  # pip, tensorboard
    unknown = sorted(named - known - not_ppokit)
    assert not unknown, f"the README names flags no ppokit command has: {unknown}"


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs_as_written(index, tmp_path, monkeypatch):
    # As a user would paste it: in a fresh directory (runs/ is created there), no substitutions.
    monkeypatch.chdir(tmp_path)
    source = blocks("python")[index]
    namespace = {"__name__": "__readme__"}
    exec(compile(source, f"README.md python block {index + 1}", "exec"), namespace)
    # It ran as written and did what it says: a trained run, resumed, loaded and evaluated.
    if "run" in namespace:
        assert (namespace["run"].run_dir / "checkpoint.pt").is_file()
        assert namespace["run"].global_step > 10_000  # the resume went on past the first 10k steps
    assert namespace, "the block defined nothing"
