// qpn_common.cuh: device helpers shared by every qpn kernel (QPN2 / QPN8 geometry, bit tricks).
//
// Included by the .cu files of this folder; the loader hands every *.cuh of the folder to NVRTC
// as an in-memory header (no -I path, no CUDA toolkit headers: NVRTC from the pip wheel has no
// cuda_fp16.h, so fp16 values travel as uint16/uint32 bit patterns and every fp16 instruction
// is written out as inline PTX; that also pins the exact instruction, which the numerics need).
//
// Numerics rules for everything here (docs/DESIGN.md, "Numerics contract"):
// - fp32 multiplies use __fmul_rn (never contracted into an FMA, round to nearest even);
// - fp32 -> fp16 is `cvt.rn.f16.f32` (one RNE rounding, subnormals kept: the loader never passes
//   -ftz=true or --use_fast_math);
// - fp16 x fp16 is `mul.rn.f16x2` (exact product, one RNE rounding, subnormals kept).
//
// Geometry (docs/QPN2.md, "Geometry shared with QPN8"): a warp lane owns one column of a
// 32-column tile, col(lane) = 8*((lane>>2)&3) + (lane&3) + 4*((lane>>4)&1); inside a 16-k group
// position p holds k = (p&8) + 2*(p&3) + ((p&7)>>2) (KORDER).
#pragma once

typedef unsigned char qpn_u8;
typedef unsigned short qpn_u16;
typedef unsigned int qpn_u32;
typedef unsigned long long qpn_u64;

#define QPN_TILE_N 32  // output columns per tile = lanes per warp
#define QPN_GROUP_K 16  // k per group (one NVFP4 block scale, one QPN8 16-byte packet)

// Byte-permute selectors (`prmt.b32 d, a, b, sel` = `__byte_perm(a, b, sel)`). The source bytes
// are a's bytes 0..3 and b's bytes 0..3 as 4..7; nibble i of the selector names the source
// byte of d's byte i (a nibble's bit 3, sign replication, is never used). QPN_PRMT builds a
// selector from that list, so each constant is derived from the permutation it performs:
// d = [byte 0, byte 1, byte 2, byte 3] below, lowest byte first.
#define QPN_PRMT(s0, s1, s2, s3) ((qpn_u32)(s0) | ((qpn_u32)(s1) << 4) | ((qpn_u32)(s2) << 8) | ((qpn_u32)(s3) << 12))
#define QPN_PRMT_EVEN_BYTES QPN_PRMT(0, 2, 4, 6)      // 0x6420: [a.b0, a.b2, b.b0, b.b2]
#define QPN_PRMT_ODD_BYTES QPN_PRMT(1, 3, 5, 7)       // 0x7531: [a.b1, a.b3, b.b1, b.b3]
#define QPN_PRMT_LOW_HALVES QPN_PRMT(0, 1, 4, 5)      // 0x5410: {a.lo16, b.lo16}
#define QPN_PRMT_HIGH_HALVES QPN_PRMT(2, 3, 6, 7)     // 0x7632: {a.hi16, b.hi16}
#define QPN_PRMT_LOW_HALVES_BA QPN_PRMT(4, 5, 0, 1)   // 0x1054: {b.lo16, a.lo16}
#define QPN_PRMT_HIGH_HALVES_BA QPN_PRMT(6, 7, 2, 3)  // 0x3276: {b.hi16, a.hi16}
#define QPN_PRMT_A_EVEN_ODD QPN_PRMT(0, 2, 1, 3)      // 0x3120: [a.b0, a.b2, a.b1, a.b3]
#define QPN_PRMT_B_EVEN_ODD QPN_PRMT(4, 6, 5, 7)      // 0x7564: [b.b0, b.b2, b.b1, b.b3]

