"""``ppokit report RUN_DIR``: a self-contained HTML report (curves, alerts, doctor findings, config)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="write a self-contained HTML report of a run",
                       description="One HTML file, no JavaScript, images embedded: curves with their healthy bands, "
                                   "alerts on a timeline, the doctor's findings, the config, an UNSAFE banner.")
    p.add_argument("run_dir", help="run directory")
    p.add_argument("--out", default=None, metavar="FILE", help="output file (default: RUN_DIR/report.html)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from ppokit.analysis.report import write_report

    try:
        path = write_report(args.run_dir, args.out)
    except (FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (UnicodeDecodeError, ValueError) as exc:
        # A metrics.csv that is not text, or has no global_step column: say which run, not a traceback.
        print(f"error: cannot read the run in {args.run_dir}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
