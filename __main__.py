"""`python -m qpn` runs the `qpn` command line through its light entry (apps/entry.py: signal handlers
before the slow imports); `python -m qpn --help` lists the commands."""

import sys

from .apps.entry import main

if __name__ == "__main__":
    sys.exit(main())
