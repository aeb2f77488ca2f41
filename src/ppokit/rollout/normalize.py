"""Running observation normalisation and reward scaling, batched on a torch device.

Observation normalization takes its shapes from the observation encoder (``make_obs_normalizer``): a flat float
vector gets one ``ObsNormalizer``; a Dict/Tuple observation a ``PartsObsNormalizer`` that standardizes its float
vector parts only (images keep their bytes, which the model scales by 1/255; one-hot codes stay codes); an
observation with no float vector part at all (an image, a one-hot Discrete) is refused with a config error.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_STATS = ("mean", "var", "count")


def _as_tensor(x: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(x, device=device).to(dtype)


class RunningMeanStd:
    """Running mean/variance of samples of shape ``shape`` (float64), merged batch by batch (Chan et al.)."""

    def __init__(self, shape: tuple[int, ...] | int = (), device: str | torch.device = "cpu"):
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.device = torch.device(device)
        self.mean = torch.zeros(self.shape, dtype=torch.float64, device=self.device)
        # var=1 keeps normalisation an identity until the first update arrives.
        self.var = torch.ones(self.shape, dtype=torch.float64, device=self.device)
        # count starts at 0 (not a small epsilon) so the statistics equal the exact
        # population mean/var of everything seen; the first merge then copies the batch.
        self.count = torch.zeros((), dtype=torch.float64, device=self.device)
        # Data-parallel training (distributed.Dist.merge_moments): (n, batch mean, batch var) -> the same three
        # over every rank's batch, so that every rank keeps, and normalizes with, the same statistics.
        self.reduce: Callable[[int, torch.Tensor, torch.Tensor], tuple[int, torch.Tensor, torch.Tensor]] | None = None

    def update(self, batch: Any) -> None:
        """Merge a batch [B, *shape] into the running statistics."""
        x = _as_tensor(batch, self.device, torch.float64)
        if x.shape[1:] != self.shape:
            raise ValueError(f"expected a batch of shape [B, {', '.join(map(str, self.shape))}], got {tuple(x.shape)}")
        n = x.shape[0]
        if n == 0 and self.reduce is None:
            return
        batch_mean = x.mean(dim=0)
        batch_var = x.var(dim=0, unbiased=False)
        if self.reduce is not None:  # every rank takes part, even with an empty batch
            n, batch_mean, batch_var = self.reduce(n, batch_mean, batch_var)
            if n == 0:
                return
        self.count, self.mean, self.var = merge_moments(self.count, self.mean, self.var, n, batch_mean, batch_var)

    @property
    def std(self) -> torch.Tensor:
        """Population standard deviation [*shape] (float64)."""
        return self.var.sqrt()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only: {"mean": [*shape], "var": [*shape], "count": []}, all float64."""
        return {"mean": self.mean.clone(), "var": self.var.clone(), "count": self.count.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore statistics saved by ``state_dict`` (moved to this object's device)."""
        missing = [k for k in _STATS if k not in state]
        if missing:
            raise KeyError(f"RunningMeanStd state is missing {missing}")
        mean = _as_tensor(state["mean"], self.device, torch.float64)
        var = _as_tensor(state["var"], self.device, torch.float64)
        if mean.shape != self.shape or var.shape != self.shape:
            raise ValueError(
                f"RunningMeanStd shape mismatch: expected {self.shape}, "
                f"got mean {tuple(mean.shape)}, var {tuple(var.shape)}"
            )
        self.mean = mean.clone()
        self.var = var.clone()
        self.count = _as_tensor(state["count"], self.device, torch.float64).reshape(()).clone()


def merge_moments(count: Any, mean: torch.Tensor, var: torch.Tensor, n: Any, batch_mean: torch.Tensor,
                  batch_var: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``(count, mean, var)`` of two sample sets given by their (count, mean, population var) (Chan et al. 1979)."""
    total = count + n
    delta = batch_mean - mean
    # Merging sums of squared deviations is stable where sum(x^2) - n*mean^2 would cancel.
    m2 = var * count + batch_var * n + delta.square() * (count * n / total)
    return total, mean + delta * (n / total), m2 / total


def split_moments(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor,
                                                                                             torch.Tensor]:
    """``merge_moments`` undone: the (count, mean, var) of the samples that took ``RunningMeanStd.state_dict()``
    ``before`` to ``after`` (count 0 when none). A rollout worker ships these, so that the learner merges every
    worker's observations into its one set of statistics (``rollout/actors.py``)."""
    c0, m0, v0 = float(before["count"]), before["mean"], before["var"]
    c1, m1, v1 = float(after["count"]), after["mean"], after["var"]
    n = c1 - c0
    if n <= 0:
        return 0.0, torch.zeros_like(m1), torch.ones_like(v1)
    mean = (m1 * c1 - m0 * c0) / n
    m2 = v1 * c1 - v0 * c0 - (mean - m0).square() * (c0 * n / c1)
    return n, mean, (m2 / n).clamp(min=0.0)


class ObsNormalizer:
    """Observation normaliser: float32 ``clip((obs - mean) / sqrt(var + eps), -clip, clip)`` with running stats."""

    def __init__(
        self,
        shape: tuple[int, ...] | int,
        clip: float = 10.0,
        eps: float = 1e-8,
        device: str | torch.device = "cpu",
    ):
        self.rms = RunningMeanStd(shape, device)
        self.clip = float(clip)
        self.eps = float(eps)
        # Set at evaluation so that test episodes do not shift the training statistics.
        self.frozen = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self.rms.shape

    @property
    def device(self) -> torch.device:
        return self.rms.device

    def update(self, obs: Any) -> None:
        """Add observations [N, *shape] to the statistics (no-op when frozen)."""
        if not self.frozen:
            self.rms.update(obs)

    def normalize(self, obs: Any) -> torch.Tensor:
        """Normalised float32 observations, same shape as ``obs`` ([..., *shape])."""
        x = _as_tensor(obs, self.device, torch.float64)
        out = (x - self.rms.mean) / torch.sqrt(self.rms.var + self.eps)
        return out.clamp_(-self.clip, self.clip).to(torch.float32)

    def __call__(self, obs: Any) -> torch.Tensor:
        """Alias of ``normalize``."""
        return self.normalize(obs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (running mean/var/count)."""
        return self.rms.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore statistics saved by ``state_dict``."""
        self.rms.load_state_dict(state)


class RewardScaler:
    """Divides rewards by the running std of the per-env discounted return (no mean subtraction)."""

    def __init__(
        self,
        num_envs: int,
        gamma: float,
        clip: float = 10.0,
        eps: float = 1e-8,
        device: str | torch.device = "cpu",
    ):
        if int(num_envs) < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if not 0.0 <= float(gamma) <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        self.num_envs = int(num_envs)
        self.gamma = float(gamma)
        self.clip = float(clip)
        self.eps = float(eps)
        self.rms = RunningMeanStd((), device)
        self.returns = torch.zeros(self.num_envs, dtype=torch.float64, device=self.rms.device)
        self.frozen = False

    @property
    def device(self) -> torch.device:
        return self.rms.device

    def scale(self, rewards: Any, dones: Any) -> torch.Tensor:
        """Scaled float32 rewards [N] for rewards [N] and episode-end flags dones [N] (bool)."""
        r = _as_tensor(rewards, self.device, torch.float64).reshape(-1)
        d = _as_tensor(dones, self.device, torch.bool).reshape(-1)
        if r.shape[0] != self.num_envs or d.shape[0] != self.num_envs:
            raise ValueError(
                f"expected rewards and dones of shape [{self.num_envs}], got {tuple(r.shape)} and {tuple(d.shape)}"
            )
        self.returns = self.returns * self.gamma + r
        if not self.frozen:
            self.rms.update(self.returns)
        scaled = (r / torch.sqrt(self.rms.var + self.eps)).clamp(-self.clip, self.clip)
        # The return restarts for envs whose episode just ended, after this step's reward was used.
        self.returns = torch.where(d, torch.zeros_like(self.returns), self.returns)
        return scaled.to(torch.float32)

    def __call__(self, rewards: Any, dones: Any) -> torch.Tensor:
        """Alias of ``scale``."""
        return self.scale(rewards, dones)

    def reset(self) -> None:
        """Zero the running discounted returns (statistics are kept)."""
        self.returns.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only: running mean/var/count of the return and the per-env returns [N]."""
        state = self.rms.state_dict()
        state["returns"] = self.returns.clone()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a ``state_dict``; per-env returns are zeroed if num_envs differs or they are absent."""
        self.rms.load_state_dict(state)
        returns = state.get("returns")
        if returns is not None and tuple(returns.shape) == (self.num_envs,):
            self.returns = _as_tensor(returns, self.device, torch.float64).clone()
        else:
            self.returns = torch.zeros(self.num_envs, dtype=torch.float64, device=self.device)


class PartsObsNormalizer:
    """``ObsNormalizer`` per float vector part of a Dict/Tuple observation; the other parts pass unchanged.

    Same interface as ``ObsNormalizer`` on dicts of ``[N, ...]`` tensors; its state is ``{key: ObsNormalizer
    state}`` for the normalized keys.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], clip: float = 10.0, eps: float = 1e-8,
                 device: str | torch.device = "cpu"):
        self.parts = {key: ObsNormalizer(shape, clip, eps, device) for key, shape in shapes.items()}
        self._frozen = False

    @property
    def frozen(self) -> bool:
        return self._frozen

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self._frozen = bool(value)
        for part in self.parts.values():
            part.frozen = self._frozen

    def update(self, obs: dict[str, Any]) -> None:
        for key, part in self.parts.items():
            part.update(obs[key])

    def normalize(self, obs: dict[str, Any]) -> dict[str, Any]:
        return {key: self.parts[key].normalize(v) if key in self.parts else v for key, v in obs.items()}

    __call__ = normalize

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {key: part.state_dict() for key, part in self.parts.items()}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        if set(state) != set(self.parts):
            raise ValueError(f"observation normalizer parts {sorted(state)} do not match {sorted(self.parts)}")
        for key, part in self.parts.items():
            part.load_state_dict(state[key])


def make_obs_normalizer(encoder: Any, device: str | torch.device = "cpu") -> ObsNormalizer | PartsObsNormalizer:
    """The observation normalizer for an ``encoders`` encoder; ValueError when nothing in it is a float vector."""
    if not encoder.normalizable:
        raise ValueError(f"observation normalization applies to float vector observations; this one is "
                         f"{encoder.what}")
    if encoder.structured:
        return PartsObsNormalizer({key: (part.flat_dim,) for key, part in encoder.parts.items() if part.normalizable},
                                  device=device)
    return ObsNormalizer((encoder.flat_dim,), device=device)
