"""``--track``: a metrics sink that logs every update to Weights & Biases (extra ``ppokit[wandb]``).

The sink has the interface of the logger's other sinks (``write(step, metrics)``, ``close()``): each update's
``metrics.csv`` row is one ``wandb.log`` call at the run's env step, NaN/Inf left out (a gap, as TensorBoard
shows it); each alert is marked in the history as ``alerts/<name>`` = 1 at its step; ``table`` logs rows
(an LM run's sample completions) as a ``wandb.Table``. The W&B run
lives in ``RUN_DIR/wandb`` (its name is the run dir's, its group too, so a resumed run's second W&B run sits
beside the first; its config is the run's ``PPOConfig``). ``WANDB_MODE=offline`` writes it there without a
network (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later), as W&B itself documents.

wandb is imported only when a run tracks; without it ``--track`` is refused with one line naming the extra.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ppokit.core.errors import ConfigError

__all__ = ["WandbSink", "require_wandb"]

_MISSING = "needs the wandb package, which is not installed: pip install 'ppokit[wandb]' (or: pip install wandb)"


def require_wandb() -> None:
    """ConfigError for field ``track`` when wandb cannot be imported (checked before anything is built)."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("track", _MISSING)


class WandbSink:
    """One W&B run for one ppokit run dir; ``write`` logs an update's metrics at its env step."""

    def __init__(self, run_dir: str | Path, config: dict[str, Any], project: str, entity: str | None = None):
        try:
            import wandb
        except ImportError:
            raise ConfigError("track", _MISSING) from None
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        name = self.run_dir.resolve().name
        try:
            # console="off": W&B would otherwise wrap stdout/stderr, under the live progress bar.
            self._run = wandb.init(project=project, entity=entity, dir=str(self.run_dir), name=name, group=name,
                                   config=config, settings=wandb.Settings(console="off", silent=True))
        except Exception as exc:  # noqa: BLE001 - not logged in, no network, a bad entity: one line, not a traceback
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError("track", f"wandb.init failed ({type(exc).__name__}: {first}); log in with "
                                       "`wandb login`, or set WANDB_MODE=offline to log without a network") from None
        # The env step is the x axis of every metric (W&B's own _step counts calls).
        self._run.define_metric("global_step")
        self._run.define_metric("*", step_metric="global_step")
        self._closed = False

    @property
    def dir(self) -> Path:
        """Where W&B writes this run's files (``RUN_DIR/wandb/<run>/files``)."""
        return Path(self._run.dir)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Log the finite metrics of one update at env step ``step``."""
        row = {"global_step": int(step)}
        for key, value in metrics.items():
            value = float(value.item() if hasattr(value, "item") else value)
            if math.isfinite(value):
                row[key] = value
        self._run.log(row)

    def table(self, step: int, key: str, rows: list[dict[str, Any]]) -> None:
        """Log ``rows`` as one ``wandb.Table`` under ``key`` at env step ``step`` (the columns: every row's keys, in
        the order they first appear; a row without a column gets None there)."""
        import wandb

        columns = list(dict.fromkeys(k for r in rows for k in r))
        self._run.log({"global_step": int(step),
                       key: wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])})

    def alert(self, step: int, level: str, name: str) -> None:
        """Mark an alert in the history (``alerts/<name>`` = 1 at its step)."""
        self._run.log({"global_step": int(step), f"alerts/{name}": 1.0})

    def close(self) -> None:
        """Finish the W&B run (idempotent); offline, this writes the last records to ``RUN_DIR/wandb``."""
        if not self._closed:
            self._closed = True
            self._run.finish()
