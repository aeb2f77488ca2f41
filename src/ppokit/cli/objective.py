"""``ppokit objective``: plot the clipped surrogate and print three worked cases.

The table evaluates three cases of L^CLIP (Schulman et al. 2017, eq. 7; eps = 0.2 gives 2.4, -1.6 and -2.8) with
``ppokit.core.objectives.ppo_objective`` at the requested ``--eps``, so a changed eps shows how the clip moves.
"""

from __future__ import annotations

import argparse
import math

# (ratio, advantage) of the worked cases 1-3: a clipped gain, a clipped loss, an unclipped loss.
WORKED_CASES = ((1.4, 2.0), (0.6, -2.0), (1.4, -2.0))


def _fmt(x: float) -> str:
    """Round away float noise (1.4 * 2 = 2.8000000000000003) but keep every digit a hand computation would."""
    return f"{x:.6g}"


def worked_case_rows(eps: float) -> list[dict[str, object]]:
    """One row per worked case: ratio, advantage, r*A, clip(r)*A, the objective and whether its gradient is zero."""
    from ppokit.core.objectives import ppo_objective

    rows = []
    for ratio, advantage in WORKED_CASES:
        clipped_ratio = min(max(ratio, 1.0 - eps), 1.0 + eps)
        # The objective is flat in r (zero gradient) exactly when the clip moved r in the improving direction.
        zero_grad = (advantage > 0 and ratio > 1.0 + eps) or (advantage < 0 and ratio < 1.0 - eps)
        rows.append(
            {
                "ratio": ratio,
                "advantage": advantage,
                "unclipped": ratio * advantage,
                "clipped": clipped_ratio * advantage,
                "objective": ppo_objective(math.log(ratio), 0.0, advantage, eps),
                "zero_grad": zero_grad,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ppokit.diagnostics.plots import objective_figure

    path = objective_figure(eps=args.eps, path=args.out)
    table = Table(title=f"PPO clipped surrogate, eps = {args.eps:g} (clip range [{1 - args.eps:g}, {1 + args.eps:g}])")
    for name in ("ratio", "advantage", "r*A", "clip(r)*A", "objective", "gradient"):
        table.add_column(name, justify="left" if name == "gradient" else "right")
    for row in worked_case_rows(args.eps):
        table.add_row(
            _fmt(row["ratio"]),
            _fmt(row["advantage"]),
            _fmt(row["unclipped"]),
            _fmt(row["clipped"]),
            _fmt(row["objective"]),
            "zero (clipped)" if row["zero_grad"] else "r*A (not zero)",
        )
    console = Console()
    console.print(table)
    console.print(f"wrote {path}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "objective",
        help="plot PPO's clipped surrogate and print the worked cases",
        description="Plot min(r*A, clip(r, 1-eps, 1+eps)*A) over r in [0.5, 1.5] for A = +1 and A = -1, and print "
        "three worked cases (A=2, r=1.4; A=-2, r=0.6; A=-2, r=1.4) at the given eps.",
    )
    parser.add_argument("--eps", type=float, default=0.2, help="clip coefficient epsilon (default: 0.2)")
    parser.add_argument("--out", default="objective.png", help="PNG file to write (default: objective.png)")
    parser.set_defaults(handler=run)
    return parser
