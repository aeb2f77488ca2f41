"""CLI subcommands, one module each; see ``ppokit.cli``."""
