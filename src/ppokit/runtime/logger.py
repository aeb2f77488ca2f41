"""Metric sinks for training: CSV, TensorBoard and a rich console, plus a fan-out logger with alerts.

Metrics are flat ``str -> float`` dicts with namespaced keys (``charts/episodic_return``,
``losses/policy_loss``, ``diag/approx_kl``, ``perf/sps``...). NaN is a legitimate value meaning "nothing
to report this update" (e.g. no episode finished), so every sink treats it as a gap rather than a number.
"""

from __future__ import annotations

import csv
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from ppokit.core import schema as S

__all__ = ["CSVSink", "TensorBoardSink", "ConsoleSink", "MetricsLogger", "SinkError"]

# Each console column shows the schema's key (schema.py) and accepts a few other spellings (CleanRL's, SB3's), so
# metrics from another trainer still display.
# A language-model run's return is its completions' mean score (reward at the end of the response).
_RETURN_KEYS = (S.EPISODIC_RETURN, S.SCORE_MEAN, "charts/mean_return", "charts/return")
_SPS_KEYS = (S.SPS, "charts/SPS", "charts/sps")
_KL_KEYS = (S.APPROX_KL, "losses/approx_kl")
_CLIPFRAC_KEYS = (S.CLIPFRAC, "losses/clipfrac")
_EV_KEYS = (S.EXPLAINED_VARIANCE, "losses/explained_variance")
_TABLE_COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("return", _RETURN_KEYS),
    ("length", (S.EPISODIC_LENGTH, "charts/mean_length", "charts/length")),
    ("policy loss", (S.POLICY_LOSS, "losses/pg_loss")),
    ("value loss", (S.VALUE_LOSS, "losses/vf_loss")),
    ("entropy", ("losses/entropy", S.ENTROPY)),
    ("approx KL", _KL_KEYS),
    ("KL ref", (S.KL_REF,)),
    ("resp len", (S.RESPONSE_LENGTH,)),
    ("clipfrac", _CLIPFRAC_KEYS),
    ("expl. var", _EV_KEYS),
    ("lr", (S.LEARNING_RATE, "charts/lr", "optim/lr", "diag/lr")),
    ("epochs", (S.EPOCHS_RUN, "diag/epochs", "perf/epochs_run")),
    ("SPS", _SPS_KEYS),
)
# The plain line's fields: label, accepted keys, format (2 significant digits for the diagnostics, whose third
# digit is noise from one update to the next).
_LINE_FIELDS: tuple[tuple[str, tuple[str, ...], Any], ...] = (
    ("return", _RETURN_KEYS, lambda v: f"{v:.1f}"),
    ("kl", _KL_KEYS, lambda v: f"{v:.2g}"),
    ("clipfrac", _CLIPFRAC_KEYS, lambda v: f"{v:.2g}"),
    ("ev", _EV_KEYS, lambda v: f"{v:.2g}"),
    ("sps", _SPS_KEYS, lambda v: f"{v:,.0f}"),
)
# LM runs' fields (ppokit.lm), printed only when the run logs them: KL to pi_ref per sequence and the mean
# completion length beside the score (shown as "return"), so a reward hack (score up, KL and length running off)
# shows on the console.
_LM_LINE_FIELDS: tuple[tuple[str, tuple[str, ...], Any], ...] = (
    ("kl_ref", (S.KL_REF,), lambda v: f"{v:.3g}"),
    ("len", (S.RESPONSE_LENGTH,), lambda v: f"{v:.1f}"),
)
# "warn" and "alert" are the guard-rail monitor's two levels; the logging-style names are accepted too.
_LEVEL_STYLES = {
    "debug": "dim",
    "info": "cyan",
    "warn": "yellow",
    "warning": "yellow",
    "alert": "bold red",
    "error": "bold red",
    "critical": "bold white on red",
}
_SEVERE_LEVELS = ("alert", "error", "critical")
# The scalars TensorBoard's HPARAMS tab shows beside each run's hyperparameters.
_HPARAM_METRICS = ("charts/episodic_return", "diag/approx_kl", "diag/clipfrac", "diag/explained_variance")


