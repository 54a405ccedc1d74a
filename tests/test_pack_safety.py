"""Data safety of `qpn pack` / `save_checkpoint` and the command line's behaviour under signals and pipes
(issue 12, items 1, 6, 7, 11, 13): what --overwrite may replace, clean-up on SIGINT / SIGTERM /
SIGHUP, recovery after SIGKILL and after a kill inside the swap, `qpn verify | head`, and the
messages of a read-only or full output disk.

Signals and pipes are tested on real subprocesses; a test-only driver (DRIVER_HEAD below) makes the
command stop at a known point by wrapping one function, so no shipping code has a test hook. Each
side blocks until the other has done its part (a pipe, the driver's stdin): no sleeps, no deadlines,
and every child starts with default signal dispositions (conftest.start_child), as under `nohup`.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from qpn import ref
from qpn.apps import cli
from qpn.checkpoints import atomic, packed, safetensors_io
from qpn.ref import Checkpoint, NVFP4Linear

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import HANG_GUARD_S, start_child  # noqa: E402
from test_cli import build, float_weight, run, write  # noqa: E402  (the small checkpoints of every kind)

POSIX = pytest.mark.skipif(os.name != "posix", reason="POSIX signals and pipes")


def tree(root) -> dict[str, str]:
    """{relative path: sha256 or '->link' or 'dir'} of everything under root (the whole state a test must keep)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "->" + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def leftovers(folder) -> list[str]:
    return sorted(e for e in os.listdir(folder) if ".qpn-" in e)


def packed_folder(tmp_path, kind="nvfp4", name="out") -> str:
    os.makedirs(tmp_path, exist_ok=True)
    original = write(tmp_path, kind, name=f"src-{name}")
    out = str(tmp_path / name)
    assert cli.main(["pack", original, out, "-q"]) == 0
    return out


# ----------------------------------------------------------------------------------------------
# --overwrite replaces only a folder qpn wrote, never the source or what holds it


def _user_folder(root):
    os.makedirs(root / "mine")
    (root / "mine" / "thesis.tex").write_text("years of work")
    return root / "mine"


def _packed_plus_user_file(root):
    out = packed_folder(root, name="packed-plus")
    with open(os.path.join(out, "notes.txt"), "w") as f:
        f.write("mine")
    return out


def _link_to_packed(root):
    os.symlink(packed_folder(root, name="elsewhere"), root / "link")
    return root / "link"


def _link_to_parent(root):
    os.symlink(root, root / "up")
    return root / "up"


def _a_file(root):
    (root / "file.bin").write_bytes(b"\x00" * 8)
    return root / "file.bin"


