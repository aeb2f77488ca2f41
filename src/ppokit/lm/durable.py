"""How an LM run survives the ends it did not plan: a checkpoint into its run dir every ``save_every`` iterations
and at the end; Ctrl-C and SIGTERM (finish the iteration, save, stop; the CLI exits 130 / 143); a reward that raises
or returns what is not a score, or a prompt the model cannot take (the last finished iteration saved, then one
line naming it); and the run dir's claim and logging, so that a resume logs each iteration exactly once.

``LMRunLifecycle`` is a part of ``base.LMTrainer`` (a mixin over its attributes), as ``training.lifecycle`` is of the
Gymnasium trainer, and uses the same pieces: ``rundir.claim`` (lock, no mixing, stale temp files removed),
``rundir.trim_to_checkpoint`` and ``runtime.interrupts.install_sigint``.

Nothing is written into the run dir before the first iteration's metrics row (the claim creates the directory and
its lock only), so a run whose reward fails on the first rollout leaves a directory that a fixed rerun can use.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ppokit.lm.checks import PromptError
from ppokit.lm.rewards import RewardError
from ppokit.runtime.logger import SinkError

__all__ = ["CHECKPOINT", "LMRunLifecycle", "RUN_FAILURES"]

CHECKPOINT = "trainer_state.pt"  # the resumable state an LM run dir holds (beside the saved model)

RUN_META = "lm_run.json"
# What ends a run after saving the last finished iteration: the user's reward or prompts, named in one line.
RUN_FAILURES = (RewardError, PromptError)


class LMRunLifecycle:
    """``train`` (the loop with its saves and stops), the run dir's claim and logger, ``close``."""

    def train(self, iterations: int) -> list[dict[str, float]]:
        """``iterations`` calls of ``step``; the list of their metrics.

        With a run dir: a checkpoint (``save``) every ``save_every`` iterations and after the last one. Ctrl-C or
        SIGTERM finishes the iteration, saves and returns early (``self.interrupted`` names the signal; a second
        Ctrl-C raises KeyboardInterrupt, the last checkpoint intact). A failing reward or prompt raises its
        ``RewardError`` / ``PromptError`` after saving the last finished iteration, saying where; a metrics sink
        that cannot write (``SinkError``: a full disk under TensorBoard) ends the run the same way.
        """
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
            raise ValueError(f"train: iterations must be an integer >= 0, got {iterations!r}")
        self._claim_run_dir()
        self._planned = self.iteration + iterations
        if self._lr_horizon is None:  # the first train() call sets the LR schedule's length (checkpointed)
            self._lr_horizon = self._planned
        if getattr(self, "_sps_origin", None) is None:  # perf/sps counts from the first iteration this object runs
            self._sps_origin = (time.perf_counter(), self.completions)
        from ppokit.runtime.interrupts import install_sigint

        self._stop_requested, self._stop_signal, self.interrupted = False, None, None
        old_sigint = install_sigint(self, sigterm=True)
        out: list[dict[str, float]] = []
        try:
            for k in range(iterations):
                cursor = self._cursor()  # where the data and random streams stood before this iteration
                try:
                    out.append(self.step())
                except RUN_FAILURES as exc:
                    raise type(exc)(f"{exc}; {self._save_after_failure(exc, cursor)}") from exc
                except SinkError as exc:
                    # A metrics sink could not write (a full disk): the iteration itself finished (the sinks
                    # are written after it), so its state is whole and is saved before the one-line error.
                    raise SinkError(f"{exc}; {self._save_after_sink_failure()}") from None
                stopping = self._stop_requested = self.dist.any(self._stop_requested)
                final = stopping or k == iterations - 1
                if final or self.iteration % self.config.save_every == 0:
                    self._checkpoint(export=final)
                if stopping:
                    self.interrupted = signal.Signals(self._stop_signal or signal.SIGINT).name
                    self._log_interrupt()
                    break
        finally:
            if old_sigint is not None:
                signal.signal(signal.SIGINT, old_sigint)
            if getattr(self, "_old_sigterm", None) is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None
        return out

    @property
    def checkpoint_path(self) -> Path | None:
        """The run dir's resumable checkpoint (written by ``save``), None without a run dir."""
        return None if self.run_dir is None else self.run_dir / CHECKPOINT

    def _checkpoint(self, export: bool = True) -> None:
        """``save`` into the run dir; a sharded run's periodic saves (``export`` False) write the shards alone,
        its last one of a ``train`` call ``policy/`` too."""
        if self.run_dir is None or not (self.dist.is_main or self.sharded):  # sharded: every rank writes
            return
        self.save(self.run_dir, export=export)
        self._saved_iteration = self.iteration

    def _save_after_failure(self, exc: BaseException, cursor: dict[str, Any]) -> str:
        """Save the last finished iteration (its data position and random streams as ``cursor`` left them, so a
        resume after fixing the input continues as if nothing had failed); what happened, for the message."""
        path = self.checkpoint_path
        if path is None or not self.dist.is_main:
            note = "nothing was saved (no run dir)"
        elif self.sharded:  # a save gathers the shards from every rank, which a failure on one rank may not reach
            note = f"a sharded (fsdp) run keeps its last checkpoint in {path}"
        elif self._saved_iteration == self.iteration:
            note = f"the checkpoint of iteration {self.iteration} in {path} is up to date"
        elif self.iteration == 0:
            note = "no iteration had finished, so there is no checkpoint"
        else:
            try:
                self.save(self.run_dir, cursor=cursor)
                self._saved_iteration = self.iteration
                note = f"saved iteration {self.iteration} to {path}"
            except Exception as save_exc:  # noqa: BLE001 - the reward's failure is the one to report
                from ppokit.runtime.checkpoint import one_line

                note = f"could not save iteration {self.iteration} ({one_line(save_exc)}); the previous checkpoint stays"
        if self.logger is not None:  # on record for doctor/report
            try:
                self.logger.alert(self.completions, "alert", "input_error", f"{exc}; {note}")
            except Exception:  # noqa: BLE001 - the failure is the news, not a failed alert write
                pass
        return note

    def _save_after_sink_failure(self) -> str:
        """Save the finished iteration whose metrics a sink could not write; what happened, for the message."""
        path = self.checkpoint_path
        if path is None or not self.dist.is_main:
            return "nothing was saved (no run dir)"
        if self.sharded:  # the other ranks may not reach a save (see _save_after_failure)
            return f"a sharded (fsdp) run keeps its last checkpoint in {path}"
        try:
            self._checkpoint()
            return f"saved iteration {self.iteration} to {path}"
        except Exception as save_exc:  # noqa: BLE001 - the sink's failure is the one to report
            from ppokit.runtime.checkpoint import one_line

            return f"could not save iteration {self.iteration} ({one_line(save_exc)}); the previous checkpoint stays"

    def _log_interrupt(self) -> None:
        if self.logger is not None:
            self.logger.alert(self.completions, "warn", "interrupted",
                              f"{self.interrupted}: finished iteration {self.iteration}, saved a checkpoint and "
                              "stopped (a second Ctrl-C aborts without saving)")

    # ---------------------------------------------------------------- the run dir
    def _claim_run_dir(self) -> None:
        """Lock the run dir (rank 0 alone writes): a fresh run refuses one holding a run unless overwrite, a
        resumed one drops what was logged after its checkpoint; a killed write's temp files are removed."""
        if self.run_dir is None or not self.dist.is_main or self._claim is not None:
            return
        from ppokit.runtime.rundir import claim, trim_to_checkpoint

        resumed = self._resumed_at is not None
        self._claim = claim(self.run_dir, resume=resumed, overwrite=self.overwrite and not resumed)
        notes = list(self._claim.notes)
        if resumed:
            notes += trim_to_checkpoint(self.run_dir, self.iteration, self.completions)
        if self.config.console:
            for note in notes:
                print(f"note: {note}", file=sys.stderr)

    def _open_logger(self) -> None:
        if self.run_dir is None or self.logger is not None or not self.dist.is_main:
            return
        from ppokit.runtime.logger import MetricsLogger

        self._claim_run_dir()
        cfg = self.config
        meta = {"kind": "lm", "algo": self.algo, "config": cfg.to_dict(), **({"cli": self.run_info}
                                                                            if self.run_info else {})}
        (self.run_dir / RUN_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        planned = max(1, getattr(self, "_planned", self.iteration))
        sinks = []
        if cfg.track:  # the Gymnasium trainer's W&B sink (training.build.make_logger); rank 0 only, as above
            from ppokit.runtime.wandb_sink import WandbSink

            sinks.append(WandbSink(self.run_dir, cfg.to_dict(), cfg.wandb_project, cfg.wandb_entity))
        self.logger = MetricsLogger(self.run_dir, total_timesteps=planned * cfg.rollout_size,
                                    log_every=cfg.log_every, tensorboard=cfg.tensorboard, console=cfg.console,
                                    hparams=None if self._resumed_at is not None else cfg.to_dict(),
                                    resume_step=self._resumed_at, sinks=sinks)

    def close(self) -> None:
        """Flush and close the run dir's sinks and release its lock (idempotent)."""
        try:
            if self.logger is not None:
                self.logger.close()
                self.logger = None
        finally:
            if self._claim is not None:
                self._claim.release()
                self._claim = None
