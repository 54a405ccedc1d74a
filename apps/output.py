"""What every `qpn` command shares about how it ends and what it prints: exit codes, the bad-input
error, progress bars, tables and byte sizes (apps/cli.py, apps/verify.py, apps/demo.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NO_HARDWARE = 0, 1, 2, 3  # apps/cli.py's docstring says which is which
EXIT_SIGNAL_BASE = 128  # a command stopped by signal S exits 128 + S, as a shell reports it


class UsageError(Exception):
    """Bad input found by a command (exit 2)."""


def plural(count: int, noun: str) -> str:
    """"1 layer", "2 layers" (every noun here takes an s)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def progress_bars(enabled: bool) -> Callable:
    """progress(iterable, desc=, total=, unit=) -> iterable: tqdm bars on stderr, or the iterable itself."""
    if enabled:
        try:
            from tqdm import tqdm
        except ImportError:  # bars are a nicety: run without them
            enabled = False
    if not enabled:
        return lambda iterable, **_: iterable

    def bar(iterable: Iterable, desc: str | None = None, total: int | None = None, unit: str = "it") -> Iterable:
        return tqdm(iterable, desc=desc, total=total, unit=unit, leave=False, file=sys.stderr, dynamic_ncols=True)

    return bar


NO_BARS = progress_bars(False)  # the default progress: one shared pass-through, built once at import


def table_line(cells: Sequence[object], widths: Sequence[int]) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


def table_rule(widths: Sequence[int]) -> str:
    return "  ".join("-" * w for w in widths)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    lines = [table_line(row, widths) for row in rows]
    return "\n".join([table_line(headers, widths), table_rule(widths), *lines])


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
