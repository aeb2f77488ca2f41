"""``ppokit export RUN --format onnx|torchscript|archive --out FILE``: a trained policy as one deployable file."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a trained policy (ONNX, TorchScript or a one-file archive)",
                       description="Write the run's deterministic policy, observation normalization folded in, as "
                       "an ONNX or TorchScript graph (input 'obs': float32 [batch, obs_dim]; output 'action': the "
                       "env's action, argmax or the clipped mean), or as an archive: one file with the config, "
                       "weights, normalizer statistics and a model card that ppokit.load and ppokit eval read.")
    p.add_argument("run_dir", help="run directory (or checkpoint file)")
    p.add_argument("--format", required=True, choices=("onnx", "torchscript", "archive"), dest="fmt",
                   help="onnx (needs pip install 'ppokit[export]'), torchscript or archive")
    p.add_argument("--out", required=True, metavar="FILE", help="the file to write")
    p.add_argument("--best", action="store_true", help="export the run's best.pt (kept by the evaluation gate) "
                   "instead of its latest checkpoint")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from ppokit.export import ExportError, export
    from ppokit.runtime.checkpoint import CheckpointError
    from ppokit.runtime.rundir import best_checkpoint

    try:
        checkpoint = best_checkpoint(args.run_dir) if args.best else None
        result = export(args.run_dir, args.fmt, args.out, checkpoint=checkpoint)
    except (ExportError, CheckpointError, ValueError, OSError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"wrote {Path(result['path'])} ({args.fmt})")
    return 0
