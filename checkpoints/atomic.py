"""Atomic writes: a whole file or a whole folder appears at its path complete, or not at all.

Files: write a temporary sibling, fsync, os.replace. mkstemp / mkdtemp create 0600 / 0700
entries; what lands gets the modes a plain open / mkdir would give under the current umask.

Folders (`atomic_folder`): for the target P/NAME, process PID works in P under names that say
whose they are (XXXXXXXX is mkdtemp's random part, one per write):

    1. fill     P/.NAME.qpn-PID-XXXXXXXX.tmp
    2. rename   .tmp -> P/.NAME.qpn-PID-XXXXXXXX.new     the rename marks the new folder complete
    3. rename   P/NAME -> P/.NAME.qpn-PID-XXXXXXXX.old   only when replacing a non-empty folder
    4. rename   .new -> P/NAME                           the target is the new folder
    5. remove   .old

Steps 3 and 4 run with SIGINT / SIGTERM / SIGHUP blocked, so a catchable signal never falls
between them; any exception removes what this write created (1, 2), or puts the old folder back
(3). Only SIGKILL, a power cut or a crash can leave these names behind, and the next write into
P finishes or rolls back the swap of every such group whose PID is no longer running (it says
so on stderr; `recover_interrupted`):

    .tmp                     removed (incomplete)
    .new, NAME present       removed: the swap had not started, NAME is still the old folder
    .new, NAME missing       renamed to NAME: killed between 3 and 4, the write had finished
    .old, NAME present       removed: the swap had finished (or the .new was just installed)
    .old, NAME missing       renamed back to NAME: the swap cannot finish, roll it back

A PID still running, or this process's own, is never touched (nor is anything on a platform
without POSIX signals). Temporaries from another machine sharing P would look dead here: write
to a shared folder from one machine at a time.

What may be replaced (`require_writable_target`): an absent path, an empty folder, or, with
overwrite, a folder that the caller's `ours` recognises as its own output - never a file, a
symbolic link, a folder `ours` does not recognise, nor one that is, contains or lies inside a
protected path (the source being read), compared by real path so links cannot hide it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

# .NAME.qpn-PID-XXXXXXXX.STAGE; mkdtemp's random part is 8 of [a-z0-9_]
_WORK_NAME = re.compile(r"^\.(?P<name>.+)\.qpn-(?P<pid>\d+)-(?P<token>[a-z0-9_]+)\.(?P<stage>tmp|new|old)$")
_SWAP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

Ours = Callable[[str], "str | None"]  # folder -> None if the caller wrote it, else why it did not


class TargetError(ValueError):
    """The output path may not be written or replaced (`require_writable_target`'s rule)."""


def fsync_dir(folder: str) -> None:
    """Make a rename inside `folder` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms without directory handles: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str, value: object) -> None:
    """Deterministic JSON (sorted keys, 2-space indent, trailing newline), fsynced."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def plain_file_mode(path: str) -> None:
    """Give a mkstemp file (0600) the mode a plain open() would have created."""
    os.chmod(path, 0o666 & ~_umask())


# ----------------------------------------------------------------------------------------------
# what may be replaced


def _overlap(target: str, protected: str) -> str | None:
    """How `target` and `protected` overlap ("is", "contains", "is inside"), by real path, or None."""
    t, p = os.path.realpath(target), os.path.realpath(protected)
    if t == p:
        return "is"
    if p.startswith(t.rstrip(os.sep) + os.sep):
        return "contains"
    if t.startswith(p.rstrip(os.sep) + os.sep):
        return "is inside"
    return None


def require_writable_target(target: str, overwrite: bool, flag: str = "overwrite=True", *,
                            ours: Ours | None = None, protected: Sequence[str] = (), what: str = "output") -> None:
    """`target` may be absent or an empty folder; with `overwrite` also a folder `ours` recognises.

    Never a file, a symbolic link, a folder `ours` does not recognise (or any non-empty folder
    when `ours` is None), nor a path that is, contains or lies inside one of `protected`.
    Raises TargetError (a ValueError) naming the path, the rule and the fix.
    """
    for path in protected:
        how = _overlap(target, path)
        if how is not None:
            raise TargetError(f"{target} {how} the {'folder' if how == 'is' else 'source folder'} {path} being read; "
                             f"qpn writes its {what} outside the source: choose a new folder next to it")
    if not os.path.isdir(os.path.dirname(target)):
        raise TargetError(f"the parent folder of {target} does not exist; create it first")
    if not os.path.lexists(target):
        return
    if os.path.islink(target):
        raise TargetError(f"{target} is a symbolic link (to {os.path.realpath(target)}); qpn replaces only a real "
                         "folder: pass the folder itself or a new path")
    if not os.path.isdir(target):
        raise TargetError(f"{target} exists and is not a folder; choose another path")
    if not os.listdir(target):
        return
    if not overwrite:
        raise TargetError(f"{target} is a non-empty folder; pass {flag} to replace it atomically "
                         f"(allowed only for a folder qpn wrote)")
    why = ours(target) if ours is not None else "it is not empty"
    if why is not None:
        raise TargetError(f"{target} is not a folder qpn wrote ({why}); {flag} replaces only qpn's own {what} or an "
                         "empty folder: choose a new path, or move that folder away yourself")


# ----------------------------------------------------------------------------------------------
# interrupted writes


def _say(message: str) -> None:
    print(f"qpn: {message}", file=sys.stderr)


def _process_gone(pid: int) -> bool:
    """True only when no process `pid` runs (POSIX); a running, foreign or unknown one counts as alive."""
    if os.name != "posix" or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        return False
    return False


def _work_groups(parent: str) -> dict[tuple[str, str, str], dict[str, str]]:
    """{(NAME, PID, token): {stage: path}} of the work names in `parent` (module docstring)."""
    groups: dict[tuple[str, str, str], dict[str, str]] = {}
    try:
        entries = os.listdir(parent)
    except OSError:
        return groups
    for entry in entries:
        match = _WORK_NAME.match(entry)
        if match:
            key = (match["name"], match["pid"], match["token"])
            groups.setdefault(key, {})[match["stage"]] = os.path.join(parent, entry)
    return groups


def _remove(path: str) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path)


