"""``python -m ppokit``: the ``ppokit`` command line (what ``torchrun -m ppokit train ...`` runs on every rank)."""

import sys

from ppokit.cli import main

if __name__ == "__main__":
    sys.exit(main())
