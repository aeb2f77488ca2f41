"""What a config asks of this machine: a device it has, a run dir it can create, memory and CPU cores.

``PPOConfig.validate()`` calls the checks before any environment exists (memory with a one-float observation and
the smallest policy of ``hidden_sizes`` as a lower bound, so ``num_envs = 1e9`` or ``hidden_sizes = 1e5,1e5`` is
refused before anything is built); the trainer repeats ``check_memory`` once the spaces are known, with the policy
counted exactly, before it builds the policy, and caps its torch threads with ``usable_threads``.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from ppokit.core.errors import ConfigError

__all__ = ["check_device", "check_run_dir", "memory_parts", "estimate_memory", "available_memory",
           "check_memory", "usable_threads"]

# A device string torch understands; availability is checked separately.
_DEVICE_RE = re.compile(r"^(cpu|mps|cuda(:[0-9]+)?)$")
# Linux's NAME_MAX and PATH_MAX, in bytes: longer names fail with ENAMETOOLONG deep inside the first write.
_NAME_MAX, _PATH_MAX = 255, 4096


def check_device(device: str) -> None:
    """Refuse a device torch cannot parse or this machine does not have (torch is imported only when not cpu)."""
    if not _DEVICE_RE.match(device):
        raise ConfigError("device", f"must be cpu, cuda, cuda:N or mps, got {device!r}")
    if device == "cpu":
        return
    import torch

    if device == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigError("device", "mps was requested but torch.backends.mps.is_available() is False "
                                        "(Apple-silicon builds only); use --device cpu")
        return
    if not torch.cuda.is_available():
        raise ConfigError("device", f"{device} was requested but torch.cuda.is_available() is False; "
                                    "use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError("device", f"{device} was requested but this machine has {torch.cuda.device_count()} "
                                    "CUDA device(s) (cuda:0 ...)")


def check_run_dir(run_dir: str) -> None:
    """Refuse a run dir that cannot become a directory: an existing file, a too-long name, an unwritable parent."""
    if run_dir.strip() == "" or "\0" in run_dir:
        raise ConfigError("run_dir", f"must be a directory path, got {run_dir!r}")
    path = Path(run_dir)
    if len(os.fsencode(run_dir)) > _PATH_MAX:
        raise ConfigError("run_dir", f"the path is longer than {_PATH_MAX} bytes")
    for part in path.parts:
        if len(os.fsencode(part)) > _NAME_MAX:
            raise ConfigError("run_dir", f"the name {part[:40]!r}... is longer than {_NAME_MAX} bytes, the "
                                         "file-system limit for one path component")
    if path.exists() and not path.is_dir():
        raise ConfigError("run_dir", f"{run_dir} exists and is not a directory (a file or a device)")
    ancestor = path.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError("run_dir", f"{ancestor} is a file, so {run_dir} cannot be created below it")
    if not path.exists() and not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError("run_dir", f"cannot create {run_dir}: {ancestor} is not writable")


# Rough resident cost of one environment: a Python object (sync/native; CartPole is ~10 KB, keep a margin)
# or a whole worker process with gymnasium imported (async).
_ENV_BYTES = {"async": 64 << 20}
_ENV_BYTES_DEFAULT = 64 << 10


def layout_bytes(layout: Any) -> int:
    """Bytes of one stored observation from an encoder's ``layout()``: ``(shape, dtype)`` or a dict of them."""
    if isinstance(layout, dict):
        return sum(layout_bytes(part) for part in layout.values())
    shape, dtype = layout
    return int(math.prod(shape)) * dtype.itemsize


# Bytes per policy parameter during training, float32 each: the weight, its gradient and Adam's two moment
# estimates; the fused update (fused_update) adds the acting kernel's copy of the weights (acting.py).
_PARAM_COPIES = 4
_FUSED_COPIES = 1
# Per minibatch row (and per acting row), float32 values kept per hidden unit of the actor and the critic: the
# pre-activation, the activation and, in the backward pass, its gradient.
_HIDDEN_COPIES = 2 * 3


def mlp_parameters(in_dim: int, hidden_sizes: list[int], out_dim: int) -> int:
    """Weights and biases of an MLP ``in_dim -> hidden_sizes -> out_dim``."""
    widths = [in_dim, *hidden_sizes, out_dim]
    return sum((a + 1) * b for a, b in zip(widths, widths[1:]))


def smallest_policy(hidden_sizes: list[int]) -> int:
    """Parameters of the smallest policy with these hidden layers, whatever the spaces: an actor and a critic MLP
    from one input to one output (a lower bound before the spaces are known)."""
    return 2 * mlp_parameters(1, hidden_sizes, 1)


