"""Atomic writes: a whole file or a whole folder appears at its path complete, or not at all.

Files: write a temporary sibling, fsync, os.replace. Folders: fill a temporary sibling folder,
fsync, rename it into place; an existing folder is moved aside first and deleted only after the
new one is in place, so a failure at any point leaves the old folder (or nothing) and no
temporary. mkstemp / mkdtemp create 0600 / 0700 entries; what lands gets the modes a plain
open / mkdir would give under the current umask.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator


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


def write_json(path: str, value) -> None:
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


def require_writable_target(target: str, overwrite: bool, flag: str = "overwrite=True") -> None:
    """`target` may be absent or an empty folder; a non-empty folder needs `overwrite`."""
    if not os.path.isdir(os.path.dirname(target)):
        raise ValueError(f"the parent folder of {target} does not exist; create it first")
    if os.path.lexists(target):
        if os.path.islink(target) or not os.path.isdir(target):
            raise ValueError(f"{target} exists and is not a folder; choose another path")
        if os.listdir(target) and not overwrite:
            raise ValueError(f"{target} is a non-empty folder; pass {flag} to replace it atomically")


@contextlib.contextmanager
def atomic_folder(path, *, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary sibling folder to fill; on a normal exit it becomes `path`.

    Files directly inside get 0666 & ~umask, the folder 0777 & ~umask. On any exception the
    temporary folder is removed and `path` is untouched.
    """
    target = os.path.abspath(os.fspath(path))
    require_writable_target(target, overwrite)
    parent = os.path.dirname(target)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=parent)
    try:
        yield tmp
        umask = _umask()
        os.chmod(tmp, 0o777 & ~umask)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        fsync_dir(tmp)
        _install(tmp, target, overwrite)
        fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: str, target: str, overwrite: bool) -> None:
    """Move the finished folder `tmp` to `target`; an existing `target` ends up in `tmp` (or gone)."""
    if not os.path.lexists(target) or (os.path.isdir(target) and not os.listdir(target)):
        os.replace(tmp, target)  # POSIX rename also replaces an empty directory
        return
    if not overwrite:  # it filled up while we were writing
        raise ValueError(f"{target} became a non-empty folder during the write; pass overwrite=True to replace it")
    backup = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", suffix=".old", dir=os.path.dirname(target))
    os.rmdir(backup)  # reserve a unique name, then move the old folder there
    os.rename(target, backup)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(backup, target)
        raise
    os.rename(backup, tmp)  # the caller removes tmp, which now holds the old folder
