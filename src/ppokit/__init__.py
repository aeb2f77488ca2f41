"""ppokit: Proximal Policy Optimization with exact math, a fast trainer, guard rails and diagnostics.

The public API is imported lazily so that ``import ppokit`` and ``ppokit --help`` stay light.
"""


from ppokit._version import __version__

# First, before the imports below: on the command line a Ctrl-C during start-up exits 130 without a traceback.
from ppokit.runtime import interrupts as _interrupts  # noqa: E402,F401  (defers a start-up Ctrl-C on import)

_LAZY = {
    "PPOConfig": "ppokit.config.ppo_config",
    "ConfigError": "ppokit.config.ppo_config",
    "train": "ppokit.training.trainer",
    "resume": "ppokit.training.trainer",
    "Run": "ppokit.training.trainer",
    "load": "ppokit.training.agent",
    "Agent": "ppokit.training.agent",
    "evaluate": "ppokit.training.agent",
}

__all__ = ["__version__", *_LAZY]


def __dir__() -> list[str]:
    # The lazy names are attributes too: tab completion and dir() show the public API before first use.
    return sorted({*globals(), *_LAZY})


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ppokit' has no attribute {name!r}")


# Registering ppokit/GridWorld-v0 on import lets `gym.make("ppokit/GridWorld-v0")` work after `import ppokit`.
from ppokit import envs as _envs  # noqa: E402,F401
