"""The errors every layer raises for bad input: each names the field and says what to do."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and says what to do.

    ``others`` (field -> reason) are further invalid fields met in the same check, so that a file with three
    mistakes is refused once with all three (``problems`` holds every one; ``field``/``reason`` the first);
    ``where`` (e.g. the TOML file) starts the message."""

    def __init__(self, field_name: str, reason: str, others: dict[str, str] | None = None, where: str = ""):
        self.field = field_name
        self.reason = reason
        self.problems = {field_name: reason, **(others or {})}
        text = "; ".join(f"config field '{name}': {why}" for name, why in self.problems.items())
        super().__init__(f"{where}: {text}" if where else text)

    @classmethod
    def of(cls, problems: dict[str, str], where: str = "") -> "ConfigError":
        """One error for every (field, reason) of ``problems`` (non-empty), in their order."""
        (name, reason), *rest = problems.items()
        return cls(name, reason, dict(rest), where)