def _as_float(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def _is_finite(value: Any) -> bool:
    try:
        return math.isfinite(_as_float(value))
    except (TypeError, ValueError):
        return False


def _fmt(value: float) -> str:
    """Compact human formatting: thousands separators for big numbers, 3 significant digits otherwise."""
    if not math.isfinite(value):
        return "–"
    if value != 0 and float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.3g}"


def _first(values: dict[str, float], keys: Iterable[str]) -> float | None:
    for key in keys:
        if key in values:
            return values[key]
    return None


def _json_safe(obj: Any) -> Any:
    """Turn alert payloads into strict JSON: tensors/arrays to lists, non-finite floats to strings."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if hasattr(obj, "tolist"):  # torch tensors, numpy arrays and numpy scalars
        return _json_safe(obj.tolist())
    return str(obj)


class CSVSink:
    """Append-only CSV of metrics: ``global_step`` then the metric keys, one flushed row per update."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns: list[str] | None = None
        self._extendable = False
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, newline="", encoding="utf-8") as f:
                header = next(csv.reader(f), None)
            if not header or header[0] != "global_step":
                raise ValueError(f"{self.path} exists but is not a ppokit metrics CSV (first column is not global_step)")
            self.columns = header
            # A resumed run written by an older ppokit may lack columns added since: its first row may extend it.
            self._extendable = True
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                # A crash mid-row leaves no trailing newline; start the resumed rows on a fresh line.
                needs_newline = f.read(1) not in (b"\n", b"\r")
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        if needs_newline:
            self._file.write("\n")
        self._writer = csv.writer(self._file)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Append one row; NaN becomes an empty cell, a key outside the fixed header raises ValueError."""
        if "global_step" in metrics:
            raise ValueError("'global_step' is reserved for the step column; pass it as `step`")
        if self.columns is None:
            self.columns = ["global_step", *metrics]
            self._writer.writerow(self.columns)
        else:
            known = set(self.columns)
            unknown = [k for k in metrics if k not in known]
            if unknown and self._extendable:
                self._extend_header(unknown)
            elif unknown:
                raise ValueError(
                    f"metric key(s) {unknown} are not in the CSV header of {self.path}; "
                    "the key set is fixed at the first row"
                )
        self._extendable = False
        row = [str(int(step))]
        for key in self.columns[1:]:
            row.append(self._cell(metrics.get(key, math.nan)))
        self._writer.writerow(row)
        self._file.flush()

    def _extend_header(self, new_columns: list[str]) -> None:
        """Append columns to an existing file's header (old rows get empty cells), atomically: temp + rename."""
        self._file.close()
        with open(self.path, newline="", encoding="utf-8") as f:
            rows = [row for row in csv.reader(f) if row][1:]
        self.columns = [*self.columns, *new_columns]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(self.columns)
            writer.writerows(row + [""] * (len(self.columns) - len(row)) for row in rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)

    @staticmethod
    def _cell(value: Any) -> str:
        if isinstance(value, bool):
            return str(int(value))
        if isinstance(value, int):
            return str(value)
        f = _as_float(value)
        return "" if math.isnan(f) else repr(f)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> CSVSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SinkError(Exception):
    """A metrics sink could not write its files (a full disk, a removed directory); the message is one line
    naming the sink, its path and the reason."""


# TensorBoard's event-file writer thread (tensorboard.summary.writer.event_file_writer._AsyncWriterThread) stores
# a failed write and re-raises it, so threading.excepthook prints its ~18-line traceback; TensorBoard raises the
# same error again in the writing thread at the next write or flush (_AsyncWriter._check_worker_status), where the
# sink turns it into one line. So the hook stays quiet for those threads only and passes on every other thread's.
_TB_WRITER_MODULE = "tensorboard.summary.writer.event_file_writer"


