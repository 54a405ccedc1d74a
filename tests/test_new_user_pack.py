"""What a new user runs into with `qpn pack` and `qpn demo` (issue 20, item 4):

- a source shard that changes while `qpn pack` reads it (truncated, or rewritten in place) is bad
  input - exit 2, one message naming the file, no temporary folder left - never a SIGBUS;
- `qpn demo --keep DIR` checks DIR before the model loads, and its messages name `--keep`,
  never an API argument (`overwrite=True`);
- `qpn pack` copies every file of the source that is not a weight file (tokenizer, generation
  config, chat template, ...) and lists it in the manifest, so the packed folder stands alone.

Changes under a running pack are made at known points by test-only drivers that wrap a function
qpn calls (the pattern of tests/test_pack_safety.py): no sleeps, no races. A file truncated under a
memory map kills the process, so the first cases run the pack in a subprocess.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import tempfile
import textwrap

import pytest

from qpn import ref
from qpn.apps import cli, demo
from qpn.checkpoints import packed, safetensors_io

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import run_child  # noqa: E402
from test_cli import run, write  # noqa: E402  (the small checkpoints of every kind)
from test_pack_safety import leftovers, tree  # noqa: E402

POSIX = pytest.mark.skipif(os.name != "posix", reason="POSIX file semantics (truncate under a reader, FIFOs)")
OLD = 946_684_800  # 2000-01-01: the source's mtime before a change, so any change moves it (no clock race)


def shards(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


# ----------------------------------------------------------------------------------------------
# a source file that changes while qpn pack reads it

# Changes the first source shard the first time qpn pack prepacks a layer (its tensors are read by
# then, the other layers' and the copied tensors are not): "truncate" empties it as `> file` does,
# "header" cuts it after its header, "rewrite" overwrites its data in place (same size).
CHANGE_DRIVER = textwrap.dedent("""
    import os, sys
    from qpn.apps import cli
    from qpn.checkpoints import packed, safetensors_io
    victim, how, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    real = packed.write.prepack_layer  # the name qpn pack calls
    done = []
    def change_then_prepack(linear):
        if not done:
            done.append(True)
            if how == "truncate":
                os.truncate(victim, 0)
            elif how == "header":
                os.truncate(victim, safetensors_io.read_safetensors_header(victim).data_start)
            else:
                header = safetensors_io.read_safetensors_header(victim)
                with open(victim, "r+b") as f:
                    f.seek(header.data_start)
                    f.write(bytes(header.file_size - header.data_start))
        return real(linear)
    packed.write.prepack_layer = change_then_prepack
    sys.exit(cli.main(argv))
