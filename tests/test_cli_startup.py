"""A signal during the `qpn` command's start-up (the ~1 s of imports: numpy, the checkpoint readers) ends it
with one line and 128 + the signal, never a KeyboardInterrupt traceback through numpy's frames
(apps/entry.py: the console script and `python -m qpn` install their handlers before importing anything heavy).

No race: the child process installs an import hook that raises the signal at the moment numpy is first
imported, i.e. in the middle of start-up, every time. The child sets every disposition it relies on itself
(under `nohup` SIGHUP arrives ignored; in a background job SIGINT does).
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from qpn.apps import cli

CHILD = """
import importlib.abc, signal, sys

class RaiseOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            signal.raise_signal(signal.{signal})
        return None  # the import goes on as usual

signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own dispositions, whatever was inherited
for name in ("SIGTERM", "SIGHUP"):
    if hasattr(signal, name):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
{ignore}
sys.meta_path.insert(0, RaiseOnImport())
sys.argv = ["qpn", "--version"]
{start}
"""
CONSOLE_SCRIPT = ('from importlib.metadata import entry_points\n'
                  'sys.exit(entry_points(group="console_scripts", name="qpn")["qpn"].load()())')
PYTHON_M = 'import runpy\nrunpy.run_module("qpn", run_name="__main__", alter_sys=True)'
STARTS = {"console script": CONSOLE_SCRIPT, "python -m qpn": PYTHON_M}
STOPS = [("SIGINT", "interrupted (Ctrl-C)")] + [(name, f"stopped by {name}") for name in ("SIGTERM", "SIGHUP")
                                                  if hasattr(signal, name)]


def start(how: str, signum: str, cwd, *, ignored: bool = False) -> subprocess.CompletedProcess:
    """Run the child in `cwd`, away from the clone: a build's stale qpn.egg-info in the clone's root would
    shadow the installed console script's metadata (the installed `qpn` script never sees it either)."""
    ignore = f"signal.signal(signal.{signum}, signal.SIG_IGN)  # as inherited from nohup" if ignored else ""
    code = CHILD.format(signal=signum, ignore=ignore, start=STARTS[how])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.parametrize("how", STARTS)
@pytest.mark.parametrize("signum, words", STOPS)
def test_a_signal_while_starting_is_one_line_and_128_plus_the_signal(tmp_path, how, signum, words):
    result = start(how, signum, tmp_path)
    assert result.returncode == 128 + getattr(signal, signum), (result.returncode, result.stderr)
    assert result.stderr == f"qpn: {words} while starting\n" and result.stdout == "", result.stderr


@pytest.mark.parametrize("how", STARTS)
def test_an_inherited_ignored_signal_stays_ignored_while_starting(tmp_path, how):
    """`nohup qpn ...`: SIGHUP arrives ignored, and a hang-up during the imports must not stop the command."""
    name = "SIGHUP" if hasattr(signal, "SIGHUP") else "SIGINT"
    result = start(how, name, tmp_path, ignored=True)
    assert result.returncode == 0 and result.stdout.startswith("qpn "), (result.returncode, result.stderr)


@pytest.fixture
def python_dispositions():
    """Python's own start-up dispositions, whatever this process inherited; restored afterwards."""
    wanted = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    if hasattr(signal, "SIGHUP"):
        wanted[signal.SIGHUP] = signal.SIG_DFL
    previous = {signum: signal.signal(signum, handler) for signum, handler in wanted.items()}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_the_entry_hands_over_with_the_handlers_cli_expects(monkeypatch, python_dispositions):
    """During the command, SIGINT raises KeyboardInterrupt again (cli.main reports it and cleans up) and the
    other handlers are what they were; after it, every handler is as before."""
    from qpn.apps import entry

    names = [name for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)]
    before = {name: signal.getsignal(getattr(signal, name)) for name in names}
    seen = {}
    monkeypatch.setattr(cli, "main", lambda argv=None: seen.update(
        {name: signal.getsignal(getattr(signal, name)) for name in names}) or 0)
    assert entry.main() == 0
    assert seen == before and seen["SIGINT"] is signal.default_int_handler
    assert {name: signal.getsignal(getattr(signal, name)) for name in names} == before


def test_a_ctrl_c_while_parsing_is_one_line_and_130(monkeypatch, capsys):
    """The gap between the entry's handlers and the command's: cli.main reports it as it reports the rest."""
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["--version"]) == 130
    assert capsys.readouterr().err == "qpn: interrupted (Ctrl-C)\n"
