"""benchmarks/bench_actors.py's ``--curves`` binning: each update's return lands in the bin of env steps it ended in,
empty bins and NaN returns (no episode finished) stay out of the means."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_actors.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_actors", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_binned_means_by_the_step_each_update_ended_at():
    b = _bench()
    assert b.BINS == 10
    # 1000 steps in 10 bins of 100: steps 100 and 200 end bins 1 and 2 exactly (right-closed), 150 is bin 2's.
    curve = [(100, 1.0), (150, 3.0), (200, 5.0), (250, math.nan), (1000, 7.0), (990, 9.0)]
    bins = b.binned(curve, 1000)
    assert bins[0] == 1.0 and bins[1] == 4.0 and bins[-1] == 8.0
    assert all(math.isnan(x) for x in bins[2:9])  # bin 3's only update had no episode: NaN, not 0
    assert b._mean([1.0, math.nan, 3.0]) == 2.0 and math.isnan(b._mean([math.nan]))