""")


@POSIX
@pytest.mark.parametrize("how", ["truncate", "header", "rewrite"])
def test_a_source_shard_changed_during_pack_is_bad_input_not_a_crash(tmp_path, how):
    src = write(tmp_path, "nvfp4", sharded=True)
    victim = os.path.join(src, shards(src)[0])
    os.utime(victim, (OLD, OLD))
    work = tmp_path / "work"
    os.makedirs(work)
    proc = run_child([sys.executable, "-c", CHANGE_DRIVER, victim, how, "pack", src, work / "out", "-q"],
                     capture_output=True, text=True)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)  # was -7 (SIGBUS) for a truncation, 0 for a rewrite
    err = proc.stderr
    assert err.startswith("qpn pack: error: ") and victim in err and "changed while qpn" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert os.listdir(work) == []  # no output, no temporary folder


def _reads_of_a_pack(tmp_path, src) -> int:
    """How many tensor reads a pack of `src` makes (a dry run)."""
    calls = []
    real = safetensors_io.SafetensorsFile.read

    def counted(self, name):
        calls.append(name)
        return real(self, name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(safetensors_io.SafetensorsFile, "read", counted)
        packed.pack_checkpoint(src, tmp_path / "dry")
    return len(calls)


@POSIX
def test_a_truncation_before_any_tensor_read_is_bad_input(tmp_path, capsys, monkeypatch):
    """Every read of the pack, in turn, finds its shard truncated: each stops the pack the same way."""
    src = write(tmp_path, "fp8-block", sharded=True)
    total = _reads_of_a_pack(tmp_path, src)
    assert total > len(shards(src))
    copies = tmp_path / "copies"
    real = safetensors_io.SafetensorsFile.read
    for nth in range(total):
        source = str(copies / f"src{nth}")
        os.makedirs(copies, exist_ok=True)
        shutil.copytree(src, source)
        count = []

        def truncate_then_read(self, name, nth=nth, count=count):
            if len(count) == nth:
                os.truncate(self.path, self.header.data_start + 1)
            count.append(name)
            return real(self, name)

        monkeypatch.setattr(safetensors_io.SafetensorsFile, "read", truncate_then_read)
        out = copies / f"out{nth}"
        code, _, err = run(["pack", source, out, "-q"], capsys)
        monkeypatch.undo()
        assert code == 2 and "changed while qpn" in err and "Traceback" not in err, (nth, err)
        assert not out.exists() and leftovers(copies) == [], nth


def test_a_truncation_while_pack_hashes_a_shard_is_bad_input(tmp_path, capsys, monkeypatch):
    src = write(tmp_path, "nvfp4", sharded=True)
    real = safetensors_io.SafetensorsFile.sha256

    def truncate_then_hash(self, progress=None):
        os.truncate(self.path, self.stamp.size // 2)
        return real(self, progress)

    monkeypatch.setattr(safetensors_io.SafetensorsFile, "sha256", truncate_then_hash)
    code, _, err = run(["pack", src, tmp_path / "out"], capsys)
    assert code == 2 and os.path.join(src, shards(src)[0]) in err and "changed while qpn" in err, err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_pack_never_memory_maps_its_source(tmp_path, monkeypatch):
    src = write(tmp_path, "mixed", sharded=True)

    def no_map(*args, **kwargs):
        raise AssertionError("qpn pack memory-mapped a source file")

    monkeypatch.setattr(safetensors_io.np, "memmap", no_map)
    packed.pack_checkpoint(src, tmp_path / "out")
    monkeypatch.undo()
    assert packed.load_packed(tmp_path / "out").quant_algo == "MIXED_PRECISION"


def test_the_reader_names_a_file_that_changed_after_it_was_opened(tmp_path):
    src = write(tmp_path, "nvfp4")
    path = os.path.join(src, "model.safetensors")
    os.utime(path, (OLD, OLD))
    with safetensors_io.SafetensorsFile(path) as f:
        names = list(f.header.tensors)
        first = f.read(names[0])
        assert not first.array.flags.writeable
        with open(path, "r+b") as g:  # same size, new bytes
            g.seek(f.header.data_start)
            g.write(b"\x01")
        with pytest.raises(safetensors_io.SafetensorsError, match="changed while qpn"):
            f.read(names[1])
    with safetensors_io.SafetensorsFile(path) as f:
        os.truncate(path, f.header.data_start)
        with pytest.raises(safetensors_io.SafetensorsError, match=f"{path}: .*changed while qpn"):
            f.read(names[-1])


# ----------------------------------------------------------------------------------------------
# qpn demo --keep: checked before the model loads, in the command line's words


@pytest.fixture
def no_model(monkeypatch):
    """The demo's model load fails loudly: a test passes only if --keep was refused before it."""

    def load_minilm(device="cpu"):
        raise AssertionError("the model was loaded before --keep was checked")

    monkeypatch.setattr(demo, "load_minilm", load_minilm)


def _user_checkpoint_folder(keep):
    os.makedirs(keep / "minilm-nvfp4")
    (keep / "minilm-nvfp4" / "thesis.tex").write_text("years of work")
    return keep


KEEP_REFUSED = {  # case -> (--keep path from the tmp root, words the message must hold)
    "a file": (lambda root: (root / "file.txt").write_text("x") and root / "file.txt", "is not a folder"),
    "a path under a file": (lambda root: (root / "file.txt").write_text("x") and root / "file.txt" / "sub",
                            "is a file"),
    "a folder holding a user's minilm-nvfp4": (lambda root: _user_checkpoint_folder(root / "keep"), "minilm-nvfp4"),
}


@pytest.mark.parametrize("case", list(KEEP_REFUSED))
def test_demo_keep_is_checked_before_the_model_loads(tmp_path, capsys, no_model, case):
    make, words = KEEP_REFUSED[case]
    keep = make(tmp_path)
    before = tree(tmp_path)
    code, out, err = run(["demo", "--keep", keep, "-q"], capsys)
    assert code == 2, err
    assert err.startswith("qpn demo: error: --keep ") and str(keep) in err and words in err, err
    assert "overwrite=True" not in err and "[Errno" not in err and len(err.strip().splitlines()) == 1, err
    assert out == "" and tree(tmp_path) == before


