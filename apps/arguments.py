"""The `qpn` command line's parser and argument types: every flag and PATH is checked where it is parsed,
so bad input stops with one line - the argument, the rule, the value - and exit 2, before a command reads
anything (a value passed on unchecked would surface as a traceback deep inside numpy, or silently mean
something else: `--keep ""` used to mean no --keep).

Each type is an argparse `type=` function raising ArgumentTypeError, whose message argparse prefixes with
"argument NAME: "; `Parser.error` prints that as one line. New commands take their flags from here.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import NoReturn

from .output import EXIT_BAD_INPUT

SHOWN_CHARS = 40  # a rejected value longer than this is shown cut (a 5000-digit --seed stays one readable line)


class Parser(argparse.ArgumentParser):
    """argparse's parser with a one-line usage error (argparse prints the usage block first) and exit 2.
    Subcommands' parsers are of this class too (`add_subparsers` makes its parsers of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _shown(text: str) -> str:
    return repr(text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS // 2]}...{text[-8:]}")


def _integer(text: str) -> int | None:
    """int(text), or None for what is not a decimal integer (int()'s digit limit included)."""
    try:
        return int(text)
    except ValueError:
        return None


def integer_in(low: int, high: int, what: str) -> Callable[[str], int]:
    """The type of an integer flag whose value must lie in [low, high]; `what` names it in the message."""
    def parse(text: str) -> int:
        value = _integer(text)
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} must be an integer in [{low}, {high}], got {_shown(text)}")
        return value

    return parse


def integers_in(low: int, high: int, what: str, example: str) -> Callable[[str], tuple[int, ...]]:
    """The type of a comma-separated list of integers, each in [low, high] (`--m 1,40`)."""
    def parse(text: str) -> tuple[int, ...]:
        parts = [_integer(part) for part in text.split(",")]
        values = tuple(value for value in parts if value is not None and low <= value <= high)
        if len(values) != len(parts):
            raise argparse.ArgumentTypeError(f"every {what} must be an integer in [{low}, {high}], comma-separated "
                                             f"as in {example}; got {_shown(text)}")
        return values

    return parse


def path_name(text: str) -> str:
    """The type of a PATH argument: any name but the empty one (`qpn pack "" out` said " does not exist";
    an empty --keep meant no --keep). Whether the path exists is each command's check, in its own words."""
    if not text:
        raise argparse.ArgumentTypeError("got an empty name; pass the folder's path, e.g. ./model")
    return text


FAMILY = re.compile(r"cpu|sm_\d{2,3}")  # torch_bridge/dispatch.device_family's names: "cpu", "sm_<major><minor>"


def device_family(text: str) -> str:
    """The type of --family: a dispatch table's key (a name, never a path: it becomes a file name)."""
    if not FAMILY.fullmatch(text):
        raise argparse.ArgumentTypeError(f"a device family is cpu or sm_<major><minor> (sm_75 for a T4, sm_90 "
                                         f"for an H100), got {_shown(text)}")
    return text