# case -> (out path from (tmp root, source folder), words the one-line message must hold)
REFUSED = {
    "the parent of the source": (lambda root, src: root, "contains the source folder"),
    "the source itself": (lambda root, src: src, "is the folder"),
    "inside the source": (lambda root, src: os.path.join(src, "packed"), "is inside the source folder"),
    "a link to the parent": (lambda root, src: _link_to_parent(root), "contains the source folder"),
    "a user's folder": (lambda root, src: _user_folder(root), "has no qpn_manifest.json"),
    "a packed folder with a user's file": (lambda root, src: _packed_plus_user_file(root), "notes.txt"),
    "a symbolic link to a packed folder": (lambda root, src: _link_to_packed(root), "symbolic link"),
    "a file": (lambda root, src: _a_file(root), "not a folder"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_overwrite_refuses_anything_qpn_did_not_write_and_touches_nothing(tmp_path, capsys, case):
    src = write(tmp_path, "nvfp4")
    out_of, words = REFUSED[case]
    out = out_of(tmp_path, src)
    before = tree(tmp_path)
    code, out_text, err = run(["pack", src, out, "--overwrite"], capsys)
    assert code == 2 and words in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert tree(tmp_path) == before  # the source, the folder and every other file are untouched


def test_pack_into_the_parent_folder_with_a_relative_path(tmp_path, capsys, monkeypatch):
    """The reported case: `qpn pack ./model . --overwrite` deleted the model and every file next to it."""
    src = write(tmp_path, "fp8-tensor")
    (tmp_path / "other.txt").write_text("keep")
    before = tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["pack", os.path.join(".", os.path.basename(src)), ".", "--overwrite"], capsys)
    assert code == 2 and "contains the source folder" in err and tree(tmp_path) == before


def test_overwrite_replaces_a_packed_folder_and_fills_an_empty_one(tmp_path, capsys):
    out = packed_folder(tmp_path, "nvfp4")
    fp8 = write(tmp_path, "fp8-tensor")
    code, text, err = run(["pack", fp8, out, "--overwrite"], capsys)
    assert code == 0 and err == "" and "FP8 -> QPN8" in text and leftovers(tmp_path) == []
    os.makedirs(tmp_path / "empty")
    assert run(["pack", fp8, tmp_path / "empty"], capsys)[0] == 0


def test_save_checkpoint_overwrites_only_its_own_folders(tmp_path):
    ours = tmp_path / "ours"
    ref.save_checkpoint(ours, build("nvfp4"))
    ref.save_checkpoint(ours, build("fp8-tensor"), overwrite=True)  # marked by qpn: replaced
    assert ref.load_checkpoint(ours).quant_algo == "FP8"

    theirs = tmp_path / "theirs"  # the same files, but written by someone else (no "writer": "qpn" mark)
    os.makedirs(theirs)
    for file in os.listdir(ours):
        data = open(ours / file, "rb").read()
        if file.endswith(".safetensors"):
            contents = ref.read_safetensors(ours / file)
            safetensors_io.write_safetensors(theirs / file, contents.tensors, {"format": "pt"})
        else:
            (theirs / file).write_bytes(data)
    extra = tmp_path / "extra"  # qpn's folder plus a user's file
    ref.save_checkpoint(extra, build("nvfp4"))
    (extra / "README.md").write_text("mine")
    for folder, words in ((theirs, "lacks save_checkpoint's mark"), (extra, "README.md")):
        before = tree(tmp_path)
        with pytest.raises(ValueError, match=words):
            ref.save_checkpoint(folder, build("nvfp4"), overwrite=True)
        assert tree(tmp_path) == before


# ----------------------------------------------------------------------------------------------
# signals during `qpn pack` (a real subprocess stopped at a known point)

# The driver runs `qpn ARGV` with one function wrapped to call wait_here() at the point under test:
# it tells the test (a line on the pipe READY_FD) and reads its stdin, so the test's signal arrives
# inside that read (a blocked read is where Linux delivers a signal sent to the process); closing
# stdin (communicate()) lets the command go on.
DRIVER_HEAD = """
import os, shutil, sys
from qpn.apps import cli
from qpn.checkpoints import atomic, packed, safetensors_io
ready_fd, argv = int(sys.argv[1]), sys.argv[2:]
def wait_here():
    os.write(ready_fd, b"ready\\n")
    os.read(0, 1)
"""
DRIVERS = {  # where the command waits -> the wrapping
    "first file write": """
real = safetensors_io.write_safetensors
def write_then_wait(path, *args, **kwargs):  # the temporary folder exists and holds a file
    real(path, *args, **kwargs)
    wait_here()
safetensors_io.write_safetensors = write_then_wait  # the writer qpn pack calls
""",
    "swap": """
real = os.rename
def rename_then_wait(a, b):  # the old output is aside, the new one not yet in
    real(a, b)
    if str(b).endswith(".old"):
        wait_here()
atomic.os.rename = rename_then_wait
""",
    "removal of the old output": """
real = shutil.rmtree
def wait_then_remove(path, *args, **kwargs):  # the new output is in place, the old one not yet removed
    if str(path).endswith(".old"):
        wait_here()
    real(path, *args, **kwargs)
shutil.rmtree = wait_then_remove
""",
    "summary": """
real = packed.source_extras
def extras_then_wait(folder):  # cli's last step (the packer calls its own binding): the summary is printed
    wait_here()
    return real(folder)
packed.source_extras = extras_then_wait
""",
}


def start_pack(where: str, *argv) -> subprocess.Popen:
    """`qpn pack ARGV -q` in a subprocess, once it waits at `where` (DRIVERS)."""
    driver = textwrap.dedent(DRIVER_HEAD) + DRIVERS[where] + "sys.exit(cli.main(argv))\n"
    read_end, write_end = os.pipe()
    proc = start_child([sys.executable, "-c", driver, str(write_end), "pack", *map(str, argv), "-q"],
                       pass_fds=(write_end,), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    os.close(write_end)  # the child holds the only write end: EOF if it ends before `where`
    with os.fdopen(read_end) as ready:
        reached = ready.readline()
    assert reached == "ready\n", proc.communicate(timeout=HANG_GUARD_S)
    return proc


@POSIX
@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_stop_signal_removes_the_temporary_folder_and_exits_128_plus_the_signal(tmp_path, signame, code):
    src = write(tmp_path, "nvfp4", sharded=True)
    work = tmp_path / "work"
    os.makedirs(work)
    proc = start_pack("first file write", src, work / "out")
    assert leftovers(work)  # the write is in progress
    proc.send_signal(getattr(signal, signame))
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == code, err
    assert ("interrupted" if signame == "SIGINT" else f"stopped by {signame}") in err and "Traceback" not in err
    assert os.listdir(work) == []  # no temporary, no output


@POSIX
def test_after_sigkill_the_next_run_removes_the_stale_temporary_and_says_so(tmp_path, capsys):
    src = write(tmp_path, "nvfp4", sharded=True)
    work = tmp_path / "work"
    os.makedirs(work)
    proc = start_pack("first file write", src, work / "out")
    proc.kill()
    proc.communicate(timeout=HANG_GUARD_S)
    stale = leftovers(work)
    assert len(stale) == 1 and f".qpn-{proc.pid}-" in stale[0] and stale[0].endswith(".tmp")
    code, _, err = run(["pack", src, work / "out"], capsys)
    assert code == 0 and "removed the unfinished temporary folder" in err and f"process {proc.pid}" in err
    assert os.listdir(work) == ["out"]


# ----------------------------------------------------------------------------------------------
# a kill inside the --overwrite swap is finished or rolled back by the next run


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process
    return proc.pid


def _copy(src, dst):
    shutil.copytree(src, dst)


# crash point -> (stages present {stage: "old" | "new" | "partial"}, target holds "old" | "new" | None,
#                 what the target must hold after recovery)
CRASH_POINTS = {
    "while filling the temporary (1)": ({"tmp": "partial"}, "old", "old"),
    "after marking it complete (2)": ({"new": "new"}, "old", "old"),
    "between moving the old aside and the new in (3-4)": ({"new": "new", "old": "old"}, None, "new"),
    "while removing the old folder (5)": ({"old": "old"}, "new", "new"),
    "old aside, new lost": ({"old": "old"}, None, "old"),
    "first write, complete, not yet renamed": ({"new": "new"}, None, "new"),
}


@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_the_next_write_finishes_or_rolls_back_an_interrupted_swap(tmp_path, capsys, point):
    stages, target_holds, expected = CRASH_POINTS[point]
    versions = {"old": packed_folder(tmp_path / "v", "nvfp4", name="old"),
                "new": packed_folder(tmp_path / "v", "fp8-tensor", name="new")}
    trees = {key: tree(path) for key, path in versions.items()}
    work = tmp_path / "work"
    os.makedirs(work)
    pid = dead_pid()
    for stage, content in stages.items():
        path = work / f".out.qpn-{pid}-abc123_x.{stage}"
        if content == "partial":
            os.makedirs(path)
            (path / "model.safetensors").write_bytes(b"half")
        else:
            _copy(versions[content], path)
    if target_holds:
        _copy(versions[target_holds], work / "out")
    src = write(tmp_path, "nvfp4", name="unrelated")
    code, _, err = run(["pack", src, work / "another"], capsys)  # any write into the folder recovers it
    assert code == 0 and f"process {pid}" in err
    assert sorted(os.listdir(work)) == ["another", "out"] and tree(work / "out") == trees[expected]


def test_recovery_leaves_the_work_of_a_running_process_alone(tmp_path):
    work = tmp_path / "work"
    os.makedirs(work / f".out.qpn-{os.getppid()}-abc123_x.old")  # the test runner's parent is running
    os.makedirs(work / f".out.qpn-{os.getpid()}-abc123_y.tmp")  # this very process
    assert atomic.recover_interrupted(str(work), report=lambda _: None) == []
    assert len(leftovers(work)) == 2


def _signal_from_another_thread(signum: int) -> None:
    """Deliver `signum` to a second thread, as the kernel does when the main thread blocks it.

    The thread signals itself (pthread_kill), so the C-level handler has run, and Python has
    marked the signal for the main thread, before the thread ends: once join() returns, the main
    thread runs the Python handler at its next bytecode. No timing is involved.
    """
    thread = threading.Thread(target=lambda: signal.pthread_kill(threading.get_ident(), signum))
    thread.start()
    thread.join()


@POSIX
@pytest.mark.parametrize("signame, raised", [("SIGINT", KeyboardInterrupt), ("SIGTERM", cli.Stopped),
                                             ("SIGHUP", cli.Stopped)])
def test_a_signal_during_the_swap_is_held_until_the_swap_is_done(tmp_path, monkeypatch, default_signal_handlers,
                                                                  signame, raised):
    """Steps 3 and 4 hold SIGINT / SIGTERM / SIGHUP: one that comes between them (delivered to another
    thread, as in any process with numpy's or torch's threads) acts after both, and the output is there.
    (The library's rule, without a commit callback; `qpn pack` exits 0 then: the next tests.)"""
    out = packed_folder(tmp_path, "nvfp4")
    real_rename = os.rename
    seen = []

    def rename_and_interrupt(a, b):
        real_rename(a, b)
        if str(b).endswith(".old"):  # the old folder is aside: the worst moment for a stop signal
            _signal_from_another_thread(getattr(signal, signame))
            seen.append(os.path.isdir(out))

    monkeypatch.setattr(atomic.os, "rename", rename_and_interrupt)
    with pytest.raises(raised), cli._stop_signals_raise():  # the handlers `qpn pack` runs under
        packed.pack_checkpoint(write(tmp_path, "fp8-tensor"), out, overwrite=True)
    assert seen == [False]  # the signal came while the output path was empty
    assert packed.load_packed(out).quant_algo == "FP8" and leftovers(tmp_path) == []


@POSIX
@pytest.mark.parametrize("where", ["swap", "removal of the old output"])
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_after_the_old_output_is_aside_lets_the_pack_finish_and_exit_0(tmp_path, signame, where):
    """The issue's reproduction, end to end: `qpn pack SRC OUT --overwrite` in a subprocess (with numpy's
    threads) gets a stop signal while OUT is aside or while its previous version is removed. The swap
    is its commit point: it finishes the removal, says so once, prints its summary and exits 0; no
    hidden copy is left."""
    out = packed_folder(tmp_path, "nvfp4")
    proc = start_pack(where, write(tmp_path, "fp8-tensor"), out, "--overwrite")
    proc.send_signal(getattr(signal, signame))
    text, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, err
    assert err == f"qpn: {signame}: {out} is already replaced; removing its previous version first\n"
    assert text.startswith("packed 2 layers (2 FP8 -> QPN8)")
    assert packed.load_packed(out).quant_algo == "FP8" and leftovers(tmp_path) == []


@POSIX
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_after_the_summary_is_printed_is_only_noted(tmp_path, signame):
    """After the commit point the command's result is success: a signal while it prints its summary
    (it exited 130 silently) is noted, and the command exits 0 with the output in place."""
    out = packed_folder(tmp_path, "nvfp4")
    proc = start_pack("summary", write(tmp_path, "fp8-tensor"), out, "--overwrite")
    proc.send_signal(getattr(signal, signame))
    text, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0 and err == "", err
    assert text.startswith("packed 2 layers (2 FP8 -> QPN8)")
    assert packed.load_packed(out).quant_algo == "FP8" and leftovers(tmp_path) == []


def test_a_previous_version_that_cannot_be_removed_is_named_with_its_size(tmp_path, capsys, monkeypatch):
    """A failed removal leaves a hidden folder as large as the model: the pack has succeeded (exit 0),
    and stderr says where that folder is and how large."""
    out = packed_folder(tmp_path, "nvfp4")
    real_rmtree = shutil.rmtree

    def refuse_the_old_folder(path, ignore_errors=False, *args, **kwargs):
        if not str(path).endswith(".old"):
            return real_rmtree(path, ignore_errors, *args, **kwargs)
        if not ignore_errors:  # as rmtree does on a folder it may not empty
            raise PermissionError(errno.EACCES, "Permission denied", os.path.join(path, "model.safetensors"))

    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    monkeypatch.setattr(atomic.shutil, "rmtree", refuse_the_old_folder)
    code, text, err = run(["pack", write(tmp_path, "fp8-tensor"), out, "--overwrite", "-q"], capsys)
    assert code == 0 and text.startswith("packed 2 layers"), err
    [old] = leftovers(tmp_path)
    assert old.endswith(".old") and packed.load_packed(out).quant_algo == "FP8"
    assert err == (f"qpn: could not remove the previous version of {out} (Permission denied): "
                   f"{tmp_path / old} is left, {size:,} bytes; remove it yourself (the next qpn write into that "
                   "folder also removes it)\n")


def test_a_name_too_long_is_told_to_be_shorter(tmp_path, capsys):
    """ENAMETOOLONG's fix is a shorter name, not the disk or the folder's permissions."""
    code, _, err = run(["pack", write(tmp_path, "nvfp4"), tmp_path / ("x" * 256), "-q"], capsys)
    assert code == 2 and "File name too long" in err and "choose a shorter name" in err, err
    assert "permissions" not in err and leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# output names up to the file system's 255 bytes, and a mount point as the output


@pytest.mark.parametrize("length", [229, 240, 255])
def test_an_output_name_of_up_to_255_bytes_packs_and_overwrites(tmp_path, capsys, length):
    src = write(tmp_path, "nvfp4")
    out = tmp_path / ("é" + "n" * (length - 2))  # a 2-byte character: the limit is in bytes, the cut in characters
    assert len(os.fsencode(out.name)) == length
    assert run(["pack", src, out, "-q"], capsys)[0] == 0
    code, _, err = run(["pack", write(tmp_path, "fp8-tensor"), out, "--overwrite", "-q"], capsys)
    assert code == 0, err
    assert packed.load_packed(str(out)).quant_algo == "FP8" and leftovers(tmp_path) == []


@pytest.mark.parametrize("point", ["between moving the old aside and the new in (3-4)", "old aside, new lost"])
def test_an_interrupted_swap_of_a_long_name_is_recovered_from_its_name_file(tmp_path, capsys, point):
    """A 255-byte name's work names are abbreviated; the dead process's `.name` file gives the target back."""
    stages, _, expected = CRASH_POINTS[point]
    versions = {"old": packed_folder(tmp_path / "v", "nvfp4", name="old"),
                "new": packed_folder(tmp_path / "v", "fp8-tensor", name="new")}
    work = tmp_path / "work"
    os.makedirs(work)
    name, pid = "x" * 255, dead_pid()
    base = work / f".{atomic._work_stem(name)}.qpn-{pid}-abc123_x"
    assert len(os.fsencode(base.name + ".name")) <= 255
    for stage, content in stages.items():
        _copy(versions[content], f"{base}.{stage}")
    (work / f"{base.name}.name").write_text(name)
    code, _, err = run(["pack", write(tmp_path, "nvfp4", name="unrelated"), work / "another"], capsys)
    assert code == 0 and f"process {pid}" in err
    assert sorted(os.listdir(work)) == ["another", name] and tree(work / name) == tree(versions[expected])


def _mount(kind: str, target) -> None:
    """A real mount (root in a mount namespace: this machine and its CI); a plain user cannot."""
    args = ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(target)] if kind == "tmpfs" \
        else ["mount", "--bind", str(target), str(target)]
    if os.geteuid() != 0:
        pytest.skip("mounting needs root (this machine's and CI's sandbox run as root)")
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 0, f"root cannot mount here: {done.stderr.strip()}"


@POSIX
@pytest.mark.parametrize("kind", ["tmpfs", "bind"])  # another disk; a folder of the same disk (a Docker volume)
def test_an_empty_mount_point_is_filled_in_place(tmp_path, capsys, kind):
    target = tmp_path / "volume"
    os.makedirs(target)
    _mount(kind, target)
    try:
        assert atomic.is_mount_point(str(target))
        src = write(tmp_path, "nvfp4")
        code, _, err = run(["pack", src, target, "-q"], capsys)
        assert code == 0, err
        assert atomic.is_mount_point(str(target)) and leftovers(target) == [] and leftovers(tmp_path) == []
        assert packed.load_packed(str(target)).quant_algo == "NVFP4"
        code, _, err = run(["pack", src, target, "--overwrite", "-q"], capsys)  # a mount point is never swapped
        assert code == 2 and "is a mount point that is not empty" in err and "Traceback" not in err
    finally:
        subprocess.run(["umount", str(target)], check=True)


@POSIX
def test_a_failed_fill_of_a_mount_point_leaves_it_empty(tmp_path, monkeypatch):
    target = tmp_path / "volume"
    os.makedirs(target)
    _mount("tmpfs", target)
    try:
        real_link = os.link
        links = []

        def fail_on_the_second_entry(a, b):
            links.append(b)
            if len(links) == 2:
                raise OSError(errno.EIO, "Input/output error", b)
            real_link(a, b)

        monkeypatch.setattr(atomic.os, "link", fail_on_the_second_entry)
        with pytest.raises(OSError, match="cannot write"):
            packed.pack_checkpoint(write(tmp_path, "nvfp4", sharded=True), str(target))
        assert os.listdir(target) == [] and len(links) == 2
    finally:
        subprocess.run(["umount", str(target)], check=True)


@POSIX
def test_a_file_that_appears_in_the_mount_point_during_the_fill_is_never_replaced(tmp_path, capsys, monkeypatch):
    """Someone writes into the volume while qpn packs: qpn's entry of the same name is not moved over it."""
    target = tmp_path / "volume"
    os.makedirs(target)
    _mount("bind", target)
    try:
        real_fill = atomic._fill

        def a_user_writes_first(tmp, into):
            (target / "config.json").write_text("the user's")
            real_fill(tmp, into)

        monkeypatch.setattr(atomic, "_fill", a_user_writes_first)
        code, _, err = run(["pack", write(tmp_path, "nvfp4"), target, "-q"], capsys)
        assert code == 2 and "gained config.json" in err and "Traceback" not in err
        assert os.listdir(target) == ["config.json"] and (target / "config.json").read_text() == "the user's"
    finally:
        subprocess.run(["umount", str(target)], check=True)


# ----------------------------------------------------------------------------------------------
# a closed pipe: `qpn verify | head -3`


@POSIX
@pytest.mark.parametrize("unbuffered", ["", "1"])  # PYTHONUNBUFFERED split print()'s text and newline: a race
def test_verify_into_a_closed_pipe_stops_early_and_quietly(tmp_path, unbuffered):
    layers = {}
    for i in range(16):
        q = ref.nvfp4_quantize(float_weight(f"l{i}", 32, 64))
        name = f"model.layers.{i}.proj"
        layers[name] = NVFP4Linear(name, q.weight_packed, q.weight_scale, q.weight_scale_2)
    src = tmp_path / "ckpt"
    ref.save_checkpoint(src, Checkpoint("modelopt", "NVFP4", layers, {}, {}))
    log = tmp_path / "verified"
    driver = textwrap.dedent("""
        import os, sys
        from qpn.apps import cli, verify
        log, argv = sys.argv[1], sys.argv[2:]
        real = verify.verify_layer
        def counted(name, *args):
            if not os.path.exists(log):  # the first layer: the report's head is out; wait until head has left
                os.read(0, 1)
            with open(log, "a") as f:
                f.write(name + "\\n")
            return real(name, *args)
        verify.verify_layer = counted
        sys.exit(cli.main(argv))
    """)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    qpn = start_child([sys.executable, "-c", driver, str(log), "verify", str(src)], stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      env={**env, **({"PYTHONUNBUFFERED": unbuffered} if unbuffered else {})})
    head = subprocess.run(["head", "-3"], stdin=qpn.stdout, capture_output=True, timeout=HANG_GUARD_S)
    qpn.stdout.close()  # head has left, and the test's copy of the read end is closed: no reader remains
    _, err = qpn.communicate(timeout=HANG_GUARD_S)  # closes stdin: the first layer goes on
    assert len(head.stdout.decode().splitlines()) == 3
    assert qpn.returncode == 141 and err == b"", err  # 128 + SIGPIPE, as a CLI killed by SIGPIPE; no message
    assert len(log.read_text().splitlines()) == 1  # stopped at the first row after head left


def test_a_report_block_goes_out_in_one_write(monkeypatch):
    """What the race above needs: qpn verify's head block (and each row) is one write to stdout, so a reader
    that leaves after N lines cannot fall between a text and its newline (print() writes them apart when
    PYTHONUNBUFFERED is set: CI's and users' shells may set it)."""
    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stdout", Recorder())
    cli._print_lines(["qpn verify x", "backends:", "layer | ..."])
    assert writes == ["qpn verify x\nbackends:\nlayer | ...\n"]


# ----------------------------------------------------------------------------------------------
# the messages of a read-only or full output disk


def test_a_read_only_output_folder_is_named_not_the_hidden_temporary(tmp_path, capsys, monkeypatch):
    src = write(tmp_path, "nvfp4")

    def denied(prefix="", suffix="", dir=None):  # what mkdtemp raises in a folder without write permission
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir, f"{prefix}abcdefgh{suffix}"))

    monkeypatch.setattr(atomic.tempfile, "mkdtemp", denied)  # (root ignores chmod 0555, so simulate it)
    code, _, err = run(["pack", src, tmp_path / "out"], capsys)
    assert code == 2 and f"cannot write {tmp_path / 'out'}: Permission denied" in err
    assert ".qpn-" not in err and ".tmp" not in err and "choose a folder you can write to" in err


