"""Stage ablations of the decode kernels: source transforms that bench_decode.py's "ablate" section
applies to the shipping qpn2_linear.cu / qpn8_linear.cu text before compiling it.

The shipping kernels hold no benchmark-only code. An ablation is a list of `Edit`s on the kernel
text, each anchored on text that must occur exactly once (else `TransformError` names the
ablation and the anchor: a kernel edit that moved an anchor fails tests/test_ablations.py, not
the GPU run). Every ablation also gets a sink: what a left-out stage would have consumed is
XOR-ed into `ablate_sink`, and one never-true compare on it feeds an accumulator, so the
compiler keeps the loads alive (timing only: the outputs are wrong).

    ablation          what is left out of the inner loop (per group x tile)
    qpn2 loads only   everything after the loads (exchange, decode, mma)
    qpn2 no exchange  the last byte permutes of the quad transpose (w0, w1 decoded as loaded)
    qpn2 no decode    the {X, Y} gather and the e14 / fp16 decode (A = codes ^ constants)
    qpn2 no mma       the 4 mma per 8 tokens
    qpn8 loads only   everything after the loads

`ablated_source(fmt, label)` -> kernel text; `write_source(fmt, label)` -> the path of that text
in the kernel cache folder, named by its hash. The loader keys its in-memory kernels on the
source path (and its disk cache on the text), so a changed transform is a new file and a new
build, never a stale kernel.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from qpn.cupy_kernels import loader


class TransformError(ValueError):
    """An ablation's anchor is missing from, or not unique in, the kernel source."""


@dataclass(frozen=True)
class Edit:
    """Replace `old` (exactly one occurrence) by `new`; with `upto`, replace the text from `old` up
    to (not including) the first `upto` after it."""

    old: str
    new: str
    upto: str | None = None


SINK = "    qpn_u32 ablate_sink = 0;\n"
KEEP_ALIVE = "    if (ablate_sink == 0x9E3779B9u) acc[0][0][0][0] += 1.0f;  // keep the ablated loads alive\n"
STORE = "    qpn_reduce_store(red, red_sum, acc, y,"


def _sink(lambda_start: str) -> tuple[Edit, Edit]:
    """Declare ablate_sink before the kernel's inner-loop lambda; read it before the store."""
    return Edit(lambda_start, SINK + lambda_start), Edit(STORE, KEEP_ALIVE + STORE)


QPN2_SINK = _sink("    auto group_tile = [&]")
QPN8_SINK = _sink("    auto compute = [&]")
QPN2_CODES = "const qpn_u32 w0 = b.code[u][tt].x, w1 = b.code[u][tt].y;\n"
QPN2_MMA = "        qpn_take_group(acc, a, xf, xs, u, tt);\n"  # the mma (qpn_mma_group) in the decode builds
QPN2_FINAL_PERMUTE = "const qpn_u32 wq[2] = {qpn_prmt(keep2, recv2, sel_fin0), qpn_prmt(keep2, recv2, sel_fin1)};\n"
QPN2_DECODE = "        // the owner column's decode constant"
QPN8_CODES = "const uint4 c = b.code[u][tt];\n"

# (format, label) -> the edits; the labels are bench_decode.py's "ablate" rows
ABLATIONS: dict[tuple[str, str], tuple[Edit, ...]] = {
    ("qpn2", "loads only"): (*QPN2_SINK, Edit(
        QPN2_CODES, QPN2_CODES + "        ablate_sink ^= w0 ^ w1 ^ xy ^ xf[0].x ^ xf[0].y;\n        return;\n")),
    ("qpn2", "no exchange"): (*QPN2_SINK, Edit(
        QPN2_FINAL_PERMUTE, "const qpn_u32 wq[2] = {w0, w1};\n        (void)keep2; (void)recv2;\n")),
    ("qpn2", "no decode"): (*QPN2_SINK, Edit(
        QPN2_DECODE,
        "#pragma unroll\n        for (int rb = 0; rb < 2; ++rb)\n#pragma unroll\n"
        "            for (int i = 0; i < 4; ++i) a[rb][i] = wq[rb] ^ (i * 0x00100010u) ^ xy;\n",
        upto=QPN2_MMA)),
    ("qpn2", "no mma"): (*QPN2_SINK, Edit(
        QPN2_MMA,
        "        ablate_sink ^= a[0][0] ^ a[0][1] ^ a[0][2] ^ a[0][3]"
        " ^ a[1][0] ^ a[1][1] ^ a[1][2] ^ a[1][3] ^ xf[0].x;\n"
        "        return;\n")),
    ("qpn8", "loads only"): (*QPN8_SINK, Edit(
        QPN8_CODES, QPN8_CODES + "                ablate_sink ^= c.x ^ c.y ^ c.z ^ c.w ^ xf[0].x ^ xf[0].y;\n"
        "                continue;\n")),
}


def apply_edits(text: str, edits, what: str) -> str:
    """`text` with every edit applied in order; TransformError if an anchor is not unique."""
    fix = "update benchmarks/ablate/__init__.py to the kernel's new text"
    for edit in edits:
        count = text.count(edit.old)
        if count != 1:
            raise TransformError(f"ablation {what}: anchor {edit.old.strip()!r} occurs {count} times in the "
                                 f"kernel source, expected once; {fix}")
        start = text.index(edit.old)
        end = start + len(edit.old)
        if edit.upto is not None:
            end = text.find(edit.upto, end)
            if end < 0:
                raise TransformError(f"ablation {what}: no {edit.upto.strip()!r} after {edit.old.strip()!r}; {fix}")
        text = text[:start] + edit.new + text[end:]
    return text


def kernel_source(fmt: str) -> str:
    """The shipping kernel file of a format."""
    return f"{fmt}_linear.cu"


def ablated_source(fmt: str, label: str) -> str:
    """The text of kernel_source(fmt) with ablation (fmt, label) applied."""
    if (fmt, label) not in ABLATIONS:
        raise ValueError(f"no ablation {fmt!r} {label!r}; known: {sorted(ABLATIONS)}")
    _, text = loader.read_source(kernel_source(fmt))
    return apply_edits(text, ABLATIONS[fmt, label], f"{fmt} {label!r}")


def write_source(fmt: str, label: str) -> Path:
    """ablated_source(...) written (atomically) to the kernel cache folder; returns its path."""
    text = ablated_source(fmt, label)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = loader.cache_dir() / "ablate"
    path = folder / f"{fmt}_linear-{re.sub(r'[^a-z0-9]+', '_', label)}-{digest}.cu"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".cu")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic: a concurrent run sees no file or the whole text
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
