"""Where the `qpn` command starts (console script `qpn`, `python -m qpn`): signal handlers first, then the
imports, then apps/cli.py.

The imports (numpy, the checkpoint readers) take most of a second, and a Ctrl-C among them used to end in a
KeyboardInterrupt traceback through numpy's frames. Nothing has been written yet at that point, so there is
nothing to clean up: a stop signal prints one line and exits 128 + the signal at once (os._exit). A signal
that arrived ignored stays ignored (`nohup` ignores SIGHUP). Once apps/cli.py is imported the handlers are
put back: SIGINT raises KeyboardInterrupt again and cli.main turns SIGTERM / SIGHUP into a clean stop.

This module and the packages above it (qpn/__init__.py, apps/__init__.py) import nothing heavy, so the
handlers are in place before any slow import begins.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import NoReturn

from .output import EXIT_SIGNAL_BASE  # output.py imports only the standard library's sys and typing helpers

STDERR_FD = 2
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def _stopped_while_starting(signum: int, _frame: FrameType | None) -> NoReturn:
    how = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    try:
        os.write(STDERR_FD, f"qpn: {how} while starting\n".encode())  # unbuffered: os._exit flushes nothing
    except OSError:  # stderr closed: the exit code still says it
        pass
    os._exit(EXIT_SIGNAL_BASE + signum)


def main() -> int:
    """The console script's target: start up under `_stopped_while_starting`, then run cli.main."""
    previous = {signum: signal.signal(signum, _stopped_while_starting) for signum in STOP_SIGNALS
                if signal.getsignal(signum) not in (signal.SIG_IGN, None)}  # None: a handler set outside Python
    try:
        from . import cli  # noqa: PLC0415  (the slow imports, under the handlers above)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return cli.main()
