"""How a training run ends: the summary and curves of a finished run, an env failure (the learner state saved
first), Ctrl-C and SIGTERM (a flag the loop reads), and the cleanup after an exception in the loop.

``TrainerLifecycle`` is a part of ``trainer.Trainer`` (a mixin: the methods read the trainer's state); the loop
itself stays in ``trainer.py``, readable top to bottom as Algorithm 1 of Schulman et al. 2017.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ppokit.core import schema as S
from ppokit.core.schema import PERF_PHASES
from ppokit.envs.errors import EnvError, env_failure
from ppokit.envs.watchdog import EnvTimeout, close_vector_env
from ppokit.training.state import CHECKPOINT_NAME

__all__ = ["TrainerLifecycle"]


class TrainerLifecycle:
    """The end of a run: ``_finish`` (a finished or stopped run), ``_env_failed`` (an env error), ``_abandon``
    (any other exception), ``_note_interrupt`` (the Ctrl-C alert)."""

    def _rollout_failed(self, step: int, rollout_start: int, exc: BaseException | None = None,
                        detail: str | None = None) -> EnvError:
        """The collector's ``fail``: an env failure at ``step`` of the rollout that began at ``rollout_start``."""
        self.global_step = step
        return self._env_failed("step()", rollout_start, exc, detail)

    def _env_failed(self, phase: str, rollout_start: int, exc: BaseException | None = None,
                    detail: str | None = None, unsaved: bool | None = None, envs: Any = None) -> EnvError:
        """The EnvError that ends the run, after saving the learner state the last checkpoint lacks.

        The learner (policy, optimizer, normalizers, counters) is as the last update left it; the env is not
        trusted, so its state is left out (a resume starts fresh episodes) and the step count is the one at the
        start of the failed rollout, so the checkpoint's update and step agree. If that save fails for any
        reason, the previous checkpoint stays as it is.
        """
        cfg = self.config
        error = env_failure(cfg.env_id, phase, self.global_step, exc, self.envs if envs is None else envs, detail)
        if unsaved is None:  # after an update, step 5 of the loop saved it when update % save_every == 0
            unsaved = self.update_idx > 0 and self.update_idx % cfg.save_every != 0
        path = self.run_dir / CHECKPOINT_NAME
        if unsaved and self.dist.is_main:
            failed_step = self.global_step
            self.global_step = rollout_start  # the step count this learner state belongs to
            try:
                # The env's state is left out: a resume starts fresh episodes.
                self.save({**self.state(), "env_state": None})
                note = f"saved the learner state of update {self.update_idx} to {path}"
            except Exception as save_exc:  # noqa: BLE001 - the env error is the one to report
                note = f"could not save the learner state ({type(save_exc).__name__}); the previous checkpoint stays"
            finally:
                self.global_step = failed_step
        elif self.update_idx == 0:
            note = "no update had finished, so there is no checkpoint"
        elif path.exists():
            note = f"the checkpoint of update {self.update_idx} in {path} is up to date"
        else:
            note = "no checkpoint could be written"
        interrupted, error = error.interrupted, EnvError(f"{error}; {note}")
        error.interrupted = interrupted
        # On record for doctor/report; closing the logger and envs is left to run()'s exception path.
        try:
            self.logger.alert(self.global_step, "alert", "env_error", str(error))
        except Exception:  # noqa: BLE001 - the env error is the news, not a failed alert write
            pass
        return error

    def _sink_failed(self, exc: BaseException) -> BaseException:
        """The error that ends the run when a metrics sink (TensorBoard) could not write, after saving the
        learner state: the failure comes after an update, whose state is whole (as at step 5 of the loop)."""
        path = self.run_dir / CHECKPOINT_NAME
        if not self.dist.is_main:
            note = "rank 0 keeps the checkpoint"
        elif self.update_idx == 0:
            note = "no update had finished, so there is no checkpoint"
        else:
            try:
                self.save()
                note = (f"saved the checkpoint of update {self.update_idx} to {path}; once the disk has room, "
                        f"continue with ppokit train --resume {self.run_dir}")
            except Exception as save_exc:  # noqa: BLE001 - the sink's error is the news
                note = f"could not save the learner state ({type(save_exc).__name__}); the previous checkpoint stays"
        return type(exc)(f"{exc}; {note}")

    def _finish(self, wall: float, start_step: int) -> None:
        last = self.metrics[-10:]
        returns = [m[S.EPISODIC_RETURN] for m in last if not math.isnan(m[S.EPISODIC_RETURN])]
        lines = {
            "run dir": str(self.run_dir),
            "env steps": f"{self.global_step:,}",
            "final return (last 10 updates)": f"{np.mean(returns):.2f}" if returns else "no episode finished",
            "wall time": f"{wall:.1f} s",
            "SPS": f"{(self.global_step - start_step) / max(wall, 1e-9):,.0f}",
            "time split": ", ".join(f"{p} {self.perf[p]:.1f}s" for p in PERF_PHASES),
            "alerts": self.logger.alerts_overview(),
        }
        if self.dist.active:
            lines["ranks"] = (f"{self.dist.world_size} data-parallel ranks x {self.config.num_envs} envs (env steps "
                              "and SPS count every rank; time split: rank 0's)")
        if self.config.unsafe:
            lines["UNSAFE"] = "this run broke the trust-region guard rails (--unsafe)"
        if self._stop_requested:
            lines["stopped"] = f"interrupted; resume with: ppokit train --resume {self.run_dir}"
        if self._callback_stop is not None:
            lines["stopped"] = f"by callback {self._callback_stop} after update {self.update_idx}"
        if self._solved:
            lines["solved"] = (f"evaluation return {self.metrics[-1][S.EVAL_RETURN]:.1f} >= "
                               f"{self.config.eval_threshold} at update {self.update_idx}; stopped early")
        try:
            if self.metrics and self.dist.is_main:
                from ppokit.diagnostics.plots import plot_curves

                # Titled by plots.run_title: env id, algo, seed and run dir name ("UNSAFE run:" first if unsafe).
                plot_curves(self.run_dir / "metrics.csv", self.run_dir / "curves.png", alerts=self.logger.alerts)
        finally:
            try:
                self.logger.summary(lines)
                self.logger.close()
                self._close_envs()
            finally:
                self.watchdog.stop()
                self._claim.release()

    def _close_envs(self) -> None:
        """Close the training and evaluation envs, bounded by the watchdog (a hung async env's workers are
        killed, not waited on); an env whose close() raises or hangs costs one warning line, not the run. Rollout
        workers (``--actors``) are stopped first."""
        close_source = getattr(self.collector, "close", None)
        if close_source is not None:
            close_source()
        with self.watchdog.running():
            for envs in (self.envs, self._eval_envs):
                if envs is None:
                    continue
                try:
                    close_vector_env(envs, self.watchdog)
                except (Exception, EnvTimeout) as exc:  # noqa: BLE001 - the run's files are written
                    import sys

                    print(f"warning: {env_failure(self.config.env_id, 'close()', self.global_step, exc)}",
                          file=sys.stderr)

    def _note_interrupt(self) -> None:
        """Log the Ctrl-C alert once. Here, in the loop, never in the signal handler: the interrupted code may hold
        a sink's lock (TensorBoard's writer), and an alert written from the handler would wait on it forever."""
        if self._interrupt_noted:
            return
        self._interrupt_noted = True
        self.logger.alert(self.global_step, "warn", "interrupted",
                          f"Ctrl-C: finished update {self.update_idx}, saving a checkpoint and exiting "
                          "(press again to abort without saving)")

    def _abandon(self) -> None:
        """After an exception in the loop: flush what was logged, close the envs, release the run dir's lock."""
        try:
            try:
                self.logger.close()
            finally:
                self._close_envs()
        except Exception:
            pass  # the exception in flight is the one to report
        finally:
            self.watchdog.stop()
            self._claim.release()
