"""The rollout buffer: preallocated, time-major ``[T, N, ...]`` tensors on the training device.

Written once per step during the rollout and read once per update; nothing is reallocated between rollouts and
nothing is copied from numpy storage at update time (the observations land here as tensors as they arrive).
The observation storage takes its shapes and dtypes from the observation encoder (``encoders``): a flat
``[T, N, obs_dim]`` float32 tensor, uint8 ``[T, N, C, H, W]`` for an image (bytes, not floats), or a dict of
such tensors, one per key, for a Dict/Tuple observation.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

import torch
from torch import Tensor

from ppokit.core.batch import Field, Schema, TensorBatch, chunk_starts, chunk_steps, flatten_steps, tree_copy_, tree_map
from ppokit.update.epochs import BATCH_FIELDS, Batch, SequenceBatch

__all__ = ["ROLLOUT_FIELDS", "RolloutBuffer", "declare_step_field", "step_field_declared", "obs_layout",
           "state_layout"]


def _carried(batch_name: str, name: str | None = None) -> Field:
    """The minibatch field ``batch_name``'s declaration, stored in the rollout as ``name`` and carried back."""
    return replace(BATCH_FIELDS[batch_name], name=name or batch_name, batch=batch_name)


# Every per-step field of a rollout, ``[T, N, ...]``: a field with ``batch`` set reaches every minibatch under that
# name (``RolloutBuffer.flat`` / ``.sequences``). A new one is one ``declare_step_field`` and the code that writes it.
ROLLOUT_FIELDS = Schema(
    _carried("obs"),  # normalized as the policy saw it
    _carried("actions"),
    _carried("logp_old", "logp"),  # log pi_old(a|s), frozen at acting time: every ratio's denominator
    _carried("values_old", "values"),  # V(s_t) at acting time
    Field("rewards", doc="scaled when reward normalization is on"),
    Field("terminated", (), torch.bool),
    Field("truncated", (), torch.bool),
    Field("valid", (), torch.bool, doc="False for a step that carries no transition (left out of the update)"),
    Field("final_values", doc="V(final obs) where has_final, else 0"),
    Field("has_final", (), torch.bool, doc="the step ended an episode and its final obs was not the next obs"),
    _carried("action_mask", "masks"),  # the actions the env allowed at s_t; None when the env has no masks
    # A stateful policy's (``policy.initial_state(num_envs)`` is not None) inputs to act at each step, from which
    # a sequence minibatch replays each chunk; absent (nothing stored or computed) for a stateless policy.
    _carried("episode_start"),
    Field("policy_state", lambda d: d.get("policy_state"), None, optional=True,
          doc="the state passed INTO act at step t, every tensor [T, N, ...] (the policy's env axis first)"),
)


def declare_step_field(field: Field) -> Field:
    """Declare a per-step rollout field: allocated ``[T, N, ...]`` in every buffer and, with ``field.batch``, carried
    to the minibatches under that name (declared there too)."""
    ROLLOUT_FIELDS.declare(field)
    if field.batch is not None:
        try:
            BATCH_FIELDS.declare(field.renamed(field.batch))
        except ValueError:
            ROLLOUT_FIELDS.undeclare(field.name)
            raise
    return field


@contextmanager
def step_field_declared(field: Field) -> Iterator[Field]:
    """``declare_step_field(field)`` inside the block only."""
    declare_step_field(field)
    try:
        yield field
    finally:
        ROLLOUT_FIELDS.undeclare(field.name)
        if field.batch is not None:
            BATCH_FIELDS.undeclare(field.batch)


def obs_layout(obs_dim: int | tuple | dict) -> Any:
    """The observation field's layout: a flat size (float32 features), an encoder's ``(shape, dtype)``, or a dict
    of those (one tensor per key)."""
    if isinstance(obs_dim, dict):
        return {key: obs_layout(part) for key, part in obs_dim.items()}
    if isinstance(obs_dim, int):
        return (obs_dim,), torch.float32
    shape, dtype = obs_dim
    return tuple(shape), dtype


def state_layout(state: Any) -> Any:
    """The per-step layout of a policy state for ``N`` envs (a tensor or a tuple of tensors, each ``[N, ...]``:
    the env axis first); None for a stateless policy's None."""
    if state is None:
        return None
    if isinstance(state, Tensor):
        return tuple(state.shape[1:]), state.dtype
    if isinstance(state, (tuple, list)):
        return tuple(state_layout(s) for s in state)
    if isinstance(state, dict):
        return {k: state_layout(v) for k, v in state.items()}
    raise TypeError(f"a policy state is a tensor or a tuple / dict of tensors (env axis first), got "
                    f"{type(state).__name__}")