def test_a_full_disk_names_the_output_and_keeps_the_old_folder(tmp_path, capsys, monkeypatch):
    out = packed_folder(tmp_path, "nvfp4")
    fp8 = write(tmp_path, "fp8-tensor")
    before = tree(out)

    def full(f, tensor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors_io, "_write_tensor_bytes", full)
    code, _, err = run(["pack", fp8, out, "--overwrite"], capsys)
    assert code == 2 and f"cannot write {out}: No space left on device" in err and "free space" in err
    assert tree(out) == before and leftovers(tmp_path) == []


def test_one_layer_is_singular(tmp_path, capsys):
    q = ref.nvfp4_quantize(float_weight("one", 32, 64))
    src = tmp_path / "one"
    ref.save_checkpoint(src, Checkpoint("modelopt", "NVFP4", {"proj": NVFP4Linear("proj", q.weight_packed,
                                                                                  q.weight_scale,
                                                                                  q.weight_scale_2)}, {}, {}))
    code, text, _ = run(["pack", src, tmp_path / "out"], capsys)
    assert code == 0 and "packed 1 layer (" in text and "copied 0 tensors" in text
    code, text, _ = run(["inspect", tmp_path / "out"], capsys)
    assert "1 quantized layer (" in text and "1 quantized layer," in text
    code, text, _ = run(["verify", tmp_path / "out"], capsys)
    assert code == 0 and "1 of 1 layer ok" in text and "1 layers" not in text


def test_a_compressed_tensors_config_entry_is_called_an_entry(tmp_path, capsys):
    src = write(tmp_path, "ct-nvfp4")
    config_path = os.path.join(src, "config.json")
    config = json.load(open(config_path))
    group = next(iter(config["quantization_config"]["config_groups"]))
    config["quantization_config"]["config_groups"][group]["weights"]["num_bits"] = 8
    with open(config_path, "w") as f:
        json.dump(config, f)
    code, _, err = run(["inspect", src], capsys)
    assert code == 2 and f"config entry 'config_groups.{group}.weights.num_bits'" in err and "tensor '" not in err


def test_a_mistyped_bench_argument_is_bad_input(capsys):
    code, _, err = run(["bench", "--quikc"], capsys)
    assert code == 2 and "unrecognized arguments: --quikc" in err
    code, _, err = run(["bench", "decode", "--shapez", "1x1"], capsys)
    assert code == 2 and "qpn bench decode" in err


def test_exit_codes_are_documented_in_help(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "130 Ctrl-C" in text and "143 SIGTERM" in text