def _quiet_tensorboard_writer_threads() -> None:
    previous = threading.excepthook
    if getattr(previous, "ppokit_quiet_tensorboard", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__module__ != _TB_WRITER_MODULE:
            previous(args)

    hook.ppokit_quiet_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class TensorBoardSink:
    """Scalars and text to TensorBoard event files under ``log_dir``. Any failure to write them (here or in
    TensorBoard's writer thread) raises :class:`SinkError` and closes the sink."""

    def __init__(self, log_dir: str | os.PathLike, flush_secs: int = 10, purge_step: int | None = None):
        """``purge_step``: a resumed run's first new step; TensorBoard then hides the events at and after it that
        the killed run wrote past its checkpoint, so no step is shown twice."""
        # Imported here so runs without TensorBoard do not pay for loading it.
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_writer_threads()
        self.log_dir = Path(log_dir)
        self._closed = True  # until the writer exists
        self._writer = self._guard(lambda: SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs,
                                                         purge_step=purge_step))
        self._closed = False

    def _guard(self, action: Any) -> Any:
        """``action()``, or SinkError naming the event files and the reason (the sink is then closed)."""
        from ppokit.runtime.checkpoint import describe_write_error

        try:
            return action()
        except Exception as exc:  # noqa: BLE001 - TensorBoard re-raises whatever its writer thread met
            self._abort()
            raise SinkError(f"TensorBoard could not write its event file in {self.log_dir}: "
                            f"{describe_write_error(exc)}") from None

    def _abort(self) -> None:
        """Close after a failure, quietly: the failure is what gets reported."""
        if not self._closed:
            self._closed = True
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - the same full disk, again
                pass

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Add one scalar per finite metric; NaN/Inf are skipped so plots show gaps, not spikes."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event holding every scalar of the update: building a summary per add_scalar call cost ~75 us a
        # metric (about 3 ms an update for 40 metrics, a fifth of a small CartPole run). Readers see the same tags.
        values = [Summary.Value(tag=key, simple_value=_as_float(value))
                  for key, value in metrics.items() if _is_finite(value)]
        if values:
            self._guard(lambda: self._writer.file_writer.add_summary(Summary(value=values), int(step)))

    def text(self, step: int, tag: str, text: str) -> None:
        """Add a markdown text entry under ``tag``."""
        self._guard(lambda: self._writer.add_text(tag, text, global_step=int(step)))

    def hparams(self, step: int, config: dict[str, Any], metrics: Iterable[str] = ()) -> None:
        """The run's hyperparameters, twice: a markdown table under the text tag ``hparams`` (readable in the
        TEXT tab) and the HPARAMS tab's session record, which compares runs against ``metrics`` (scalar tags)."""
        from torch.utils.tensorboard.summary import hparams

        rows = "".join(f"| {k} | {str(v).replace('|', '&#124;')} |\n" for k, v in config.items())
        self.text(step, "hparams", "| field | value |\n|---|---|\n" + rows)
        # The plugin takes numbers, strings and bools; lists and None are shown as text.
        plain = {k: v if type(v) in (int, float, str, bool) else str(v) for k, v in config.items()}
        # Written into this run's own event file (add_hparams would start a separate run dir for them).
        experiment, session_start, _ = hparams(plain, dict.fromkeys(metrics, 0.0))
        for summary in (experiment, session_start):
            self._guard(lambda s=summary: self._writer.file_writer.add_summary(s, int(step)))

    def flush(self) -> None:
        """Force pending events to disk."""
        self._guard(self._writer.flush)

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if not self._closed:
            # A flush first: it re-raises a failed background write, which SummaryWriter.close would not report.
            self.flush()
            self._closed = True
            self._guard(self._writer.close)


