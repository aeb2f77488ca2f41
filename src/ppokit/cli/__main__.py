"""``python -m ppokit.cli``: the ``ppokit`` command line."""

import sys

from ppokit.cli.app import main

sys.exit(main())
