"""A sharded (DCP) vs a consolidated checkpoint of a 2-rank FSDP policy: seconds and host memory per rank.

The ~58M-parameter Llama of ``bench_lm_scale`` is sharded over 2 ranks (torchrun, gloo on 127.0.0.1) and takes one
AdamW step. Then each rank saves it in one of two ways, in its own launch:

- ``sharded``: ``lm.sharded_checkpoint.save_shards`` (what an fsdp run's periodic saves do): every rank writes its
  own shard file of the weights and AdamW's moments;
- ``consolidated``: what fsdp runs did before: every rank all-gathers the whole weights and moments
  (``lm.fsdp.full_state``, ``full_optimizer_state``) and rank 0 writes them with ``torch.save``.

Per rank: the save's wall time and its host-memory growth (the resident set sampled every millisecond during the
save, its peak minus the resident set before), and the bytes of the files it wrote. Then one process loads the
sharded checkpoint into the whole model (2 -> 1 ranks, DCP reshards) and checks the weights.

    python benchmarks/bench_lm_checkpoint.py [--smoke]      # --smoke: a 2 x 64 model, for the test of this script
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lm_scale import SIZES, SRC  # noqa: E402  (the same model as the memory benchmark)

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _PeakRss:
    """The resident set's peak while the block runs (sampled every millisecond), minus the one at entry."""

    def __enter__(self) -> "_PeakRss":
        self.before = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.before


def _model(size: str):
    import torch

    from ppokit.lm.base import adamw
    from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama

    torch.set_num_threads(1)
    tok = build_char_tokenizer("AB", pad_is_eos=True)
    model = build_tiny_llama(tok, **SIZES[size], seed=0)
    return model, adamw


def worker(size: str, mode: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from ppokit.lm.fsdp import full_optimizer_state, full_state, shard
    from ppokit.lm.sharded_checkpoint import save_shards
    from ppokit.runtime import distributed

    d = distributed.current()
    model, adamw = _model(size)
    shard(model)
    optimizer = adamw(list(model.parameters()), 1e-4, 0.0)
    ids = torch.randint(0, 3, (1, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.float().mean().backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    run = Path(out).parent / "run"
    dist.barrier()
    start = time.perf_counter()
    with _PeakRss() as rss:
        if mode == "sharded":
            name = save_shards(run, {"policy": model}, optimizer, 1, d)
        else:
            state = {"policy": full_state(model.state_dict()), "optimizer": full_optimizer_state(optimizer)}
            if d.is_main:
                run.mkdir(parents=True, exist_ok=True)
                torch.save(state, run / "consolidated.pt")
            del state
            name = "consolidated.pt"
    seconds = time.perf_counter() - start
    dist.barrier()
    files = sorted(run.glob(f"{name}/__{d.rank}_*.distcp")) if mode == "sharded" else (
        [run / name] if d.is_main else [])
    mine = {"rank": d.rank, "seconds": seconds, "rss_growth": rss.growth, "file_bytes": sum(f.stat().st_size
                                                                                         for f in files),
            "name": name, "weights": sum(p.numel() * 4 for p in model.parameters())}
    every = [None] * d.world_size
    dist.all_gather_object(every, mine)
    if d.is_main:
        Path(out).write_text(json.dumps(every))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown at exit can abort a rank after the results are written (bench_lm_scale)


def _two_ranks(size: str, mode: str, tmp: Path) -> list[dict]:
    out = tmp / mode / "ranks.json"
    out.parent.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH",
                                                                                                    "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--worker", size, mode, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"error: the 2-rank {mode} save failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _load_in_one_process(size: str, path: Path) -> tuple[float, int]:
    from ppokit.lm.sharded_checkpoint import load_shards
    from ppokit.runtime import distributed

    model, adamw = _model(size)
    optimizer = adamw(list(model.parameters()), 1e-4, 0.0)
    start = time.perf_counter()
    load_shards(path, {"policy": model}, optimizer, distributed.current())
    return time.perf_counter() - start, sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="a 2 x 64 model (seconds), for the test of this script")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    size = "smoke" if args.smoke else "full"
    mib = 2 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        rows = {mode: _two_ranks(size, mode, Path(tmp)) for mode in ("sharded", "consolidated")}
        weights = rows["sharded"][0]["weights"]
        print(f"2 ranks, {weights / 4 / 1e6:.1f}M parameters ({weights / mib:.1f} MiB fp32 weights, x3 with AdamW)")
        print(f"{'save':<13} {'rank':>4} {'seconds':>8} {'host MiB +':>11} {'file MiB':>9}")
        for mode, ranks in rows.items():
            for r in ranks:
                print(f"{mode:<13} {r['rank']:>4} {r['seconds']:>8.2f} {r['rss_growth'] / mib:>11.1f} "
                      f"{r['file_bytes'] / mib:>9.1f}")
        seconds, n = _load_in_one_process(size, Path(tmp) / "sharded" / "run" / rows["sharded"][0]["name"])
        print(f"load of the 2-rank shards in one process (resharded into whole tensors): {seconds:.2f} s, {n:,} "
              "parameters")
        worst = {mode: max(r["rss_growth"] for r in ranks) for mode, ranks in rows.items()}
        print(f"host memory growth at a save, the larger rank, sharded / consolidated: "
              f"{worst['sharded'] / max(worst['consolidated'], 1):.3f}")


if __name__ == "__main__":
    main()