// LOP3 truth tables (`lop3.b32 d, a, b, c, lut`): the lut is the wanted function evaluated on
// the operands' canonical patterns a = 0xF0, b = 0xCC, c = 0xAA (its bit j = the function's
// output for the input bits (a, b, c) of bit j of those patterns). A literal, not an
// expression, because it is pasted into the PTX text (QPN_STR); the static_assert derives it.
#define QPN_LOP3_A 0xF0
#define QPN_LOP3_B 0xCC
#define QPN_LOP3_C 0xAA
#define QPN_LOP3_SELECT 0xE4  // (a & c) | (b & ~c) = (F0 & AA) | (CC & 55) = A0 | 44: a's bits where c is set, else b's
static_assert(QPN_LOP3_SELECT == ((QPN_LOP3_A & QPN_LOP3_C) | (QPN_LOP3_B & ~QPN_LOP3_C & 0xFF)), "lop3 select table");
#define QPN_STR_(x) #x
#define QPN_STR(x) QPN_STR_(x)  // a macro's value as a string literal (for inline PTX)

// Tile column owned by `lane` (lanes 0..31 -> 0,1,2,3, 8..11, 16..19, 24..27, 4..7, ...).
__device__ __forceinline__ int qpn_column_of_lane(int lane) {
    return 8 * ((lane >> 2) & 3) + (lane & 3) + 4 * ((lane >> 4) & 1);
}

