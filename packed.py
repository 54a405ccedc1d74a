"""`qpn.packed`, the public name of the packed checkpoint format: the code is qpn.checkpoints.packed."""

from .checkpoints.packed import *  # noqa: F403
from .checkpoints.packed import __all__  # noqa: F401
