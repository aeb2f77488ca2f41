"""The checkpoint state of a ``trainer.Trainer``: what a checkpoint holds (policy and optimizer, normalizers, RNG,
counters, the collector's loop state, the env's own state where it can be captured) and how a resume restores it.

``TrainerCheckpoint`` is a part of ``Trainer`` (a mixin over its attributes); the file format, atomic writes and
safe loading are ``checkpoint.py``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ppokit.policies import spec_type
from ppokit.runtime import checkpoint as ckpt

__all__ = ["TrainerCheckpoint", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = ckpt.CHECKPOINT_NAME


class TrainerCheckpoint:
    """``state()`` -> a checkpoint-safe dict, ``save()`` writes it, ``_load_state()`` restores one."""

    def state(self) -> dict[str, Any]:
        """The full train state in checkpoint-safe types."""
        from ppokit.envs.state import capture_env_state
        from ppokit.training.agent import spaces_record

        return {
            "config": self.config.to_dict(),
            "policy_spec": self.policy.spec(),
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "obs_norm": self.obs_norm.state_dict() if self.obs_norm is not None else None,
            "reward_scaler": self.reward_scaler.state_dict() if self.reward_scaler is not None else None,
            "rng": ckpt.rng_state(),
            "global_step": self.global_step,
            "update": self.update_idx,
            "kl_beta": self.kl_beta,
            "monitor": self.monitor.state_dict(),  # the live alerts' cooldowns and windows continue too
            "perf": dict(self.perf),
            "loop": self.collector.loop_state(),  # next_obs_raw, ep_return, ep_length, prev_done
            "env_state": capture_env_state(self.envs),
            # A custom env (factory or instance) cannot be rebuilt from its record: resume and eval need it again.
            "custom_env": self.custom_env.record() if self.custom_env is not None else None,
            # What the policy was built for, so that evaluating it elsewhere can name both sides of a mismatch
            # and acting needs no env to find its bounds.
            "spaces": spaces_record(self.envs.single_observation_space, self.envs.single_action_space),
        }

    def save_best(self, eval_return: float) -> bool:
        """Write the full train state to ``best.pt`` when ``eval_return`` beats every earlier evaluation of the run
        (a resumed run continues from the best that ``best.pt`` records); True when it wrote."""
        import math

        from ppokit.runtime.rundir import BEST_NAME

        path = self.run_dir / BEST_NAME
        best = getattr(self, "_best_eval", None)
        if best is None:
            best = -math.inf
            if path.is_file():
                try:
                    best = float(ckpt.load_checkpoint(path).get("best_eval_return", -math.inf))
                except ckpt.CheckpointError:
                    pass  # a damaged best.pt is replaced by the next evaluation
        if not (math.isfinite(eval_return) and eval_return > best):
            self._best_eval = best
            return False
        ckpt.save_checkpoint(path, {**self.state(), "best_eval_return": float(eval_return)},
                             finite=ckpt.LEARNER_KEYS, bounded=ckpt.BOUNDED_KEYS)
        self._best_eval = float(eval_return)
        return True

    def save(self, state: dict[str, Any] | None = None) -> Path:
        """Write ``state`` (default: the full train state) atomically into the run dir; a failed write raises
        CheckpointError and keeps the old file."""
        path = self.run_dir / CHECKPOINT_NAME
        # NaN/Inf is refused in the learner only: env buffers may hold what the env emitted (those steps are
        # skipped in training), and refusing them would lose the run at its next save.
        ckpt.save_checkpoint(path, self.state() if state is None else state, finite=ckpt.LEARNER_KEYS,
                             bounded=ckpt.BOUNDED_KEYS)
        self.callbacks.on_checkpoint(path)
        return path

    def _load_state(self, state: dict[str, Any]) -> None:
        from ppokit.envs.state import restore_env_state
        from ppokit.training.agent import check_stored_spaces, describe_policy_spec

        path = self.run_dir / CHECKPOINT_NAME
        if "policy_spec" not in state:
            raise ckpt.CheckpointError(f"{path} cannot be resumed: it has no 'policy_spec' entry")
        # The counters the schedule, the learning-rate annealing and the logs continue from.
        ckpt.check_counters(state, self.config.batch_size, path)
        saved_spec, spec = state["policy_spec"], self.policy.spec()
        if isinstance(saved_spec, dict):  # without "type": an ActorCritic's, the only policy such a checkpoint holds
            saved_spec = {"type": spec_type(saved_spec), **saved_spec}
        if saved_spec != spec:
            raise ckpt.CheckpointError(
                f"{path} holds a policy for {describe_policy_spec(saved_spec)}, but {self.config.env_id} with this "
                f"config needs one for {describe_policy_spec(spec)}; it cannot be resumed here")
        check_stored_spaces(state.get("spaces"), self.envs.single_observation_space, self.envs.single_action_space,
                            self.config.env_id, path)
        try:
            self.policy.load_state_dict(state["policy"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.obs_norm is not None and state.get("obs_norm") is not None:
                self.obs_norm.load_state_dict(state["obs_norm"])
            if self.reward_scaler is not None and state.get("reward_scaler") is not None:
                self.reward_scaler.load_state_dict(state["reward_scaler"])
            self.global_step = int(state["global_step"])
            self.update_idx = int(state["update"])
            self.kl_beta = float(state["kl_beta"])
            self.perf.update(state.get("perf", {}))
            if state.get("monitor") is not None:  # a checkpoint of an older release starts the alerts afresh
                self.monitor.load_state_dict(state["monitor"])
            loop = state["loop"]
            if restore_env_state(self.envs, state.get("env_state")):
                self.collector.load_loop_state(loop)
            ckpt.set_rng_state(state["rng"])
        except KeyError as exc:
            raise ckpt.CheckpointError(f"{path} cannot be resumed: it has no {exc.args[0]!r} entry") from exc
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError) as exc:
            raise ckpt.CheckpointError(f"{path} cannot be resumed: {ckpt.one_line(exc)}") from exc