// fp16 bits -> fp32 value (exact: every fp16 value, subnormals included, is an fp32 value).
__device__ __forceinline__ float qpn_half_to_float(qpn_u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// fp32 value -> fp16 bits, RN16 (round to nearest even, overflow to inf, subnormals kept).
__device__ __forceinline__ qpn_u16 qpn_float_to_half_rn(float f) {
    qpn_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// bf16 bits -> fp32 value (exact: bf16 is fp32's upper half).
__device__ __forceinline__ float qpn_bf16_to_float(qpn_u16 b) {
    return __uint_as_float((qpn_u32)b << 16);
}

// fp32 value -> bf16 bits, RN_bf16 (qpn.ref.bf16_round): round to nearest even on the bit pattern, which
// is monotone in |v| across subnormals, normals and the carry into inf; a NaN stays a (quiet) NaN. Integer
// arithmetic: sm_75 has no cvt.rn.bf16.f32 (sm_80+).
__device__ __forceinline__ qpn_u16 qpn_float_to_bf16_rn(float f) {
    const qpn_u32 u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (qpn_u16)((u >> 16) | 0x0040u);
    return (qpn_u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The activations' dtype of a call (bf16 x, docs/DESIGN.md "bf16 activations"): its one rounding and its
// values read back.
__device__ __forceinline__ qpn_u16 qpn_round_to(float f, bool bf16) {
    return bf16 ? qpn_float_to_bf16_rn(f) : qpn_float_to_half_rn(f);
}
__device__ __forceinline__ float qpn_value_of(qpn_u16 v, bool bf16) {
    return bf16 ? qpn_bf16_to_float(v) : qpn_half_to_float(v);
}

// Two fp16 lanes multiplied, exact product rounded once (RNE); .rn also forbids FMA contraction.
__device__ __forceinline__ qpn_u32 qpn_hmul2_rn(qpn_u32 a, qpn_u32 b) {
    qpn_u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// Two e4m3 bytes sitting at bits 0..7 and 16..23 of `x` (the other bits are ignored) -> the
// half2 bits of (e4m3 * 2^-8) for both, exactly, subnormals and +-0 included:
//   sign bit 7 -> bit 15, exponent+mantissa bits 0..6 -> bits 7..13
//   (e4m3 bias 7 vs fp16 bias 15: 2^-8 = 2^(7-15)).
// NaN bytes 0x7F / 0xFF would come out as +-1.875 (= 480/256): prepack rejects them.
__device__ __forceinline__ qpn_u32 qpn_e4m3x2_to_half2_bits(qpn_u32 x) {
    return ((x & 0x00800080u) << 8)     // 0x80 = 1000_0000: sign
         | ((x & 0x007F007Fu) << 7);    // 0x7F = 0111_1111: exponent and mantissa
}

// One e4m3 byte -> its fp32 value, exactly (the fp16 bit trick above, then * 2^8, exact).
__device__ __forceinline__ float qpn_e4m3_to_float(qpn_u32 byte) {
    return qpn_half_to_float((qpn_u16)qpn_e4m3x2_to_half2_bits(byte & 0xFFu)) * 256.0f;
}

// Four e4m3 bytes of a word: nonzero iff one of them is a NaN code (0x7F or 0xFF).
// After masking the sign, a byte is <= 0x7F, so adding 1 per byte never carries into the next
// byte and sets bit 7 exactly for 0x7F.
__device__ __forceinline__ qpn_u32 qpn_e4m3x4_nan_mask(qpn_u32 w) {
    return ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
}

// fp16 bits are +-inf.
__device__ __forceinline__ bool qpn_half_is_inf(qpn_u16 h) {
    return (h & 0x7FFFu) == 0x7C00u;  // exponent all ones, mantissa zero
}

// ---------------------------------------------------------------------------------------------
// Warp staging for coalesced fp16 row stores (the dequantize kernels).
//
// A lane decodes its own column n = 32t + col(lane), i.e. one output ROW of W16 [N][K]; stored
// straight from registers, one warp store instruction would touch 32 different rows (16 bytes
// each, half a 32-byte sector): measured on the H200 that ran at 25-33 % of the streaming-read
// ceiling. So each warp stages STAGE_GROUPS groups of its 32 rows in shared memory
// (CHUNKS = 2 * STAGE_GROUPS 16-byte chunks per row) and writes them back so that consecutive
// lanes store consecutive chunks of one row: every store instruction writes 32/CHUNKS rows x
// 16*CHUNKS contiguous bytes (whole sectors).
//
//   staging row r (= source lane), chunk c  lives at  stage[r][c ^ swizzle(r)]
//
// swizzle(r) = (r / (8 / CHUNKS)) % CHUNKS makes both phases bank-conflict free: 16-byte
// accesses are served 8 lanes at a time (128 bytes = the 32 banks); in the put phase those 8
// lanes are 8 rows at one chunk, in the get phase 1 row (CHUNKS = 8) or 2 rows (CHUNKS = 4) of
// whole chunks, and the XOR spreads each set over the 8 distinct 16-byte bank slots.
template <int CHUNKS>
__device__ __forceinline__ int qpn_stage_swizzle(int row) {
    static_assert(CHUNKS == 4 || CHUNKS == 8, "a staged row is 64 or 128 bytes");
    return (row / (8 / CHUNKS)) % CHUNKS;
}

template <int CHUNKS>
__device__ __forceinline__ void qpn_stage_put(uint4 (*stage)[CHUNKS], int row, int chunk, uint4 v) {
    stage[row][chunk ^ qpn_stage_swizzle<CHUNKS>(row)] = v;
}

// Write the warp's 32 staged rows of tile t: row r goes to output row 32t + col(r), chunks
// [0, valid_chunks) to uint4 offset col_u4 + chunk of that row (row length row_u4 uint4).
// Call between two __syncwarp()s (after the puts, before the next phase's puts).
template <int CHUNKS>
__device__ __forceinline__ void qpn_stage_store_rows(
    const uint4 (*stage)[CHUNKS], uint4* __restrict__ out, int t, long long row_u4, long long col_u4,
    int valid_chunks, int lane)
{
    const int chunk = lane % CHUNKS;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {  // 32 rows, 32 / CHUNKS rows per store instruction
        const int row = (32 / CHUNKS) * i + lane / CHUNKS;
        if (chunk < valid_chunks) {
            const long long n = (long long)QPN_TILE_N * t + qpn_column_of_lane(row);
            out[n * row_u4 + col_u4 + chunk] = stage[row][chunk ^ qpn_stage_swizzle<CHUNKS>(row)];
        }
    }
}
