"""Which Weights & Biases project names ``PPOConfig.wandb_project`` accepts (checked before anything is built)."""

from __future__ import annotations

__all__ = ["project_name_problem"]

# What wandb.init accepts as a project name (wandb/sdk/wandb_settings.py, Settings.validate_project): at most 128
# characters, none of these. A name it refuses would fail only when the run starts tracking, after the envs are built.
_PROJECT_MAX = 128
_PROJECT_FORBIDDEN = "/\\#?%:"


def project_name_problem(name: str) -> str | None:
    """Why W&B would refuse ``name`` as a project name (one clause), or None when it is a valid one."""
    if name.strip() == "":
        return f"must be a non-empty Weights & Biases project name, got {name!r}"
    if len(name) > _PROJECT_MAX:
        return f"must be at most {_PROJECT_MAX} characters (W&B's limit), got {len(name)}"
    found = "".join(c for c in _PROJECT_FORBIDDEN if c in name)
    if found:
        return (f"cannot contain any of {' '.join(_PROJECT_FORBIDDEN)} (W&B refuses them), got {name!r} "
                f"with {' '.join(found)}")
    return None
