"""The ``ppokit`` command line: the entry point and one module per subcommand, thin over the Python API.
"""
