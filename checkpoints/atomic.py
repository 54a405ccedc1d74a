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

Steps 3 to 5 run with SIGINT / SIGTERM / SIGHUP held (`_signals_held`), so a catchable signal
never falls between them; any exception removes what this write created (1, 2), or puts the old folder back
(3). Step 4 is the commit point: from then on the write has succeeded, so the removal of the old folder is
finished before a signal that came acts (qpn says so on stderr, once), `on_commit` lets a caller treat
the signal as late (`qpn pack` then exits 0), and a removal that fails names the hidden folder and its size.
Only SIGKILL, a power cut or a crash can leave these names behind, and the next write into
P finishes or rolls back the swap of every such group whose PID is no longer running (it says
so on stderr; `recover_interrupted`):

    .tmp                     removed (incomplete)
    .new, NAME present       removed: the swap had not started, NAME is still the old folder
    .new, NAME missing       renamed to NAME: killed between 3 and 4, the write had finished
    .old, NAME present       removed: the swap had finished (or the .new was just installed)
    .old, NAME missing       renamed back to NAME: the swap cannot finish, roll it back

A name too long for these work names (NAME + ~26 characters over the file system's limit of
255 bytes) is abbreviated there (`.SHORT~HASH.qpn-...`), and the full name is kept beside them
in `.SHORT~HASH.qpn-PID-XXXXXXXX.name`, which recovery reads and removes.

A mount point (an empty Docker volume, say) cannot be renamed (EBUSY): `atomic_folder` sees one
up front and fills it in place instead - the temporary `.NAME.qpn-PID-XXXXXXXX.tmp` inside the
mount point (the same disk), then its entries moved into the mount point with the stop signals
held (by link + unlink, which never replaces a name someone else made meanwhile), and the emptied
temporary removed. The write is all or nothing against every catchable
signal and error; a SIGKILL or a power cut during those renames leaves part of the entries, which
`require_writable_target` then refuses to treat as qpn's (a non-empty mount point is never
replaced: it cannot be swapped).

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
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypedDict

# .NAME.qpn-PID-XXXXXXXX.STAGE; mkdtemp's random part is 8 of [a-z0-9_]
_WORK_NAME = re.compile(r"^\.(?P<name>.+)\.qpn-(?P<pid>\d+)-(?P<token>[a-z0-9_]+)\.(?P<stage>tmp|new|old|name)$")
# what link() says where a file system (or a folder) takes no hard link: fall back to rename()
_NO_HARD_LINKS = {errno.EPERM, errno.EXDEV, errno.EMLINK, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.EOPNOTSUPP}
_NAME_MAX = 255  # bytes in one file name: ext4, xfs, btrfs, tmpfs, APFS, NTFS (in UTF-16 units)
_WORK_SUFFIX_MAX = len(".qpn-4194304-xxxxxxxx.name")  # a pid is at most 2^22 on Linux
_SWAP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

Ours = Callable[[str], "str | None"]  # folder -> None if the caller wrote it, else why it did not


class TargetRules(TypedDict, total=False):
    """A writer's keyword arguments of require_writable_target / atomic_folder: the flag that allows a
    replacement, how it recognises its own output, what it calls that output."""

    flag: str
    ours: Ours
    what: str


# errno of a failed write -> the fix a message suggests
_WRITE_FIXES = {errno.ENOSPC: "free space on that disk or write elsewhere", errno.EACCES: "choose a folder you can "
                "write to", errno.EPERM: "choose a folder you can write to", errno.EROFS: "choose a folder on a "
                "writable disk", getattr(errno, "EDQUOT", -1): "free space within your disk quota or write elsewhere",
               errno.ENAMETOOLONG: "choose a shorter name (at most 255 bytes a name, 4096 a whole path)"}


def write_fix(error_number: int | None) -> str:
    """The fix to suggest for a write that failed with `error_number`."""
    return _WRITE_FIXES.get(error_number or 0, "check the disk and the folder's permissions")


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
    if is_mount_point(target):
        raise TargetError(f"{target} is a mount point that is not empty; a mount point cannot be swapped by rename, so "
                         "qpn writes only into an empty one: empty it yourself, or write into a new folder inside it")
    if not overwrite:
        raise TargetError(f"{target} is a non-empty folder; pass {flag} to replace it atomically "
                         f"(allowed only for a folder qpn wrote)")
    why = ours(target) if ours is not None else "it is not empty"
    if why is not None:
        raise TargetError(f"{target} is not a folder qpn wrote ({why}); {flag} replaces only qpn's own {what} or an "
                         "empty folder: choose a new path, or move that folder away yourself")