def memory_parts(config: Any, obs_dim: int, obs_bytes: int | None = None,
                 n_params: int | None = None) -> dict[str, int]:
    """Bytes a run needs beyond the interpreter, roughly, by the config field that sizes each part.

    ``num_envs``/``num_steps``: the rollout storage. Per transition the buffer holds the observation (twice:
    storage and the update's normalized copy), the action and about 8 floats (log-prob, value, reward, advantage,
    return, flags), 4 bytes each; ``obs_bytes`` is one stored observation's size (default ``obs_dim`` float32
    values; an image is stored as uint8 bytes); the environments themselves; the activations of one minibatch
    and one acting batch. ``eval_episodes``: the evaluation envs. ``hidden_sizes``: the network, ``n_params``
    parameters (default: ``smallest_policy``, a lower bound before the spaces are known) with their gradients
    and Adam's moments.
    """
    obs_bytes = obs_dim * 4 if obs_bytes is None else obs_bytes
    per_sample = 2 * obs_bytes + (2 + 8) * 4
    env_bytes = _ENV_BYTES.get(config.vector_mode, _ENV_BYTES_DEFAULT)
    if n_params is None:
        n_params = smallest_policy(config.hidden_sizes)
    copies = _PARAM_COPIES + (_FUSED_COPIES if config.fused_update else 0)
    # The activations scale with the batch, so a huge one is the rollout's fault, not the network's.
    rows = config.batch_size // max(1, config.num_minibatches) + config.num_envs
    activations = rows * sum(config.hidden_sizes) * _HIDDEN_COPIES * 4
    return {
        "rollout": config.num_steps * config.num_envs * per_sample + config.num_envs * env_bytes + activations,
        "eval": config.eval_episodes * (_ENV_BYTES_DEFAULT + obs_dim * 4),
        "network": n_params * 4 * copies,
    }


def estimate_memory(config: Any, obs_dim: int, obs_bytes: int | None = None,
                    n_params: int | None = None) -> int:
    """Bytes a run needs beyond the interpreter, roughly: the sum of :func:`memory_parts`."""
    return sum(memory_parts(config, obs_dim, obs_bytes, n_params).values())


def available_memory(device: str = "cpu") -> int | None:
    """Bytes available now: the GPU's free memory for cuda, else MemAvailable from /proc/meminfo (else sysconf)."""
    if device.startswith("cuda"):
        import torch

        try:
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        except Exception:  # noqa: BLE001 - no answer means no check, never a crash
            return None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(config: Any, obs_dim: int, obs_bytes: int | None = None,
                 n_params: int | None = None) -> None:
    """Raise ``ConfigError`` when the run's estimated memory exceeds what the machine has available, naming the
    field whose part is the largest (see :func:`memory_parts`)."""
    parts = memory_parts(config, obs_dim, obs_bytes, n_params)
    need = sum(parts.values())
    have = available_memory(config.device)
    if have is None or need <= have:
        return
    sizes = f"need about {need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB available on {config.device}"
    if parts["network"] >= parts["rollout"] and parts["network"] >= parts["eval"]:
        bound = "at least " if n_params is None else ""  # before the spaces are known: the smallest such policy
        if n_params is None:
            n_params = smallest_policy(config.hidden_sizes)
        raise ConfigError("hidden_sizes", f"{config.hidden_sizes} make a policy of {bound}{n_params:,} parameters, "
                                          f"which with their gradients and Adam's moment estimates {sizes}; "
                                          "choose smaller hidden layers")
    name = "num_envs" if config.num_envs >= config.num_steps else "num_steps"
    if config.eval_episodes > config.num_envs * config.num_steps:
        name = "eval_episodes"
    raise ConfigError(name, f"num_envs * num_steps = {config.num_envs:,} x {config.num_steps:,} transitions of "
                            f"{obs_dim} observation floats ({config.num_envs:,} envs, {config.eval_episodes:,} "
                            f"evaluation envs) {sizes}; lower num_envs or num_steps")


def usable_threads(requested: int) -> int:
    """``requested`` capped at the machine's CPU cores (more threads than cores only contend; torch crashes at
    very large counts), with a warning on stderr when capped."""
    cores = os.cpu_count() or 1
    if requested <= cores:
        return requested
    print(f"warning: torch_threads={requested:,} is more than this machine's {cores} CPU cores; using {cores}",
          file=sys.stderr)
    return cores
