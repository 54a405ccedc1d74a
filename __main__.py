"""`python -m qpn` runs the `qpn` command line (apps/cli.py); `python -m qpn --help` lists the commands."""

import sys

from .apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