def _resolve(target: str, stages: dict[str, str], pid: str) -> list[str]:
    """Finish or roll back one dead process's write of `target` (table in the module docstring)."""
    done = []
    if "tmp" in stages:
        _remove(stages["tmp"])
        done.append(f"removed the unfinished temporary folder {stages['tmp']}")
    if "new" in stages:
        if os.path.lexists(target):
            _remove(stages["new"])
            done.append(f"removed {stages['new']} (its swap into {target} had not started)")
        else:
            os.rename(stages["new"], target)
            done.append(f"finished the interrupted replacement of {target}")
    if "old" in stages:
        if os.path.lexists(target):
            _remove(stages["old"])
            done.append(f"removed {stages['old']} (the previous {os.path.basename(target)}, already replaced)")
        else:
            os.rename(stages["old"], target)
            done.append(f"restored {target} from {stages['old']} (the interrupted replacement was rolled back)")
    return [f"{message} - left by process {pid}, which is no longer running" for message in done]


def recover_interrupted(parent: str, report: Callable[[str], None] = _say) -> list[str]:
    """Finish or roll back every write into `parent` whose process is gone; report each action.

    Returns the messages (also passed to `report`, stderr by default).
    """
    messages = []
    for (name, pid, _), stages in sorted(_work_groups(parent).items()):
        if _process_gone(int(pid)):
            for message in _resolve(os.path.join(parent, name), stages, pid):
                report(message)
                messages.append(message)
    if messages:
        fsync_dir(parent)
    return messages


# ----------------------------------------------------------------------------------------------
# the folder write


def _write_error(exc: OSError, target: str) -> OSError:
    """`exc` reworded to name `target` (never the hidden temporary path) and the fix."""
    reason = exc.strerror or str(exc)
    fixes: dict[int | None, str] = {errno.ENOSPC: "free space on that disk or write elsewhere",
             errno.EACCES: "choose a folder you can write to", errno.EPERM: "choose a folder you can write to",
             errno.EROFS: "choose a folder on a writable disk"}
    if hasattr(errno, "EDQUOT"):
        fixes[errno.EDQUOT] = "free space within your disk quota or write elsewhere"
    fix = fixes.get(exc.errno, "check the disk and the folder's permissions")
    error = type(exc)(f"cannot write {target}: {reason} (nothing was written); {fix}")
    error.errno = exc.errno
    return error


def _about(exc: OSError, prefixes: Sequence[str]) -> bool:
    """Whether `exc` names no path, or one starting with one of `prefixes`."""
    names = [os.fspath(n) for n in (exc.filename, exc.filename2) if n is not None]
    return not names or any(str(n).startswith(prefix) for n in names for prefix in prefixes)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Hold SIGINT / SIGTERM / SIGHUP back for a few renames (delivered right after)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SWAP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike[str], *, overwrite: bool = False, flag: str = "overwrite=True",
                  ours: Ours | None = None, protected: Sequence[str] = (), what: str = "output") -> Iterator[str]:
    """Yield a temporary sibling folder to fill; on a normal exit it becomes `path` (module docstring).

    First finishes or rolls back interrupted writes into the parent folder, then applies
    `require_writable_target(path, overwrite, flag, ours=, protected=, what=)`. Files directly
    inside get 0666 & ~umask, the folder 0777 & ~umask. On any exception every temporary is
    removed and `path` is as it was; an OSError names `path`, not the temporary.
    """
    target = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(target)
    if os.path.isdir(parent):
        recover_interrupted(parent)
    require_writable_target(target, overwrite, flag, ours=ours, protected=protected, what=what)
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.qpn-{os.getpid()}-", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise _write_error(exc, target) from exc
    new, old = tmp[: -len(".tmp")] + ".new", tmp[: -len(".tmp")] + ".old"
    try:
        try:
            yield tmp
            umask = _umask()
            os.chmod(tmp, 0o777 & ~umask)
            for name in os.listdir(tmp):
                os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
            fsync_dir(tmp)
            os.rename(tmp, new)
            _swap(new, target, old, overwrite, flag, ours)
            fsync_dir(parent)
        except OSError as exc:
            if _about(exc, (tmp[: -len(".tmp")], target)):
                raise _write_error(exc, target) from exc
            raise  # about another path (a source file, say): its own message names it
    finally:
        for leftover in (tmp, new):
            if os.path.lexists(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
        if os.path.lexists(old) and os.path.lexists(target):  # replaced; else the only copy: the next run restores it
            shutil.rmtree(old, ignore_errors=True)


def _swap(new: str, target: str, old: str, overwrite: bool, flag: str, ours: Ours | None) -> None:
    """Steps 3 and 4: `new` becomes `target`; a non-empty `target` ends up at `old`."""
    if not os.path.lexists(target) or (os.path.isdir(target) and not os.listdir(target)):
        os.replace(new, target)  # POSIX rename also replaces an empty directory
        return
    # it may have changed while we were writing: the same rule again, just before the swap
    require_writable_target(target, overwrite, flag, ours=ours)
    with _signals_blocked():
        os.rename(target, old)
        try:
            os.rename(new, target)
        except BaseException:
            os.rename(old, target)
            raise
