"""`qpn.demo`, the public name of the MiniLM demo's module: the code is qpn.apps.demo."""

from .apps.demo import *  # noqa: F403
from .apps.demo import run  # noqa: F401