class ConsoleSink:
    """Rich console output: on a wide terminal a live progress bar and a metrics table every ``log_every`` updates;
    piped output or a terminal narrower than ``WIDE_COLUMNS`` gets one plain line per logged update instead
    (``update 380 step 97,280 return 500.0 kl 0.00045 clipfrac 0.02 ev 0.72 sps 6,068``), which a table of eleven
    columns would collapse into ``r… l… policy …``."""

    WIDE_COLUMNS = 100  # the eleven-column table needs about this many columns
    # ``ppokit train --progress`` sets it: a bar on a terminal of any width (a compact one below WIDE_COLUMNS: bar,
    # percent, ETA) and an ETA at the end of every plain line.
    PROGRESS = False

    def __init__(self, total_timesteps: int, log_every: int = 10, console: Console | None = None, enabled: bool = True):
        if int(total_timesteps) <= 0:
            raise ValueError(f"total_timesteps must be positive, got {total_timesteps}")
        if int(log_every) < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.total_timesteps = int(total_timesteps)
        self.log_every = int(log_every)
        self.enabled = bool(enabled)
        injected = console is not None
        self.console = console if injected else Console()
        self._latest: dict[str, float] = {}  # last finite value of each key, so a NaN update keeps the old number
        self._step = 0
        self._updates = 0
        self._update_number = 0  # the trainer's update index when it logs one (a resumed run does not start at 1)
        self._last_line_update = 0
        self._closed = False
        self._progress = None
        self._task = None
        terminal = self.console.is_terminal and not self.console.is_dumb_terminal
        self.plain = not (terminal and self.console.width >= self.WIDE_COLUMNS)
        self._started: tuple[float, int] | None = None  # (time, step) of the first update this process logged
        if self.enabled and (not self.plain or (self.PROGRESS and terminal)):
            # Imported here: piped runs (CI, scripts, tests) never draw a bar.
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            columns = ((TextColumn("{task.description}"), BarColumn(bar_width=None), TaskProgressColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
                       if not self.plain else  # what fits 40 columns: the bar takes what is left
                       (BarColumn(bar_width=None), TaskProgressColumn(), TextColumn("eta"), TimeRemainingColumn()))
            self._progress = Progress(
                *columns,
                console=self.console,
                # Redirecting sys.stdout only makes sense for the real terminal, never an injected console.
                redirect_stdout=not injected,
                redirect_stderr=not injected,
                refresh_per_second=4,
            )
            self._task = self._progress.add_task(self._description(), total=self.total_timesteps)
            self._progress.start()

    @property
    def live(self) -> bool:
        """True when a live progress bar is being drawn."""
        return self._progress is not None

    def _description(self) -> str:
        parts = []
        ret = _first(self._latest, _RETURN_KEYS)
        if ret is not None:
            shown = f"{ret:.1f}" if abs(ret) >= 100 else f"{ret:.3g}"
            parts.append(f"return [bold]{shown}[/]")
        else:
            parts.append("return –")
        sps = _first(self._latest, _SPS_KEYS)
        if sps is not None:
            parts.append(f"SPS {sps:,.0f}")
        kl = _first(self._latest, _KL_KEYS)
        if kl is not None:
            parts.append(f"KL {kl:.3g}")
        for label, keys, fmt in _LM_LINE_FIELDS:
            value = _first(self._latest, keys)
            if value is not None:
                parts.append(f"{label} {fmt(value)}")
        return " | ".join(parts)

    def update_line(self) -> str:
        """The plain one-line summary of the latest update, one field per key metric, e.g.
        ``update 380 step 97,280 return 500.0 kl 0.00045 clipfrac 0.02 ev 0.72 sps 6,068``; ``-`` where a metric
        has had no finite value yet (no episode finished, say)."""
        parts = [f"update {self._update_number:,}", f"step {self._step:,}"]
        for label, keys, fmt in _LINE_FIELDS:
            value = _first(self._latest, keys)
            parts.append(f"{label} {'-' if value is None else fmt(value)}")
        for label, keys, fmt in _LM_LINE_FIELDS:
            value = _first(self._latest, keys)
            if value is not None:
                parts.append(f"{label} {fmt(value)}")
        if self.PROGRESS:
            parts.append(f"eta {self.eta()}")
        return " ".join(parts)

    def eta(self) -> str:
        """The time left at this process's rate so far (``1h02m``, ``3m05s``, ``42s``; ``-`` before a rate)."""
        if self._started is None:
            return "-"
        seconds, step = time.perf_counter() - self._started[0], self._step - self._started[1]
        if step <= 0 or seconds <= 0:
            return "-"
        left = int(round(max(0, self.total_timesteps - self._step) * seconds / step))
        hours, rest = divmod(left, 3600)
        return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest}s"

    def table(self, step: int):
        """A one-row table of the key metrics seen so far."""
        from rich.table import Table

        table = Table(title=f"update {self._update_number:,} · step {step:,}", title_justify="left", expand=False)
        values = []
        for label, keys in _TABLE_COLUMNS:
            value = _first(self._latest, keys)
            if value is not None:
                table.add_column(label, justify="right", no_wrap=True)
                values.append(_fmt(value))
        if values:
            table.add_row(*values)
        return table

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Advance the bar to ``step``; every ``log_every`` updates print a table (wide terminal) or a plain line."""
        if not self.enabled or self._closed:
            return
        for key, value in metrics.items():
            if _is_finite(value):
                self._latest[key] = _as_float(value)
        if self._started is None:  # the rate counts from the first update (a resume starts far from 0)
            self._started = (time.perf_counter(), int(step))
        self._step = int(step)
        self._updates += 1
        update = metrics.get("update")
        self._update_number = int(_as_float(update)) if _is_finite(update) else self._update_number + 1
        if self._progress is not None and self._updates == 1:
            # A resumed run starts far from 0; without a reset that jump would count as speed and wreck the ETA.
            self._progress.reset(self._task, completed=min(self._step, self.total_timesteps))
        if self._progress is not None:
            # refresh=True so anything printed above the bar right after this sees the new state, not a stale one.
            self._progress.update(
                self._task,
                completed=min(self._step, self.total_timesteps),
                description=self._description(),
                refresh=True,
            )
        if self._updates % self.log_every == 0:
            if self.plain:
                self._print_line()
            else:
                self.console.print(self.table(self._step))

    def _print_line(self) -> None:
        # soft_wrap: a long line wraps at the terminal's edge rather than being cut or re-flowed by rich.
        self.console.print(self.update_line(), markup=False, highlight=False, soft_wrap=True)
        self._last_line_update = self._updates

    def alert(self, step: int, level: str, name: str, message: str) -> None:
        """Print a coloured alert line (above the bar when one is live)."""
        if not self.enabled:
            return
        level = str(level).lower()
        style = _LEVEL_STYLES.get(level, "magenta")
        self.console.print(
            f"[{style}]{escape(level.upper())}[/] step {int(step):,} [bold]{escape(str(name))}[/]: {escape(str(message))}",
            highlight=False,
            soft_wrap=True,
        )

    def print(self, renderable: Any) -> None:
        """Print any rich renderable through this sink's console (no-op when disabled)."""
        if self.enabled:
            self.console.print(renderable)

    def close(self) -> None:
        """Stop the bar; in plain mode, print the last update's line if it was not printed yet (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.update(self._task, description=self._description())
            self._progress.stop()
        elif self.enabled and self._updates > self._last_line_update:
            self._print_line()


class MetricsLogger:
    """Fan-out of metrics to CSV, TensorBoard and the console, plus a persistent alert log."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        total_timesteps: int,
        log_every: int = 10,
        tensorboard: bool = True,
        console: bool = True,
        console_obj: Console | None = None,
        hparams: dict[str, Any] | None = None,
        resume_step: int | None = None,
        sinks: Iterable[Any] = (),
    ):
        """``hparams``: the config, written to TensorBoard once (pass it for a fresh run, not for a resume).
        ``resume_step``: the checkpoint's step when resuming; TensorBoard hides what was logged after it.
        ``sinks``: more sinks (``write(step, metrics)``, ``close()``, optionally ``alert(step, level, name)``),
        e.g. ``wandb_sink.WandbSink``; they are closed with the logger."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.alerts_path = self.run_dir / "alerts.jsonl"
        self.alerts: list[dict[str, Any]] = []
        self.start_time = time.time()
        self._closed = False
        self.csv = CSVSink(self.run_dir / "metrics.csv")
        self.tb: TensorBoardSink | None = None
        self.sinks = list(sinks)
        try:
            if tensorboard:
                self.tb = TensorBoardSink(self.run_dir / "tb",
                                          purge_step=None if resume_step is None else int(resume_step) + 1)
                if hparams is not None:
                    self.tb.hparams(resume_step or 0, hparams, _HPARAM_METRICS)
            self.console = ConsoleSink(total_timesteps, log_every=log_every, console=console_obj, enabled=console)
        except BaseException:
            self.csv.close()
            if self.tb is not None:
                self.tb.close()
            for sink in self.sinks:
                sink.close()
            raise

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Send one update's metrics to every sink."""
        self.csv.write(step, metrics)
        self._to_tensorboard(lambda tb: tb.write(step, metrics))
        for sink in self.sinks:
            sink.write(step, metrics)
        self.console.write(step, metrics)

    def table(self, step: int, tag: str, rows: list[dict[str, Any]]) -> None:
        """Rows of text and numbers (e.g. sample completions) to the sinks that keep tables (``table(step, tag,
        rows)``: W&B); the CSV, TensorBoard and the console have no tables and are left alone."""
        for sink in self.sinks:
            if hasattr(sink, "table"):
                sink.table(step, tag, rows)

    def alert(self, step: int, level: str, name: str, message: str, data: Any = None) -> dict[str, Any]:
        """Record an alert in alerts.jsonl, TensorBoard text ``alerts/<name>``, the console and ``self.alerts``."""
        record = {
            "step": int(step),
            "level": str(level).lower(),
            "name": str(name),
            "message": str(message),
            "data": _json_safe(data),
            "time": time.time(),
        }
        # Opened per alert: alerts are rare and each one should be on disk even if the run dies right after.
        with open(self.alerts_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        self.alerts.append(record)
        if self.tb is not None:
            text = f"**{record['level']}** (step {record['step']:,}): {record['message']}"
            if record["data"] is not None:
                text += f"\n\n```\n{json.dumps(record['data'], indent=2)}\n```"
            self._to_tensorboard(lambda tb: tb.text(step, f"alerts/{name}", text))
        for sink in self.sinks:
            if hasattr(sink, "alert"):
                sink.alert(step, record["level"], record["name"])
        self.console.alert(step, level, name, message)
        return record

    def _to_tensorboard(self, write: Any) -> None:
        """``write(self.tb)``; a SinkError (the sink closed itself) leaves the run without TensorBoard."""
        if self.tb is None:
            return
        try:
            write(self.tb)
        except SinkError:
            self.tb = None
            raise

    def alerts_overview(self) -> str:
        """One-line count of alerts by level and name, e.g. ``3 (2 warning, 1 error): kl_spike x2, nan_loss``."""
        if not self.alerts:
            return "none"
        by_level: dict[str, int] = {}
        by_name: dict[str, int] = {}
        for a in self.alerts:
            by_level[a["level"]] = by_level.get(a["level"], 0) + 1
            by_name[a["name"]] = by_name.get(a["name"], 0) + 1
        levels = ", ".join(f"{n} {lvl}" for lvl, n in by_level.items())
        names = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in by_name.items())
        return f"{len(self.alerts)} ({levels}): {names}"

    def summary(self, lines: dict[str, str], title: str = "run summary") -> None:
        """Print an end-of-run panel of ``lines``; adds wall time and alerts when the caller did not."""
        # The panel goes below a finished bar, never under a live one that would redraw over it.
        self.console.close()
        rows = dict(lines)
        rows.setdefault("wall time", f"{time.time() - self.start_time:,.1f} s")
        rows.setdefault("alerts", self.alerts_overview())
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        # fold, not rich's default ellipsis: on an 80-column terminal a long run dir is wrapped, never cut to "…".
        grid.add_column(overflow="fold")
        for key, value in rows.items():
            grid.add_row(escape(str(key)), escape(str(value)))
        style = "red" if any(a["level"] in _SEVERE_LEVELS for a in self.alerts) else (
            "yellow" if self.alerts else "green"
        )
        self.console.print(Panel(grid, title=escape(title), border_style=style, expand=False))

    def close(self) -> None:
        """Stop the console bar and close the CSV and TensorBoard files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.console.close()
        finally:
            try:
                self.csv.close()
            finally:
                try:
                    if self.tb is not None:
                        self.tb.close()
                finally:
                    for sink in self.sinks:
                        sink.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