@pytest.mark.parametrize("errno_, words", [(errno.EROFS, "choose a folder on a writable disk"),
                                           (errno.EACCES, "choose a folder you can write to")])
def test_demo_keep_on_a_read_only_disk_is_refused_before_the_model_loads(tmp_path, capsys, no_model, monkeypatch,
                                                                          errno_, words):
    def cannot(prefix="", suffix="", dir=None):  # what mkdtemp raises there (root ignores chmod: simulate it)
        raise OSError(errno_, os.strerror(errno_), os.path.join(dir, f"{prefix}abcdefgh{suffix}"))

    monkeypatch.setattr(tempfile, "mkdtemp", cannot)
    for keep in (tmp_path / "keep", tmp_path / "exists"):
        if keep.name == "exists":
            os.makedirs(keep)
        code, _, err = run(["demo", "--keep", keep], capsys)
        assert code == 2 and err.startswith(f"qpn demo: error: --keep {keep}: ") and words in err, err
        assert os.strerror(errno_) in err and "[Errno" not in err and ".qpn" not in err, err
    assert not (tmp_path / "keep").exists()


def test_demo_keep_accepts_its_own_earlier_output_and_new_paths(tmp_path, capsys, no_model):
    keep = tmp_path / "keep"
    os.makedirs(keep)
    (keep / "notes.txt").write_text("the user's, next to the demo's folders: left alone")
    for fmt, kind in (("nvfp4", "nvfp4"), ("fp8", "fp8-tensor")):
        ref.save_checkpoint(keep / f"minilm-{fmt}", __import__("test_cli").build(kind))
        packed.pack_checkpoint(keep / f"minilm-{fmt}", keep / f"minilm-{fmt}-qpn")
    for path in (keep, tmp_path / "new" / "deeper"):
        with pytest.raises(AssertionError, match="model was loaded"):
            cli.main(["demo", "--keep", str(path), "-q"])
    assert not (tmp_path / "new").exists()  # checking created nothing


# ----------------------------------------------------------------------------------------------
# qpn pack copies the files that are not weights

EXTRA_FILES = {
    "tokenizer.json": json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}),
    "tokenizer_config.json": json.dumps({"model_max_length": 2048, "chat_template": "{{ messages }}"}),
    "generation_config.json": json.dumps({"do_sample": False, "eos_token_id": 2}),
    "special_tokens_map.json": json.dumps({"eos_token": "</s>"}),
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}\n",
    "README.md": "# my quantized model\n",
    "tokenizer.model": bytes(range(256)) * 40,
}


def source_with_extras(tmp_path, kind="nvfp4", sharded=True) -> str:
    src = write(tmp_path, kind, sharded=sharded)
    for name, text in EXTRA_FILES.items():
        mode = "wb" if isinstance(text, bytes) else "w"
        with open(os.path.join(src, name), mode) as f:
            f.write(text)
    outside = tmp_path / "vocab-elsewhere.txt"  # a link to a file outside the folder (HF cache snapshots)
    outside.write_text("a\nb\n")
    os.symlink(outside, os.path.join(src, "vocab.txt"))
    os.makedirs(os.path.join(src, "original"))  # subfolders and hidden files are not copied
    (tmp_path / os.path.basename(src) / "original" / "params.json").write_text("{}")
    (tmp_path / os.path.basename(src) / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    return src


COPIED = sorted([*EXTRA_FILES, "vocab.txt"])


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_pack_copies_every_file_that_is_not_a_weight(tmp_path, capsys):
    src = source_with_extras(tmp_path)
    out = tmp_path / "out"
    code, text, err = run(["pack", src, out, "-q"], capsys)
    assert code == 0, err
    listing = sorted(os.listdir(out))
    assert set(COPIED) <= set(listing) and "original" not in listing and ".gitattributes" not in listing
    for name in COPIED:
        assert not os.path.islink(out / name) and sha(out / name) == sha(os.path.join(src, name)), name
    manifest = json.load(open(out / packed.MANIFEST_FILE))
    assert manifest["copied_files"] == {name: {"sha256": sha(os.path.join(src, name)),
                                              "size": os.path.getsize(os.path.join(src, name))} for name in COPIED}
    assert all(manifest["source"]["files"][name] == sha(os.path.join(src, name)) for name in COPIED)
    assert f"and {len(COPIED)} other files" in text
    assert "original" in err and "not copied" in err  # the folder is named, once
    assert packed.load_packed(out).manifest == manifest
    code, verified, _ = run(["verify", out, "-q"], capsys)
    assert code == 0, verified

    again = tmp_path / "again"  # deterministic, and --overwrite recognises the folder as qpn's
    assert run(["pack", src, again, "-q"], capsys)[0] == 0 and tree(again) == tree(out)
    assert run(["pack", src, out, "--overwrite", "-q"], capsys)[0] == 0 and tree(again) == tree(out)


def test_a_checkpoint_without_extra_files_packs_to_the_same_bytes_as_before(tmp_path, capsys):
    src = write(tmp_path, "mixed")
    out = tmp_path / "out"
    assert run(["pack", src, out, "-q"], capsys)[0] == 0
    manifest = json.load(open(out / packed.MANIFEST_FILE))
    assert "copied_files" not in manifest
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "qpn_manifest.json"]