def _mount_points() -> set[str]:
    """The mount points listed in /proc/self/mountinfo (Linux; empty elsewhere): bind mounts included."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    # field 5 is the mount point, with space, tab, newline and backslash escaped as \ooo
    return {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
            for line in lines if len(line.split()) > 4}


def is_mount_point(path: str) -> bool:
    """Whether the folder `path` is a mount point, so that rename() cannot replace it (EBUSY).

    os.path.ismount misses a bind mount of a folder of the same disk (the common Docker volume):
    /proc/self/mountinfo lists those too.
    """
    return os.path.isdir(path) and (os.path.ismount(path) or os.path.realpath(path) in _mount_points())


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
            name_file = stages.pop("name", None)
            if name_file is not None:  # an abbreviated work name: the target's full name is kept here
                with open(name_file, encoding="utf-8", errors="surrogateescape") as f:
                    full = f.read()
                if _work_stem(full) != name:  # cut short by a power cut: which folder it was is unknown
                    continue
                name = full
            for message in _resolve(os.path.join(parent, name), stages, pid):
                report(message)
                messages.append(message)
            if name_file is not None:
                os.unlink(name_file)
    if messages:
        fsync_dir(parent)
    return messages


# ----------------------------------------------------------------------------------------------
# the folder write


def _write_error(exc: OSError, target: str) -> OSError:
    """`exc` reworded to name `target` (never the hidden temporary path) and the fix."""
    reason = exc.strerror or str(exc)
    error = type(exc)(f"cannot write {target}: {reason} (nothing was written); {write_fix(exc.errno)}")
    error.errno = exc.errno
    return error


def _about(exc: OSError, prefixes: Sequence[str]) -> bool:
    """Whether `exc` names no path, or one starting with one of `prefixes`."""
    names = [os.fspath(n) for n in (exc.filename, exc.filename2) if n is not None]
    return not names or any(str(n).startswith(prefix) for n in names for prefix in prefixes)


class _HeldSignals:
    """The stop signals that came while `_signals_held` held them back, and what to tell the user of them."""

    def __init__(self) -> None:
        self.came: list[int] = []
        self._notice: str | None = None

    def record(self, signum: int, _frame: object) -> None:
        self.came.append(signum)
        self._tell()

    def committed(self, notice: str) -> None:
        """The write has succeeded and `notice` says what is left to do: a signal that came, or comes while it is
        done, hears it (once), so that a Ctrl-C that seems to do nothing for a moment is answered."""
        self._notice = notice
        self._tell()

    def _tell(self) -> None:
        if self.came and self._notice is not None:
            _say(f"{signal.Signals(self.came[0]).name}: {self._notice}")
            self._notice = None


@contextlib.contextmanager
def _signals_held() -> Iterator[_HeldSignals]:
    """Hold SIGINT / SIGTERM / SIGHUP back for the swap and the removal of the previous folder (steps 3 to 5);
    each one that came is re-raised right after.

    Python runs a signal's handler in the main thread, whichever thread the kernel delivered it
    to: a qpn process always has other threads (numpy's, torch's), so blocking the signals in
    this thread (pthread_sigmask) would not keep KeyboardInterrupt out of the swap. Instead, for
    the swap, a recording handler replaces each one: a signal that comes is only noted, and once
    the old handlers are back it is raised again, so it acts (KeyboardInterrupt, cli's Stopped,
    or the default action) after the swap. Off the main thread there is nothing to hold: no
    handler runs in this thread, so none can land between its renames.
    """
    held = _HeldSignals()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    # a handler set outside Python (getsignal gives None) cannot be put back, so it is left alone
    previous = {signum: signal.signal(signum, held.record)
                for signum in _SWAP_SIGNALS if signal.getsignal(signum) is not None}
    try:
        yield held
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held.came):  # each kind once, in the order they came
            signal.raise_signal(signum)


def _work_stem(name: str) -> str:
    """NAME in the work names `.NAME.qpn-PID-XXXXXXXX.STAGE`, abbreviated where they would pass 255 bytes."""
    room = _NAME_MAX - _WORK_SUFFIX_MAX - 1  # the leading dot
    if len(os.fsencode(name)) <= room:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    short = os.fsencode(name)[: room - len(digest) - 1].decode(errors="ignore")  # whole characters only
    return f"{short}~{digest}"


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike[str], *, overwrite: bool = False, flag: str = "overwrite=True",
                  ours: Ours | None = None, protected: Sequence[str] = (), what: str = "output",
                  on_commit: Callable[[], None] | None = None) -> Iterator[str]:
    """Yield a temporary folder to fill; on a normal exit it becomes `path` (module docstring).

    First finishes or rolls back interrupted writes into the parent folder, then applies
    `require_writable_target(path, overwrite, flag, ours=, protected=, what=)`. Files directly
    inside get 0666 & ~umask, the folder 0777 & ~umask (a mount point keeps its own mode). On any
    exception every temporary is removed and `path` is as it was; an OSError names `path`, not
    the temporary. `on_commit` is called at the commit point, the new folder at `path`, with the
    stop signals still held: a signal that came, or comes while the previous folder is removed, is
    re-raised after it returns, so a caller whose result is complete from then on can make its
    handlers only note the signal (apps/cli.py).
    """
    target = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(target)
    in_place = is_mount_point(target)  # rename() cannot replace it: fill it (module docstring)
    for folder in (parent, target) if in_place else (parent,):
        if os.path.isdir(folder):
            recover_interrupted(folder)
    require_writable_target(target, overwrite, flag, ours=ours, protected=protected, what=what)
    stem = _work_stem(os.path.basename(target))
    try:
        tmp = tempfile.mkdtemp(prefix=f".{stem}.qpn-{os.getpid()}-", suffix=".tmp", dir=target if in_place else parent)
        base = tmp[: -len(".tmp")]
        if stem != os.path.basename(target) and not in_place:  # recovery needs the full name (module docstring)
            with open(base + ".name", "x", encoding="utf-8", errors="surrogateescape") as f:
                f.write(os.path.basename(target))
    except OSError as exc:
        raise _write_error(exc, target) from exc
    new, old = base + ".new", base + ".old"
    try:
        try:
            yield tmp
            umask = _umask()
            for name in os.listdir(tmp):
                os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
            fsync_dir(tmp)
            if not in_place:
                os.chmod(tmp, 0o777 & ~umask)
                os.rename(tmp, new)  # step 2
            with _signals_held() as held:
                if in_place:
                    _fill(tmp, target)
                else:
                    _swap(new, target, old, overwrite, flag, ours)
                    fsync_dir(parent)
                try:
                    if on_commit is not None:  # the commit point: `target` is the new folder
                        on_commit()
                finally:
                    if os.path.lexists(old):  # step 5: the write has succeeded; finish it before any signal acts
                        held.committed(f"{target} is already replaced; removing its previous version first")
                        _remove_or_say(old, f"the previous version of {target}")
        except OSError as exc:
            if _about(exc, (base, target)):
                raise _write_error(exc, target) from exc
            raise  # about another path (a source file, say): its own message names it
    finally:  # after an exception, what this write created goes (an .old is left only where it is the only copy)
        for leftover in (tmp, new):
            if os.path.lexists(leftover):
                _remove_or_say(leftover, f"the unfinished output of {target}")
        if os.path.lexists(base + ".name") and not os.path.lexists(old):
            os.unlink(base + ".name")


def _remove_or_say(folder: str, what: str) -> None:
    """Remove the hidden work folder `folder`; where that fails, name it and its size on stderr: it may be as
    large as the model, and nothing else would tell the user it is there."""
    try:
        shutil.rmtree(folder)
    except OSError as exc:
        size = sum(os.lstat(os.path.join(root, name)).st_size for root, _, files in os.walk(folder) for name in files)
        _say(f"could not remove {what} ({exc.strerror or exc}): {folder} is left, {size:,} bytes; remove it "
             "yourself (the next qpn write into that folder also removes it)")


def _move_no_replace(src: str, dst: str) -> None:
    """rename(src, dst) that never replaces a `dst` someone else made: link() refuses an existing name
    (EEXIST) where rename() would replace it. Where hard links are not supported (or `src` is a
    folder), the name is checked first and renamed (a window of one system call)."""
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst) from None
        os.rename(src, dst)
        return
    os.unlink(src)


def _fill(tmp: str, target: str) -> None:
    """The mount point `target` gets the entries of `tmp` (inside it), all or none, replacing nothing.
    The caller holds the stop signals (`_signals_held`)."""
    moved: list[str] = []
    try:
        for name in sorted(os.listdir(tmp)):
            try:
                _move_no_replace(os.path.join(tmp, name), os.path.join(target, name))
            except FileExistsError:
                raise TargetError(f"{target} gained {name} while qpn was writing into it; qpn replaces "
                                  "nothing it did not write, so it wrote nothing there: write into an empty "
                                  "folder nobody else writes to") from None
            moved.append(name)
    except BaseException:
        for name in moved:  # ours: the same files, put back where the clean-up removes them
            os.rename(os.path.join(target, name), os.path.join(tmp, name))
        raise
    os.rmdir(tmp)
    fsync_dir(target)


def _swap(new: str, target: str, old: str, overwrite: bool, flag: str, ours: Ours | None) -> None:
    """Steps 3 and 4: `new` becomes `target`; a non-empty `target` ends up at `old`. The caller holds the
    stop signals (`_signals_held`), so none falls between the two renames."""
    if not os.path.lexists(target) or (os.path.isdir(target) and not os.listdir(target)):
        os.replace(new, target)  # POSIX rename also replaces an empty directory
        return
    # it may have changed while we were writing: the same rule again, just before the swap
    require_writable_target(target, overwrite, flag, ours=ours)
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
