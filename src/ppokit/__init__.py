"""ppokit: Proximal Policy Optimization with exact math, a fast trainer, guard rails and diagnostics.

The public API is imported lazily so that ``import ppokit`` and ``ppokit --help`` stay light.
"""

from __future__ import annotations

__version__ = "0.1.0"

# First, before the imports below: on the command line a Ctrl-C during start-up exits 130 without a traceback.
from ppokit import interrupts as _interrupts  # noqa: E402,F401  (defers a start-up Ctrl-C on import)

_LAZY = {
    "PPOConfig": "ppokit.config",
    "ConfigError": "ppokit.config",
    "train": "ppokit.trainer",
    "resume": "ppokit.trainer",
    "Run": "ppokit.trainer",
    "load": "ppokit.agent",
    "Agent": "ppokit.agent",
    "evaluate": "ppokit.agent",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ppokit' has no attribute {name!r}")


# Registering ppokit/GridWorld-v0 on import lets `gym.make("ppokit/GridWorld-v0")` work after `import ppokit`.
from ppokit import envs as _envs  # noqa: E402,F401