@pytest.mark.parametrize("damage, words", [
    ("remove", "tokenizer.json is missing"),
    ("truncate", "tokenizer.json has 3 bytes but the manifest records"),
])
def test_load_packed_checks_the_copied_files(tmp_path, capsys, damage, words):
    out = tmp_path / "out"
    assert run(["pack", source_with_extras(tmp_path), out, "-q"], capsys)[0] == 0
    if damage == "remove":
        os.unlink(out / "tokenizer.json")
    else:
        (out / "tokenizer.json").write_text("{ }")
    with pytest.raises(packed.PackError, match=words):
        packed.load_packed(out)
    code, _, err = run(["inspect", out], capsys)
    assert code == 2 and words in err


def test_verify_names_a_copied_file_whose_bytes_changed(tmp_path, capsys):
    out = tmp_path / "out"
    assert run(["pack", source_with_extras(tmp_path), out, "-q"], capsys)[0] == 0
    data = bytearray((out / "tokenizer.model").read_bytes())
    data[7] ^= 0xFF
    (out / "tokenizer.model").write_bytes(bytes(data))
    code, text, err = run(["verify", out, "-q"], capsys)
    assert code == 1 and "tokenizer.model" in text, text + err


def test_a_user_file_added_to_a_packed_folder_still_blocks_overwrite(tmp_path, capsys):
    src = source_with_extras(tmp_path)
    out = tmp_path / "out"
    assert run(["pack", src, out, "-q"], capsys)[0] == 0
    (out / "my-notes.txt").write_text("mine")
    before = tree(out)
    code, _, err = run(["pack", src, out, "--overwrite"], capsys)
    assert code == 2 and "my-notes.txt" in err and tree(out) == before


@POSIX
def test_pack_skips_a_fifo_and_a_broken_link_without_opening_them(tmp_path):
    """A FIFO would block a reader forever; a broken link has nothing to copy. Both are named, not copied."""
    src = write(tmp_path, "fp8-tensor")
    os.mkfifo(os.path.join(src, "pipe"))
    os.symlink(tmp_path / "nowhere", os.path.join(src, "gone.json"))
    out = tmp_path / "out"
    proc = run_child([sys.executable, "-m", "qpn", "pack", src, out, "-q"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "pipe" in proc.stderr and "gone.json" in proc.stderr and "not copied" in proc.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "qpn_manifest.json"]


def test_a_copied_file_that_changes_during_the_pack_is_bad_input(tmp_path, capsys, monkeypatch):
    src = source_with_extras(tmp_path, sharded=False)
    victim = os.path.join(src, "tokenizer.json")
    os.utime(victim, (OLD, OLD))
    real = packed.prepack_layer

    def grow_then_prepack(linear):  # the copies are made by now: the change comes after tokenizer.json's
        with open(victim, "a") as f:
            f.write(" ")
        return real(linear)

    monkeypatch.setattr(packed.write, "prepack_layer", grow_then_prepack)  # the name qpn pack calls
    code, _, err = run(["pack", src, tmp_path / "out"], capsys)
    assert code == 2 and victim in err and "changed while qpn" in err, err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
