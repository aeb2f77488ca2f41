"""What a run is: ``PPOConfig`` (validated, one docstring per field), the presets, the planner that picks a
config for an env, and the checks of what a config asks of this machine.
"""

from ppokit.config import planner as _planner  # noqa: F401,E402  (registers PPOConfig.for_env's planner)
from ppokit.config.ppo_config import ConfigError, PPOConfig

__all__ = ["ConfigError", "PPOConfig"]
