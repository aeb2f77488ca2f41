"""The policy registry: a name per policy class, so that ``policy_from_spec`` rebuilds a policy from the
``spec()`` a checkpoint stores (its ``"type"``; a spec without one is an ``ActorCritic``).

Every policy module registers its classes when it is imported; ``ppokit.policies`` imports them all, so the
registry is complete whenever any policy module is in use.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ppokit._version import __version__

__all__ = ["DEFAULT_POLICY_TYPE", "PolicySpecError", "policy_from_spec", "policy_types", "register_policy",
           "spec_type"]


class PolicySpecError(ValueError):
    """A stored policy spec this ppokit cannot rebuild (an unknown type, missing or wrong arguments)."""


DEFAULT_POLICY_TYPE = "actor_critic"  # what a spec without "type" is (a spec without a type)
_POLICY_TYPES: dict[str, type] = {}


def register_policy(name: str, cls: type) -> type:
    """Register ``cls`` under ``name``: ``policy_from_spec`` builds ``cls(**spec_without_type)``. A name taken by
    another class is refused (a checkpoint's type must always mean the same network)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a policy type name must be a non-empty string, got {name!r}")
    known = _POLICY_TYPES.get(name)
    if known is not None and known is not cls:
        raise ValueError(f"policy type {name!r} is already registered to {known.__qualname__}")
    _POLICY_TYPES[name] = cls
    return cls


def policy_types() -> list[str]:
    """The registered policy type names."""
    return sorted(_POLICY_TYPES)


def spec_type(spec: dict) -> str:
    """The registered type a spec names (``DEFAULT_POLICY_TYPE`` when it names none)."""
    return spec.get("type", DEFAULT_POLICY_TYPE)


def policy_from_spec(spec: Any) -> nn.Module:
    """The policy ``spec`` describes (weights freshly initialized: load the state dict next). PolicySpecError for
    a type this version does not know or arguments its class refuses."""
    if not isinstance(spec, dict):
        raise PolicySpecError(f"a policy spec must be a dict, got {type(spec).__name__}")
    name = spec_type(spec)
    known = policy_types()
    cls = _POLICY_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise PolicySpecError(f"policy type {name!r} is not known to ppokit {__version__} (known: "
                              f"{', '.join(known)}); it was written by a newer ppokit or needs the code that "
                              "registers it (ppokit.policies.register_policy) imported first")
    kwargs = {k: v for k, v in spec.items() if k != "type"}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # an argument the class does not take, or one missing
        raise PolicySpecError(f"policy spec of type {name!r} does not fit {cls.__qualname__}: {exc}") from None
