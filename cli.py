"""`qpn.cli`, the public name of the `qpn` command's module: the code is qpn.apps.cli."""

from .apps.cli import *  # noqa: F403
from .apps.cli import main  # noqa: F401
