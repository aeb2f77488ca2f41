"""``ppokit doctor RUN_DIR``: ranked diagnosis of a run with evidence and fixes (exit 0 healthy or too short to
judge, 1 problem, 2 not a run directory)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from ppokit.analysis.doctor_rules import MIN_UPDATES_TO_JUDGE

    p = sub.add_parser("doctor", help="diagnose a run: ranked problems with evidence and fixes",
                       description="Read metrics.csv, alerts.jsonl and config.toml of RUN_DIR and print a ranked "
                                   "diagnosis. Exit code 0: healthy, or too short to judge (fewer than "
                                   f"{MIN_UPDATES_TO_JUDGE} updates/iterations: not a problem, too little of it); "
                                   "1: problem found; 2: not a run directory.")
    p.add_argument("run_dir", help="run directory")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from ppokit.analysis.doctor import diagnose

    try:
        diagnosis = diagnose(args.run_dir)
    except (FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(diagnosis.to_dict(), indent=2))
    else:
        print(diagnosis.to_text(), end="")
    return 1 if diagnosis.verdict == "problem" else 0