class RolloutBuffer(TensorBatch):
    """One rollout of ``T`` steps from ``N`` envs: ``ROLLOUT_FIELDS``, each ``[T, N, ...]``.

    ``logp`` is log pi_old(a|s), frozen at acting time: the denominator of every ratio in the update.
    ``valid`` is False for steps that carry no transition (the reset step of Gymnasium's NEXT_STEP autoreset,
    or a step whose observation or reward was non-finite); they are left out of the update.
    ``final_values`` holds V(final observation) for steps that were truncated by a time limit in SAME_STEP
    autoreset mode, where the observation returned is already the next episode's.
    """

    schema = ROLLOUT_FIELDS

    @classmethod
    def allocate(cls, num_steps: int, num_envs: int, obs_dim: int | tuple | dict, action_shape: tuple[int, ...],
                 action_dtype: torch.dtype, device: torch.device | str,
                 mask_dim: int | None = None, policy_state: Any = None) -> "RolloutBuffer":
        """Zeroed storage for ``num_steps x num_envs`` transitions on ``device`` (action masks of ``mask_dim``
        columns when given; the state of a stateful policy when ``policy_state``, its ``initial_state(num_envs)``,
        is not None). ``obs_dim`` is a flat size (float32), or an encoder's ``layout()``: ``(shape, dtype)`` of one
        observation, or a dict of those (one tensor per key)."""
        dims = {"obs": obs_layout(obs_dim), "action_shape": tuple(action_shape), "action_dtype": action_dtype,
                "mask_dim": mask_dim, "policy_state": state_layout(policy_state)}
        return cls(**ROLLOUT_FIELDS.allocate((num_steps, num_envs), dims, device))

    def record_state(self, t: int, state: Any, episode_start: Any) -> None:
        """Store what a stateful policy's act is given at step ``t``: the state passed in and the episode starts
        (a bool ``[N]`` array)."""
        tree_copy_(tree_map(lambda x: x[t], self.policy_state), state)
        self.episode_start[t] = torch.tensor(episode_start, dtype=torch.bool)

    def next_values(self, last_values: Tensor) -> Tensor:
        """V of the observation that followed each step, ``[T, N]``; ``last_values`` is V(obs after step T-1).

        For a step truncated in SAME_STEP mode the final observation's value replaces the reset observation's.
        """
        nxt = torch.cat([self.values[1:], last_values.unsqueeze(0)], 0)
        return torch.where(self.has_final, self.final_values, nxt)

    def _carried(self, advantages: Tensor, returns: Tensor) -> dict[str, Any]:
        """Every field carried to the minibatches, ``[T, N, ...]``, under its minibatch name."""
        out = {"advantages": advantages, "returns": returns}
        for field in self.schema.fields():
            value = self.__dict__[field.name]
            if field.batch is not None and value is not None:
                out[field.batch] = value
        return out

    def flat(self, advantages: Tensor, returns: Tensor) -> Batch:
        """The update's flat batch: the valid steps, ``[T, N, ...] -> [B, ...]`` (time-major rows), of every carried
        field, with ``advantages`` and ``returns`` (``[T, N]``)."""
        valid = self.valid.reshape(-1)
        keep = None if bool(valid.all()) else valid.nonzero().squeeze(-1)
        return Batch(**{name: flatten_steps(v, keep) for name, v in self._carried(advantages, returns).items()})

    def sequences(self, seq_len: int, advantages: Tensor, returns: Tensor) -> SequenceBatch:
        """The update's sequence batch: each env's ``T`` steps cut into ``K = ceil(T / seq_len)`` contiguous chunks
        (``core.batch.chunk_steps``), every carried field ``[L, K*N, ...]``; ``mask`` the valid steps that are not
        padding; ``state0`` the stored state at each chunk's first step (when the policy is stateful)."""
        fields = {name: chunk_steps(v, seq_len) for name, v in self._carried(advantages, returns).items()}
        fields["mask"] = chunk_steps(self.valid, seq_len)  # padding is zeros: False
        if self.policy_state is not None:
            fields["state0"] = chunk_starts(self.policy_state, seq_len)
        return SequenceBatch(**fields)
