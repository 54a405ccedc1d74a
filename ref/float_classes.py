"""A float32 -> uint8 code rule evaluated by one table lookup, exactly: the quantizers' fast path.

The rules qpn's quantizers apply to every weight - `encode_e2m1`, `encode_e4m3`, and
`encode_e4m3(round_to("bfloat16", x))` (ModelOpt's per-tensor FP8 of a bf16 model) - cost 10-100 ns a
value in numpy (float64 frexp / ldexp, one pass per e2m1 midpoint). Each is, for a fixed sign, a
monotone step function of x whose steps and tie points all lie on the bf16 grid or on its midpoints
(e2m1's midpoints 0.25 .. 5 and e4m3's (2m + 1) * 2^(e - 4) have <= 5 significant bits; RNE to bf16
steps at bf16 midpoints). So the code depends only on x's CLASS:

    bits = x.view(uint32)     bit 31 .. 16 | 15   | 14 .. 0
                              bf16 pattern | half | sticky = any of them set
    key  = (bits >> 15) << 1 | sticky        (2^18 classes)

A class with sticky 0 is the single point (bits >> 15) << 15; one with sticky 1 is the open interval
between that point and the next, which holds no bf16 value and no bf16 midpoint, hence no step. The
rule is evaluated once per class on a representative (`class_table`); `lookup_classes` is then five
integer passes and a gather. tests/test_quantize.py checks every class's table entry against the rule
at both ends of the class's interval, which by monotonicity proves equality for all 2^32 inputs.

NaN: classes of NaN patterns hold `nan_code`, a byte the caller's format rejects (its NaN code, or an
out-of-range one); callers feed finite or +-inf values only (a finite weight over a positive scale).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np

from .codecs import encode_e2m1, encode_e4m3
from .dtypes import BF16, round_to

CLASS_SHIFT = 15  # the bits below bf16's half bit
_STICKY_MASK = (1 << CLASS_SHIFT) - 1  # 0x7FFF = 0111_1111_1111_1111
CLASS_COUNT = 1 << (32 - CLASS_SHIFT + 1)  # 2^17 (pattern, half) x 2 (sticky)


def class_points(sticky_bits: int) -> np.ndarray:
    """float32 [CLASS_COUNT]: for each class key, the value with the key's top 17 bits and low 15 bits
    `sticky_bits` where the key's sticky bit is 1 (0 where it is 0: the class's own point)."""
    keys = np.arange(CLASS_COUNT, dtype=np.uint32)
    bits = ((keys >> 1) << CLASS_SHIFT) | np.where(keys & 1, np.uint32(sticky_bits), np.uint32(0))
    return bits.view(np.float32)


def class_table(rule: Callable[[np.ndarray], np.ndarray], nan_code: int) -> np.ndarray:
    """uint8 [CLASS_COUNT]: rule(x) for one x of each class (the smallest magnitude), nan_code for NaN classes."""
    points = class_points(1)
    table = np.full(CLASS_COUNT, nan_code, dtype=np.uint8)
    finite_or_inf = ~np.isnan(points)
    table[finite_or_inf] = rule(points[finite_or_inf])
    return table


def lookup_classes(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """uint8 codes of float32 `x` (any shape) by its classes' entries in `table` (`class_table`)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    key = bits >> CLASS_SHIFT
    key <<= 1
    key |= (bits & _STICKY_MASK) != 0
    return table.take(key)


@cache
def e2m1_table() -> np.ndarray:
    """`encode_e2m1` as a class table; 0xFF (no 4-bit code: `pack_nibbles` refuses it) for NaN classes."""
    return class_table(encode_e2m1, nan_code=0xFF)


@cache
def e4m3_table(bf16_first: bool = False) -> np.ndarray:
    """`encode_e4m3` (after `round_to("bfloat16", .)` if bf16_first: ModelOpt's per-tensor FP8 quotient) as a
    class table; 0x7F (e4m3 NaN, which every reader rejects) for NaN classes."""
    if bf16_first:
        return class_table(lambda x: encode_e4m3(round_to(BF16, x)), nan_code=0x7F)
    return class_table(encode_e4m3, nan_code=0x7F)


__all__ = ["CLASS_COUNT", "class_points", "class_table", "e2m1_table", "e4m3_table", "lookup_classes"]
