"""Console output off a terminal and on narrow ones: one plain line per logged update, never a collapsed table
(``r… l… policy …`` at 80 columns); a wide terminal keeps the live bar and the table."""

from __future__ import annotations

import io
import math
import re

from rich.console import Console

from ppokit.config.ppo_config import load_preset
from ppokit.runtime.logger import ConsoleSink
from ppokit.training.trainer import train

LINE = re.compile(r"^update [\d,]+ step [\d,]+ return (-|-?[\d.]+) kl (-|\S+) clipfrac (-|\S+) ev (-|\S+) "
                  r"sps (-|[\d,]+)$")
TABLE_CHARS = set("│┃━┏┓┗┛─…")


def metrics(update: int, **over) -> dict[str, float]:
    m = {"update": float(update), "charts/episodic_return": 500.0, "diag/approx_kl": 0.00045, "diag/clipfrac": 0.02,
         "diag/explained_variance": 0.7234, "perf/sps": 6068.4, "losses/policy_loss": -0.01,
         "losses/value_loss": 0.3, "diag/entropy": 0.6}
    m.update(over)
    return m


def run_sink(console: Console, updates: int = 6, log_every: int = 2, first: int = 380) -> tuple[ConsoleSink, str]:
    sink = ConsoleSink(1_000_000, log_every=log_every, console=console)
    for k in range(updates):
        sink.write((first + k) * 256, metrics(first + k))
    sink.close()
    return sink, console.file.getvalue()


def test_piped_output_at_80_columns_prints_one_plain_line_per_logged_update():
    sink, out = run_sink(Console(file=io.StringIO(), width=80))
    assert sink.plain and not sink.live
    # Updates 380..385 logged every 2nd write: the 2nd, 4th and 6th (381, 383, 385).
    assert out.splitlines() == [f"update {u} step {u * 256:,} return 500.0 kl 0.00045 clipfrac 0.02 ev 0.72 sps 6,068"
                                for u in (381, 383, 385)]
    assert "\x1b[" not in out and not TABLE_CHARS & set(out)


def test_a_narrow_terminal_gets_plain_lines_too():
    sink, out = run_sink(Console(file=io.StringIO(), width=80, force_terminal=True))
    assert sink.plain and not sink.live
    lines = out.splitlines()
    assert len(lines) == 3 and all(LINE.match(line) for line in lines), lines
    assert not TABLE_CHARS & set(out)


def test_a_wide_terminal_keeps_the_bar_and_the_table():
    sink, out = run_sink(Console(file=io.StringIO(), width=120, force_terminal=True))
    assert not sink.plain and sink.live
    assert "━" in out and "approx KL" in out and "update 385" in out
    assert not any(LINE.match(line) for line in out.splitlines())


def test_close_prints_the_last_update_once_and_missing_metrics_show_a_dash():
    console = Console(file=io.StringIO(), width=80)
    sink = ConsoleSink(10_000, log_every=10, console=console)
    sink.write(128, {"update": 1.0, "charts/episodic_return": math.nan, "diag/approx_kl": 1.5e-5, "perf/sps": 900.0})
    sink.write(256, {"update": 2.0, "charts/episodic_return": math.nan, "diag/approx_kl": math.nan, "perf/sps": 950.0})
    sink.close()
    sink.close()
    # No episode finished: return is "-"; a NaN KL keeps the last finite value.
    assert console.file.getvalue().splitlines() == ["update 2 step 256 return - kl 1.5e-05 clipfrac - ev - sps 950"]


def test_without_an_update_key_lines_count_the_writes():
    console = Console(file=io.StringIO(), width=80)
    sink = ConsoleSink(10_000, log_every=1, console=console)
    sink.write(100, {"perf/sps": 10.0})
    sink.write(200, {"perf/sps": 10.0})
    assert [line.split(" step")[0] for line in console.file.getvalue().splitlines()] == ["update 1", "update 2"]


def test_training_piped_prints_plain_lines_with_the_trainers_update_numbers(tmp_path):
    cfg = load_preset("gridworld")
    cfg.total_timesteps, cfg.log_every, cfg.tensorboard, cfg.run_dir = 8 * 32 * 4, 2, False, str(tmp_path / "run")
    console = Console(file=io.StringIO(), width=80)
    run = train(cfg, console=console)
    out = console.file.getvalue()
    lines = [line for line in out.splitlines() if line.startswith("update ")]
    assert [int(line.split()[1]) for line in lines] == [2, 4]
    assert all(LINE.match(line) for line in lines), lines
    assert lines[-1].startswith(f"update 4 step {run.global_step:,} return ")
    assert "r…" not in out and "\x1b[" not in out
