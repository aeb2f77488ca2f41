"""The ``ppokit`` command line: the entry point (``app.py``: ``main``, the console script's ``ppokit.cli:main``) and
one module per subcommand, thin over the Python API. ``python -m ppokit.cli`` runs it too.
"""

from ppokit.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
