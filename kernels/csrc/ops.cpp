// spectoolkit's CPU kernels: the linear (fp32, bf16, rtn int8, rtn int4 weights packed in 16-column
// panels) and paged attention, exact by construction (DESIGN §7; isa_body.inc says how). One build runs
// on every x86-64 CPU: the kernels are compiled three times, for AVX-512, AVX2+FMA and plain scalar code
// (std::fma), and the best path the CPU has is chosen at run time; every path gives the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <cpuid.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int PANEL = 16;  // output columns per packed panel (and partial sums of a dot)
constexpr int MAX_HEAD_DIM = 256;

// Where a slot's key or value row comes from: the store's own fp32 memory, or a widened copy (exact
// conversions, made here in common code, so the same on every path).
struct KvRows {
  const float* (*row)(const KvRows& self, int which, int64_t slot, float* buf);  // which: 0 key, 1 value
  const void* store[2];
  const float* scale[2];  // per slot row (int8/fp8), or null
  int64_t D;
};

constexpr int64_t QBLOCK = 32;  // activations quantize to int8 per row and block of this many elements

// v rounded to the nearest integer, halves to even, for |v| < 2^22: adding and taking away 1.5 * 2^23 leaves no
// fraction bits, and IEEE's default rounding of that sum is half to even; so exactly std::nearbyint(v), with no
// library call in the loop (the compiler vectorizes it; -ffp-contract=off keeps the two operations).
inline float round_even(float v) {
  constexpr float MAGIC = 12582912.f;  // 1.5 * 2^23
  return (v + MAGIC) - MAGIC;
}

// A step's activation rows quantized to int8 (quantize_rows), what the integer-activation linear reads.
struct Q8Rows {
  const int8_t* q;   // [M, K] codes in [-127, 127]
  const float* d;    // [M, K / QBLOCK] scales: max |x| / 127 over the block
  const int32_t* s;  // [M, K / S] sum of the codes over each weight sub-block of S elements
  const float* sd;   // [M, K / S] d of the sub-block's activation block times float(s)
  int64_t K, S;
};

// The integer-activation weight formats (issue 55). WIDE: codes in whole int8 quads or int4 nibbles with fp32
// scales/zeros [P, G, 16] (today's rtn/GPTQ layouts). The others hold a GGUF block type at its own bits per weight:
// data uint8 [P, K/B, REC], one record per panel and block of B elements, each field laid [..][16 columns]:
//   Q8_0  (B 32)  d f16 [16] | quads int8 [8][16][4]                                      = 34 bytes/column
//   Q4_0  (B 32)  d | nibbles [4][16][4]                                                  = 18
//   Q4_1  (B 32)  d | m f16 [16] | nibbles                                                = 20
//   Q5_0  (B 32)  d | high-bit plane u32 [16] | nibbles                                   = 22
//   Q4_K  (B 256) d | dmin f16 [16] | the file's 12 scale bytes as 3 LE words [3][16] | nibbles [32][16][4] = 144
//   Q5_K  (B 256) the Q4_K header | per sub-block: high-bit plane u32 [16], nibbles [4][16][4] = 176
//   Q6_K  (B 256) d | per sub-block: scale int8 [16], 2-bit plane u32 [16], nibbles [2][16][4]  = 210
// (Q5_K/Q6_K interleave each sub-block's fields in the order the kernel reads them: one sequential stream.)
// rtn and GPTQ at their own size, one format per group size g (B = g: one record per group, S = 32 as the wide
// layouts' sub-blocks; the record's scale serves each of its sub-blocks):
//   RTN4  s bf16 [16] | z bf16 [16] | nibbles [g/8][16][4]       w = (u - 8) * s + z      = 4 + g/2 bytes/column
//   RTN8  s bf16 [16] | quads int8 [g/4][16][4]                  w = q * s                = 2 + g
//   GPTQ4 s bf16 [16] | z 4-bit [8] (column c: byte c % 8, nibble c / 8) | nibbles      w = (u - 8) * s + (8 - z) * s
// Nibbles as the WIDE int4 quads (byte (i, c, j): element 8i + j low, 8i + 4 + j high). A plane word holds a
// column's high bits of one sub-block: 1-bit, element 8i + 4h + j at bit 2i + h of byte j; 2-bit (16 elements),
// bits 2p, 2p + 1 of byte j with p = 2i + h. Codes are unsigned, w = (u - OFF) * scale (+ zero).
enum Fmt : int {
  WIDE = 0, FQ8_0, FQ4_0, FQ4_1, FQ5_0, FQ4_K, FQ5_K, FQ6_K,
  FRTN4_32, FRTN4_64, FRTN4_128, FRTN8_32, FRTN8_64, FRTN8_128, FGPTQ4_32, FGPTQ4_64, FGPTQ4_128, FMT_COUNT
};
struct FmtLayout {
  int64_t B, S, REC;  // elements per record, per sub-block (one scale), bytes per record
  int BITS, OFF;      // code width (8: int8 quads), code offset
  int64_t CODES, PLANE;  // byte offsets of the codes and the high-bit planes: in a record, or (STRIDE) a sub-block
  bool ZERO;          // an fp32 zero per sub-block (the second fma)
  int64_t HEAD, STRIDE;  // interleaved: sub-block j's fields start at HEAD + j * STRIDE (0: fields in regions)
};
constexpr FmtLayout FMT[FMT_COUNT] = {
    {0, 0, 0, 0, 0, 0, 0, false, 0, 0},
    {32, 32, 544, 8, 0, 32, 0, false, 0, 0},
    {32, 32, 288, 4, 8, 32, 0, true, 0, 0},
    {32, 32, 320, 4, 8, 64, 0, true, 0, 0},
    {32, 32, 352, 5, 16, 96, 32, false, 0, 0},
    {256, 32, 2304, 4, 8, 256, 0, true, 0, 0},
    {256, 32, 2816, 5, 0, 64, 0, true, 256, 320},
    {256, 16, 3360, 6, 32, 80, 16, false, 32, 208},
    {32, 32, 320, 4, 8, 64, 0, true, 0, 0},
    {64, 32, 576, 4, 8, 64, 0, true, 0, 0},
    {128, 32, 1088, 4, 8, 64, 0, true, 0, 0},
    {32, 32, 544, 8, 0, 32, 0, false, 0, 0},
    {64, 32, 1056, 8, 0, 32, 0, false, 0, 0},
    {128, 32, 2080, 8, 0, 32, 0, false, 0, 0},
    {32, 32, 296, 4, 8, 40, 0, true, 0, 0},
    {64, 32, 552, 4, 8, 40, 0, true, 0, 0},
    {128, 32, 1064, 4, 8, 40, 0, true, 0, 0},
};
constexpr bool rtn_fmt(int f) { return f >= FRTN4_32 && f <= FRTN8_128; }  // a bf16 scale (and zero), nothing else
constexpr bool gptq_fmt(int f) { return f >= FGPTQ4_32 && f <= FGPTQ4_128; }

// How many bytes ahead of its reads a linear prefetches its weight stream; 0: none (kernels/prefetch.py measures it
// once per process). At one row a core's own loads keep too few cache lines in flight to read memory at the rate
// it can (measured on a Zen 5 EPYC: 19 GB/s a core for the Q4_K linear against 43 for a bare read loop). A property
// of the machine's memory, set once, not of any call: a prefetch changes no bit.
std::atomic<int64_t> stream_prefetch{0};

// Prefetch (into every cache level) the cache lines that start in [from, to), ``ahead`` bytes further on: a
// stream's consecutive regions prefetch each line once. A prefetch never faults, past the stream's end included.
inline void prefetch_ahead(const void* from, const void* to, int64_t ahead) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(to);
  for (uintptr_t line = (reinterpret_cast<uintptr_t>(from) + 63) & ~uintptr_t{63}; line < end; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line + ahead), 0, 3);
}

// The distance a tile starting at row ``m`` prefetches at: a panel's first row tile streams it from memory, the
// later ones read it from cache.
inline int64_t first_tile_ahead(int64_t m) {
  return m == 0 ? stream_prefetch.load(std::memory_order_relaxed) : 0;
}

}  // namespace

// bitsandbytes' 4-bit NormalFloat values (QLoRA's NF4, bitsandbytes.functional's table, as fp32): an nf4
// code u stands for NF4[u] times its block's absmax. Every path reads this one array.
alignas(64) constexpr float NF4[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                                       -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                                       0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                                       0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                                       0.7229568362236023f, 1.0f};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace isa_avx512 {
using V = __m512;
constexpr int VL = 16;
// Tile shapes (panels PB, rows RB) by row count; accumulators + weights + a broadcast fit 32 registers.
struct FloatShapes { static constexpr int N = 3, PB[3] = {4, 2, 4}, RB[3] = {4, 8, 4}; };
struct QuantShapes { static constexpr int N = 3, PB[3] = {4, 2, 1}, RB[3] = {2, 4, 8}; };
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float a) { return _mm512_set1_ps(a); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vabs(V a) { return _mm512_abs_ps(a); }
inline V vround(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float vhmax(V a) { return _mm512_reduce_max_ps(a); }  // exact: max in any order (no NaN: vmax drops them)
inline float vfma_one(float a, float b, float c) { return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c))); }
inline V vpow2(V n) {  // 2^n for integer-valued n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline V vload_w(const float* p) { return vload(p); }
inline V vload_w(const uint16_t* p) {  // bf16 -> fp32: a 16-bit shift, exact
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline V vload_int8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void vload_int4(const uint8_t* p, V& lo, V& hi) {  // u - 8 by a 16-entry table: exactly float(u - 8)
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  lo = _mm512_permutexvar_ps(b, table);  // vpermps reads an index's low 4 bits: the low nibble
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
inline void vload_nf4(const uint8_t* p, V& lo, V& hi) {  // NF4[u], the same table lookup
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 table = _mm512_load_ps(NF4);
  lo = _mm512_permutexvar_ps(b, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
// Integer lanes (int_body.inc): 16 columns, 4 bytes each.
struct IntShapes { static constexpr int N = 1, PB[1] = {1}, RB[1] = {8}; };
using VI = __m512i;
inline VI vi_zero() { return _mm512_setzero_si512(); }
inline VI vi_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline void vi_store(int32_t* p, VI v) { _mm512_storeu_si512(p, v); }
inline VI vi_bcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm512_set1_epi32(four);
}
inline VI vi_nib_lo(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline VI vi_nib_hi(VI v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline VI vi_abs8(VI v) { return _mm512_abs_epi8(v); }
inline VI vi_sign8(VI x, VI code) {  // x negated in the bytes where code < 0 (where code is 0, |code| zeroes it)
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(code), _mm512_setzero_si512(), x);
}
inline VI vi_dot(VI acc, VI u, VI s) {  // pairs within int16 (|u| <= 128, |s| <= 127), then exact int32
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
inline VI vi_sub_set1(VI v, int32_t c) { return _mm512_sub_epi32(v, _mm512_set1_epi32(c)); }
inline V vi_float(VI v) { return _mm512_cvtepi32_ps(v); }
using VP = __m512i;  // int16 pairs
inline VP vi_part_zero() { return _mm512_setzero_si512(); }
inline VP vi_part_dot(VP part, VI u, VI s) { return _mm512_add_epi16(part, _mm512_maddubs_epi16(u, s)); }
inline VI vi_part_sum(VP part) { return _mm512_madd_epi16(part, _mm512_set1_epi16(1)); }
inline VI vi_set1(int32_t c) { return _mm512_set1_epi32(c); }
inline VI vi_and(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI vi_or(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI vi_sll(VI v, int n) { return _mm512_sll_epi32(v, _mm_cvtsi32_si128(n)); }
inline VI vi_srl(VI v, int n) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n)); }
inline V vload_h(const uint8_t* p) {  // VL fp16 -> fp32, exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V vload_u4(const uint8_t* p, int) {  // 16 4-bit values (column c: byte c % 8, nibble c / 8) -> fp32
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(15);
  const __m128i both = _mm_unpacklo_epi64(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both));
}
#include "isa_body.inc"
#include "int_body.inc"
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
namespace isa_avx512_vnni {  // AVX-512's kernels, with the 4-byte dot one vpdpbusd (no int16 step at all)
using namespace isa_avx512;
inline VI vi_dot(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }
using VP = __m512i;  // int32 sums
inline VP vi_part_zero() { return _mm512_setzero_si512(); }
inline VP vi_part_dot(VP part, VI u, VI s) { return _mm512_dpbusd_epi32(part, u, s); }
inline VI vi_part_sum(VP part) { return part; }
#include "int_body.inc"
}  // namespace isa_avx512_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
using V = __m256;
constexpr int VL = 8;
struct FloatShapes { static constexpr int N = 2, PB[2] = {2, 1}, RB[2] = {2, 6}; };  // 16 registers
struct QuantShapes { static constexpr int N = 1, PB[1] = {1}, RB[1] = {2}; };
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline V vabs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline V vround(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float vhmax(V a) {  // exact: max in any order (no NaN: vmax drops them)
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}
inline float vfma_one(float a, float b, float c) { return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c))); }
inline V vpow2(V n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V vload_w(const float* p) { return vload(p); }
inline V vload_w(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline V vload_int8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vload_int4(const uint8_t* p, V& lo, V& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i eight = _mm256_set1_epi32(8);
  lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), eight));
  hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
}
inline V lut16(__m256i idx, const float* table) {  // table[idx & 15]: two 8-entry lookups, bit 3 picks
  const V low = _mm256_permutevar8x32_ps(_mm256_load_ps(table), idx);  // vpermps reads the low 3 bits
  const V high = _mm256_permutevar8x32_ps(_mm256_load_ps(table + 8), idx);
  return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));  // bit 3 -> sign bit
}
inline void vload_nf4(const uint8_t* p, V& lo, V& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = lut16(b, NF4);
  hi = lut16(_mm256_srli_epi32(b, 4), NF4);
}
struct IntShapes { static constexpr int N = 1, PB[1] = {1}, RB[1] = {4}; };
using VI = __m256i;
inline VI vi_zero() { return _mm256_setzero_si256(); }
inline VI vi_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void vi_store(int32_t* p, VI v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline VI vi_bcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm256_set1_epi32(four);
}
inline VI vi_nib_lo(VI v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline VI vi_nib_hi(VI v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline VI vi_abs8(VI v) { return _mm256_abs_epi8(v); }
inline VI vi_sign8(VI x, VI code) { return _mm256_sign_epi8(x, code); }
inline VI vi_dot(VI acc, VI u, VI s) {  // pairs within int16 (|u| <= 128, |s| <= 127), then exact int32
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline VI vi_sub_set1(VI v, int32_t c) { return _mm256_sub_epi32(v, _mm256_set1_epi32(c)); }
inline V vi_float(VI v) { return _mm256_cvtepi32_ps(v); }
using VP = __m256i;  // int16 pairs
inline VP vi_part_zero() { return _mm256_setzero_si256(); }
inline VP vi_part_dot(VP part, VI u, VI s) { return _mm256_add_epi16(part, _mm256_maddubs_epi16(u, s)); }
inline VI vi_part_sum(VP part) { return _mm256_madd_epi16(part, _mm256_set1_epi16(1)); }
inline VI vi_set1(int32_t c) { return _mm256_set1_epi32(c); }
inline VI vi_and(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI vi_or(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI vi_sll(VI v, int n) { return _mm256_sll_epi32(v, _mm_cvtsi32_si128(n)); }
inline VI vi_srl(VI v, int n) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(n)); }
inline V vload_h(const uint8_t* p) {  // F16C: VL fp16 -> fp32, exact
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline V vload_u4(const uint8_t* p, int v) {  // columns 8v..8v+7 of 16 4-bit values (byte c % 8, nibble c / 8)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i nib = _mm_and_si128(v ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(15));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib));
}
#include "isa_body.inc"
#include "int_body.inc"
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace isa_avx_vnni {  // AVX2's kernels, with the 4-byte dot one VEX vpdpbusd (Alder Lake, Zen 5)
using namespace isa_avx2;
inline VI vi_dot(VI acc, VI u, VI s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
using VP = __m256i;  // int32 sums
inline VP vi_part_zero() { return _mm256_setzero_si256(); }
inline VP vi_part_dot(VP part, VI u, VI s) { return _mm256_dpbusd_avx_epi32(part, u, s); }
inline VI vi_part_sum(VP part) { return part; }
#include "int_body.inc"
}  // namespace isa_avx_vnni
#pragma GCC pop_options

namespace isa_scalar {  // the reference path: baseline x86-64 code, std::fma (runs on every CPU)
using V = float;
constexpr int VL = 1;
struct FloatShapes { static constexpr int N = 1, PB[1] = {1}, RB[1] = {1}; };
struct QuantShapes { static constexpr int N = 1, PB[1] = {1}, RB[1] = {1}; };
inline V vzero() { return 0.f; }
inline V vset1(float a) { return a; }
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V v) { *p = v; }
inline V vfma(V a, V b, V c) { return std::fma(a, b, c); }
inline V vadd(V a, V b) { return a + b; }
inline V vsub(V a, V b) { return a - b; }
inline V vmul(V a, V b) { return a * b; }
inline V vdiv(V a, V b) { return a / b; }
inline V vmax(V a, V b) { return a > b ? a : b; }  // _mm*_max_ps: the second operand unless a > b
inline V vmin(V a, V b) { return a < b ? a : b; }  // _mm*_min_ps: the second operand unless a < b
inline V vabs(V a) { return std::fabs(a); }
inline V vround(V a) { return round_even(a); }  // the vector paths' round-to-nearest-even instruction
inline float vhmax(V a) { return a; }
inline float vfma_one(float a, float b, float c) { return std::fma(a, b, c); }
inline V vpow2(V n) {
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
inline V vload_w(const float* p) { return *p; }
inline V vload_w(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
inline V vload_int8(const uint8_t* p) { return static_cast<float>(static_cast<int8_t>(*p)); }
inline void vload_int4(const uint8_t* p, V& lo, V& hi) {
  lo = static_cast<float>(static_cast<int>(*p & 15) - 8);
  hi = static_cast<float>(static_cast<int>(*p >> 4) - 8);
}
inline void vload_nf4(const uint8_t* p, V& lo, V& hi) {
  lo = NF4[*p & 15];
  hi = NF4[*p >> 4];
}
// Integer lanes: one column, its 4 bytes in an int32 (little-endian: byte j is element j), sums in int32.
struct IntShapes { static constexpr int N = 1, PB[1] = {1}, RB[1] = {1}; };
using VI = int32_t;
inline VI vi_zero() { return 0; }
inline VI vi_load(const uint8_t* p) {
  VI four;
  std::memcpy(&four, p, 4);
  return four;
}
inline void vi_store(int32_t* p, VI v) { *p = v; }
inline VI vi_bcast4(const int8_t* p) { return vi_load(reinterpret_cast<const uint8_t*>(p)); }
inline VI vi_nib_lo(VI v) { return static_cast<VI>(static_cast<uint32_t>(v) & 0x0F0F0F0Fu); }
inline VI vi_nib_hi(VI v) { return static_cast<VI>((static_cast<uint32_t>(v) >> 4) & 0x0F0F0F0Fu); }
inline uint8_t byte_of(VI v, int j) { return static_cast<uint8_t>(static_cast<uint32_t>(v) >> (8 * j)); }
inline VI from_bytes(const uint8_t (&b)[4]) { return vi_load(b); }
inline VI vi_abs8(VI v) {
  uint8_t b[4];
  for (int j = 0; j < 4; ++j) b[j] = static_cast<uint8_t>(std::abs(static_cast<int>(static_cast<int8_t>(byte_of(v, j)))));
  return from_bytes(b);
}
inline VI vi_sign8(VI x, VI code) {
  uint8_t b[4];
  for (int j = 0; j < 4; ++j) {
    const int c = static_cast<int8_t>(byte_of(code, j)), e = static_cast<int8_t>(byte_of(x, j));
    b[j] = static_cast<uint8_t>(static_cast<int8_t>(c < 0 ? -e : (c == 0 ? 0 : e)));
  }
  return from_bytes(b);
}
inline VI vi_dot(VI acc, VI u, VI s) {
  for (int j = 0; j < 4; ++j) acc += static_cast<int32_t>(byte_of(u, j)) * static_cast<int8_t>(byte_of(s, j));
  return acc;
}
inline VI vi_sub_set1(VI v, int32_t c) { return v - c; }
inline V vi_float(VI v) { return static_cast<float>(v); }
using VP = int32_t;
inline VP vi_part_zero() { return 0; }
inline VP vi_part_dot(VP part, VI u, VI s) { return vi_dot(part, u, s); }
inline VI vi_part_sum(VP part) { return part; }
inline VI vi_set1(int32_t c) { return c; }
inline VI vi_and(VI a, VI b) { return a & b; }
inline VI vi_or(VI a, VI b) { return a | b; }
inline VI vi_sll(VI v, int n) { return static_cast<VI>(static_cast<uint32_t>(v) << n); }
inline VI vi_srl(VI v, int n) { return static_cast<VI>(static_cast<uint32_t>(v) >> n); }
inline V vload_h(const uint8_t* p) {  // c10's fp16 -> fp32 conversion, exact
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}
inline V vload_u4(const uint8_t* p, int v) {  // column v of 16 4-bit values (byte v % 8, nibble v / 8)
  return static_cast<float>((p[v % 8] >> (4 * (v / 8))) & 15);
}
#include "isa_body.inc"
#include "int_body.inc"
}  // namespace isa_scalar

namespace {

// Paths, by index (kernels/cpu_ops.py ISAS). They are not ordered: an AVX-512 CPU may lack AVX-VNNI (Zen 4) and an
// AVX-VNNI one AVX-512 (Alder Lake). The VNNI paths run their base path's float kernels.
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512_VNNI = 3, AVX_VNNI = 4, ISA_COUNT = 5 };

bool detect(int64_t isa) {
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // F16C (the fp16 scales of the GGUF formats): CPUID.1:ECX bit 29
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case SCALAR: return true;
    case AVX2: return avx2;
    case AVX512: return avx512;
    case AVX512_VNNI: return avx512 && __builtin_cpu_supports("avx512vnni");
    case AVX_VNNI: return avx2 && __builtin_cpu_supports("avxvnni");
    default: return false;
  }
}

bool isa_runs(int64_t isa) {  // detected once per process
  static const std::vector<bool> runs = [] {
    std::vector<bool> out;
    for (int64_t i = 0; i < ISA_COUNT; ++i) out.push_back(detect(i));
    return out;
  }();
  return isa >= 0 && isa < ISA_COUNT && runs[isa];
}

int64_t best_isa() {  // the first this CPU runs, in order of preference
  for (const int64_t isa : {AVX512_VNNI, AVX512, AVX_VNNI, AVX2})
    if (isa_runs(isa)) return isa;
  return SCALAR;
}

int64_t resolve_isa(int64_t isa) {  // -1: the best this CPU has; a path it lacks is an error, never a crash
  if (isa < 0) return best_isa();
  TORCH_CHECK(isa_runs(isa), "spectoolkit kernels: this CPU cannot run path ", isa, " (best: ", best_isa(), ")");
  return isa;
}

using LinearFn = void (*)(int, const float*, const void*, const float*, const float*, const float*, int64_t, int64_t,
                          int64_t, int64_t, float*, int64_t, int64_t, int64_t);
using IntLinearFn = void (*)(int, int, const Q8Rows&, const uint8_t*, const float*, const float*, int64_t, int64_t,
                             int64_t, float*, int64_t, int32_t*, int64_t, int64_t, int64_t);
using AttendFn = void (*)(const float*, int64_t, int64_t, int64_t, const int64_t*, const int64_t*, float, float*,
                          int64_t, int64_t, const KvRows&);
constexpr LinearFn LINEAR[] = {isa_scalar::linear_panels, isa_avx2::linear_panels, isa_avx512::linear_panels,
                               isa_avx512::linear_panels, isa_avx2::linear_panels};
constexpr IntLinearFn INT_LINEAR[] = {isa_scalar::int_linear_panels, isa_avx2::int_linear_panels,
                                      isa_avx512::int_linear_panels, isa_avx512_vnni::int_linear_panels,
                                      isa_avx_vnni::int_linear_panels};
constexpr AttendFn ATTEND[] = {isa_scalar::attend<>, isa_avx2::attend<>, isa_avx512::attend<>, isa_avx512::attend<>,
                               isa_avx2::attend<>};
using NormFn = void (*)(const float*, const float*, float, int64_t, float*, int64_t, int64_t);
using SiluFn = void (*)(const float*, const float*, float*, int64_t, int64_t);
using RotaryFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, float*, int64_t, int64_t);
using QuantBlockFn = float (*)(const float*, int8_t*);
constexpr NormFn NORM[] = {isa_scalar::rms_norm_rows, isa_avx2::rms_norm_rows, isa_avx512::rms_norm_rows,
                           isa_avx512::rms_norm_rows, isa_avx2::rms_norm_rows};
constexpr SiluFn SILU[] = {isa_scalar::silu_mul_range, isa_avx2::silu_mul_range, isa_avx512::silu_mul_range,
                           isa_avx512::silu_mul_range, isa_avx2::silu_mul_range};
constexpr QuantBlockFn QUANT_BLOCK[] = {isa_scalar::quantize_block, isa_avx2::quantize_block,
                                       isa_avx512::quantize_block, isa_avx512::quantize_block, isa_avx2::quantize_block};
constexpr RotaryFn ROTARY[] = {isa_scalar::rotary_rows, isa_avx2::rotary_rows, isa_avx512::rotary_rows,
                               isa_avx512::rotary_rows, isa_avx2::rotary_rows};

void check_fp32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "spectoolkit: ", what, " is a contiguous fp32 tensor");
}

// x [M, E] fp32, w [E] fp32 -> [M, E]: RMSNorm, one row at a time (E a multiple of 16).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t isa) {
  check_fp32(x, "rms_norm x");
  check_fp32(w, "rms_norm weight");
  const int64_t E = x.size(-1), M = x.numel() / E;
  TORCH_CHECK(E % PANEL == 0 && w.numel() == E, "spectoolkit::rms_norm: width a multiple of 16, weight [E]");
  auto out = at::empty_like(x);
  const NormFn fn = NORM[resolve_isa(isa)];
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) { fn(xp, wp, e, E, op, m0, m1); });
  return out;
}

// gate, up [..., I] fp32 -> silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up, int64_t isa) {
  check_fp32(gate, "silu_mul gate");
  check_fp32(up, "silu_mul up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "spectoolkit::silu_mul: gate and up of one shape");
  auto out = at::empty_like(gate);
  const SiluFn fn = SILU[resolve_isa(isa)];
  const float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, gate.numel(), 4096, [&](int64_t i0, int64_t i1) { fn(g, u, op, i0, i1); });
  return out;
}

// x [R, H, D] fp32, cos/sin [R, D] fp32 -> x rotated (the Llama pairing of d and d + D/2).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t isa) {
  check_fp32(x, "rotary x");
  check_fp32(cos, "rotary cos");
  check_fp32(sin, "rotary sin");
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && x.size(2) % 2 == 0,
              "spectoolkit::rotary: x [R, H, D], cos/sin [R, D]");
  auto out = at::empty_like(x);
  const RotaryFn fn = ROTARY[resolve_isa(isa)];
  const float *xp = x.data_ptr<float>(), *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t r0, int64_t r1) { fn(xp, c, s, x.size(1), x.size(2), op, r0, r1); });
  return out;
}

// Rows [first, first + count) of the rotary tables: freq = position * inv_freq[i] (fp32, as transformers),
// cos/sin of it in double, rounded to fp32, times ``scaling`` when it is not 1; columns i and i + D/2 alike.
// Scalar code, one position at a time: a position's row is the same bits whichever rows are computed with it.
std::tuple<at::Tensor, at::Tensor> rope_table(const at::Tensor& inv_freq, int64_t first, int64_t count, double scaling) {
  check_fp32(inv_freq, "rope_table inv_freq");
  const int64_t half = inv_freq.numel(), D = 2 * half;
  auto cos = at::empty({count, D}, inv_freq.options()), sin = at::empty({count, D}, inv_freq.options());
  const float* f = inv_freq.data_ptr<float>();
  float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  for (int64_t r = 0; r < count; ++r)
    for (int64_t i = 0; i < half; ++i) {
      const float freq = static_cast<float>(first + r) * f[i];
      float cv = static_cast<float>(std::cos(static_cast<double>(freq)));
      float sv = static_cast<float>(std::sin(static_cast<double>(freq)));
      if (scale != 1.f) {
        cv = cv * scale;
        sv = sv * scale;
      }
      c[r * D + i] = c[r * D + i + half] = cv;
      s[r * D + i] = s[r * D + i + half] = sv;
    }
  return {cos, sin};
}

// ---- integer activations ---------------------------------------------------------------------------

// Storage that only grows and is never zeroed (every element read is written first): a step's quantized rows reuse
// one thread's buffers instead of allocating and clearing them per linear.
template <typename T>
struct Scratch {
  std::unique_ptr<T[]> data;
  size_t size = 0;
  T* at_least(size_t n) {
    if (n > size) {
      data.reset(new T[n]);
      size = n;
    }
    return data.get();
  }
};

// Rows of x quantized for the integer-activation linear, in common code (the same bits on every path): per row
// and block of QBLOCK elements, d = max |x| / 127 (fp32), q = x / d rounded half to even (a zero block: codes 0),
// then per sub-block of S elements the codes' sum and d * float(sum).
struct Q8Buffers {
  Scratch<int8_t> q;
  Scratch<float> d, sd;
  Scratch<int32_t> s;
  Q8Rows rows;
};

// This thread's quantized-row buffers, ``count`` of them (a call quantizes x once per sub-block size).
std::vector<Q8Buffers>& thread_q8(size_t count) {
  static thread_local std::vector<Q8Buffers> buffers;
  if (buffers.size() < count) buffers.resize(count);  // moving a Scratch keeps its memory where it is
  return buffers;
}

// max |x| over n values divided by ``limit``: the scale of the scaled encodings (the KV pool's int8/fp8 rows, the
// integer linear's activation blocks).
float absmax_scale(const float* x, int64_t n, float limit) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax / limit;
}

// n values to int8 codes: d = max |x| / 127, code = x / d (a zero d divides by 1) rounded half to even, clamped to
// ±127; returns d. One rule for the KV pool's int8 rows and the integer linear's activation blocks. |x / d| stays
// below 2^8 (|x| <= max |x|, d rounded from it), inside round_even's range.
float int8_codes(const float* x, int64_t n, int8_t* q) {
  const float d = absmax_scale(x, n, 127.f), safe = d == 0.f ? 1.f : d;
  for (int64_t i = 0; i < n; ++i) {
    const float v = round_even(x[i] / safe);
    q[i] = static_cast<int8_t>(static_cast<int32_t>(v < -127.f ? -127.f : (v > 127.f ? 127.f : v)));
  }
  return d;
}

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t S, Q8Buffers& out, int64_t isa) {
  const QuantBlockFn block = QUANT_BLOCK[isa];
  const int64_t A = K / QBLOCK, NB = K / S;
  int8_t* q = out.q.at_least(M * K);
  float *d = out.d.at_least(M * A), *sd = out.sd.at_least(M * NB);
  int32_t* s = out.s.at_least(M * NB);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t a = 0; a < A; ++a) d[m * A + a] = block(x + m * K + a * QBLOCK, q + m * K + a * QBLOCK);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < NB; ++b) {
        int32_t sum = 0;
        for (int64_t i = b * S; i < (b + 1) * S; ++i) sum += q[m * K + i];
        s[m * NB + b] = sum;
        sd[m * NB + b] = d[m * A + b * S / QBLOCK] * static_cast<float>(sum);
      }
  });
  out.rows = Q8Rows{q, d, s, sd, K, S};
}

// x [M, K] fp32 -> (codes int8 [M, K], scales fp32 [M, K / 32]): quantize_rows' codes on path ``isa`` (0: scalar),
// for tests and the Python reference.
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x, int64_t isa) {
  check_fp32(x, "quantize_activations x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % QBLOCK == 0, "spectoolkit::quantize_activations: x [M, K], K a multiple of 32");
  Q8Buffers buf;
  quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), QBLOCK, buf, resolve_isa(isa));
  auto q = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kChar));
  auto d = at::empty({x.size(0), x.size(1) / QBLOCK}, x.options());
  std::memcpy(q.data_ptr(), buf.rows.q, q.numel());
  std::memcpy(d.data_ptr(), buf.rows.d, d.numel() * sizeof(float));
  return {q, d};
}

// The integer-activation layout's checks; returns (kind 0 int8 / 1 int4, sub-block S, groups G). ``fmt`` > 0: a
// format's records (FMT: GGUF, rtn, GPTQ), kind and G unused.
std::tuple<int, int64_t, int64_t> int_layout(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                                             int64_t K, int64_t n, int64_t group, int64_t fmt) {
  if (fmt != WIDE) {
    TORCH_CHECK(fmt > 0 && fmt < FMT_COUNT, "spectoolkit::linear: no weight format ", fmt);
    const FmtLayout& f = FMT[fmt];
    const int64_t P = w.size(0);
    TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && K % f.B == 0 &&
                    w.size(1) == K / f.B && w.size(2) == f.REC && n <= P * PANEL && n > (P - 1) * PANEL,
                "spectoolkit::linear: format ", fmt, " weights are uint8 [P, K/", f.B, ", ", f.REC, "] for x [M, K]");
    return {0, f.S, 0};
  }
  TORCH_CHECK(w.dim() == 4 && w.size(2) == PANEL && w.size(3) == 4 && w.is_contiguous(),
              "spectoolkit::linear: integer-activation weights are [P, K/4 or K/8, 16, 4]");
  const int kind = w.scalar_type() == at::kChar ? 0 : 1;
  TORCH_CHECK(kind == 0 || w.scalar_type() == at::kByte, "spectoolkit::linear: int8 or 4-bit (uint8) codes");
  const int64_t P = w.size(0);
  TORCH_CHECK(K % QBLOCK == 0 && w.size(1) == K / (kind ? 8 : 4) && n <= P * PANEL && n > (P - 1) * PANEL,
              "spectoolkit::linear: packed weight does not match x [M, K] (K a multiple of 32) or n");
  TORCH_CHECK(group > 0 && K % group == 0 && (group % QBLOCK == 0 || group == 16),
              "spectoolkit::linear: integer activations need a group of 16 or a multiple of 32, not ", group);
  const int64_t G = K / group;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == P * G * PANEL,
              "spectoolkit::linear: scales fp32 [P, G, 16]");
  TORCH_CHECK(kind == 0 || (zeros.is_contiguous() && zeros.scalar_type() == at::kFloat && zeros.numel() == P * G * PANEL),
              "spectoolkit::linear: zeros fp32 [P, G, 16]");
  return {kind, std::min(group, QBLOCK), G};
}

// Panels [p0, p1) of one integer-activation linear (int_layout's kind and G) on path ``fn``, into ``out`` or the exact
// ``sums`` (leading dimension ``ld``): a format's records carry their own scales, a wide layout reads its fp32 scales
// (and an int4 layout its zeros).
void int_panels(IntLinearFn fn, int kind, int64_t G, int64_t fmt, const Q8Rows& xr, const at::Tensor& w,
                const at::Tensor& scales, const at::Tensor& zeros, int64_t M, int64_t group, float* out, int32_t* sums,
                int64_t ld, int64_t p0, int64_t p1) {
  const bool wide = fmt == WIDE;
  fn(kind, static_cast<int>(fmt), xr, static_cast<const uint8_t*>(w.data_ptr()), wide ? scales.data_ptr<float>() : nullptr,
     wide && kind == 1 ? zeros.data_ptr<float>() : nullptr, M, G, group, out, ld, sums, ld, p0, p1);
}

// x [M, K] fp32 @ integer-activation weights -> [M, P*16] fp32 (int_body.inc), or with ``sums`` the exact
// sub-block sums [M, K/S, P*16] int32.
at::Tensor int_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                      int64_t n, int64_t group, int64_t isa, bool sums, int64_t fmt) {
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0);
  const auto [kind, S, G] = int_layout(w, scales, zeros, K, n, group, fmt);
  Q8Buffers& buf = thread_q8(1)[0];
  quantize_rows(x.data_ptr<float>(), M, K, S, buf, resolve_isa(isa));
  auto out = sums ? at::empty({M, K / S, P * PANEL}, x.options().dtype(at::kInt)) : at::empty({M, P * PANEL}, x.options());
  float* op = sums ? nullptr : out.data_ptr<float>();
  int32_t* sp = sums ? out.data_ptr<int32_t>() : nullptr;
  const IntLinearFn fn = INT_LINEAR[resolve_isa(isa)];
  at::parallel_for(0, P, 1, [&, kind = kind, G = G](int64_t p0, int64_t p1) {
    int_panels(fn, kind, G, fmt, buf.rows, w, scales, zeros, M, group, op, sp, P * PANEL, p0, p1);
  });
  return out;
}

// x [M, K] fp32 -> the exact int32 sub-block sums of the integer-activation linear [M, K/S, P*16] (tests).
at::Tensor int_sums(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                    int64_t n, int64_t group, int64_t isa, int64_t fmt) {
  check_fp32(x, "int_sums x");
  return int_linear(x, w, scales, zeros, n, group, isa, true, fmt);
}

// ---- the linear ------------------------------------------------------------------------------------

// out [M, P*16] -> [M, n] (+ bias), in place of the padded columns.
at::Tensor with_bias(at::Tensor out, const c10::optional<at::Tensor>& bias, int64_t n, int64_t P) {
  const int64_t M = out.size(0);
  if (n < P * PANEL) out = out.narrow(1, 0, n).contiguous();
  if (bias.has_value()) {
    const auto b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "spectoolkit::linear: bias [n]");
    const float* bp = b.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < n; ++j) o[m * n + j] = o[m * n + j] + bp[j];
  }
  return out;
}

// x [M, K] fp32 @ packed weight -> [M, n] fp32 (+ bias). Packed (kernels/cpu.py): fp32/bf16 [P, K, 16];
// int8 [P, K, 16] codes; int4 (uint8) [P, K/2, 16] bytes; scales/zeros fp32 [P, G, 16] (quantized only).
// ``fmt`` > 0: a format's records (FMT: GGUF, rtn, GPTQ), int8 activations.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                  const c10::optional<at::Tensor>& bias, int64_t n, int64_t group, int64_t isa, int64_t fmt) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "spectoolkit::linear: x is fp32 [M, K]");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = w.size(0);
  if (w.dim() == 4 || fmt != WIDE)
    return with_bias(int_linear(xc, w, scales, zeros, n, group, isa, false, fmt), bias, n, P);
  TORCH_CHECK(w.dim() == 3 && w.size(2) == PANEL && w.is_contiguous(), "spectoolkit::linear: packed w [P, K, 16]");
  int kind = 0;
  switch (w.scalar_type()) {
    case at::kFloat: kind = 0; break;
    case at::kBFloat16: kind = 1; break;
    case at::kChar: kind = 2; break;
    case at::kByte: kind = zeros.numel() ? 3 : 4; break;  // 4-bit codes: int4 with zeros, nf4 without
    default: TORCH_CHECK(false, "spectoolkit::linear: packed fp32, bf16, int8 or 4-bit (uint8) weights");
  }
  TORCH_CHECK(w.size(1) == (kind >= 3 ? K / 2 : K) && n <= P * PANEL && n > (P - 1) * PANEL,
              "spectoolkit::linear: packed weight does not match x [M, K] or n");
  int64_t G = 1;
  if (kind >= 2) {
    TORCH_CHECK(group > 0 && K % group == 0 && group % 2 == 0, "spectoolkit::linear: group size divides K, even");
    G = K / group;
    TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == P * G * PANEL,
                "spectoolkit::linear: scales fp32 [P, G, 16]");
    TORCH_CHECK(kind != 3 || (zeros.is_contiguous() && zeros.scalar_type() == at::kFloat &&
                              zeros.numel() == P * G * PANEL),
                "spectoolkit::linear: zeros fp32 [P, G, 16]");
  }
  const float* xp = xc.data_ptr<float>();
  std::vector<float> xsum;
  if (kind == 3) {  // sum of x over each group, in order (the zero's multiplier)
    xsum.resize(M * G);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) s = s + xp[m * K + k];
        xsum[m * G + g] = s;
      }
  }
  auto out = at::empty({M, P * PANEL}, xc.options());
  const LinearFn fn = LINEAR[resolve_isa(isa)];
  float* op = out.data_ptr<float>();
  const float* sp = kind >= 2 ? scales.data_ptr<float>() : nullptr;
  const float* zp = kind == 3 ? zeros.data_ptr<float>() : nullptr;
  const void* wp = w.data_ptr();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    fn(kind, xp, wp, sp, zp, xsum.data(), M, K, G, kind >= 2 ? group : K, op, P * PANEL, p0, p1);
  });
  return with_bias(out, bias, n, P);
}

// ---- paged attention --------------------------------------------------------------------------------

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(c10::Float8_e4m3fn v) { return static_cast<float>(v); }

template <typename KV>
const float* widened_row(const KvRows& kv, int which, int64_t slot, float* buf) {
  const KV* src = static_cast<const KV*>(kv.store[which]) + slot * kv.D;
  const float* scale = kv.scale[which];
  if constexpr (std::is_same_v<KV, float>) {
    if (!scale) return src;
  }
  if (scale) {
    const float s = scale[slot];
    for (int64_t d = 0; d < kv.D; ++d) buf[d] = widen(src[d]) * s;
  } else {
    for (int64_t d = 0; d < kv.D; ++d) buf[d] = widen(src[d]);
  }
  return buf;
}

// new [W, H, width] rows to store [H, S, width] at slot write[i] (skipped where write[i] < 0).
void store_rows(const at::Tensor& fresh, const at::Tensor& store, const int64_t* write, int64_t W) {
  if (store.numel() == 0) return;
  TORCH_CHECK(store.dim() == 3 && store.is_contiguous() && fresh.scalar_type() == store.scalar_type(),
              "spectoolkit::paged_attention: a store is [H, S, width], written in its own dtype");
  const auto f = fresh.contiguous();
  const int64_t H = store.size(0), S = store.size(1), bytes = store.size(2) * store.element_size();
  TORCH_CHECK(f.numel() == W * H * store.size(2), "spectoolkit::paged_attention: new rows are [W, H, width]");
  const char* src = static_cast<const char*>(f.data_ptr());
  char* dst = static_cast<char*>(store.data_ptr());
  for (int64_t i = 0; i < W; ++i) {
    if (write[i] < 0) continue;
    TORCH_CHECK(write[i] < S, "spectoolkit::paged_attention: write slot outside the pool");
    for (int64_t h = 0; h < H; ++h) std::memcpy(dst + (h * S + write[i]) * bytes, src + (i * H + h) * bytes, bytes);
  }
}

// rows fp32 [W, H, D] -> (data [W, H, D] in the store's dtype, per-row scale fp32 [W, H, 1] when ``scaled``, else
// empty): the pool's own encoding (kvcache/formats.py), step for step in IEEE fp32 so the bits are the same.
// int8: scale = max |x| / 127, code = x / scale (a zero scale divides by 1) rounded half to even, clamped to
// ±127; fp8 (e4m3): x / scale clamped to ±448, rounded to e4m3 by c10's conversion; float stores: ATen's cast.
std::tuple<at::Tensor, at::Tensor> kv_encode(const at::Tensor& rows, const at::Tensor& store, bool scaled) {
  TORCH_CHECK(rows.dim() == 3 && rows.scalar_type() == at::kFloat, "spectoolkit::kv_encode: rows are fp32 [W, H, D]");
  const auto type = store.scalar_type();
  if (!scaled) return {rows.to(type).contiguous(), at::empty({0}, rows.options())};
  TORCH_CHECK(type == at::kChar || type == at::kFloat8_e4m3fn, "spectoolkit::kv_encode: scaled stores are int8 or fp8");
  const auto x = rows.contiguous();
  const int64_t D = x.size(2), R = x.numel() / D;
  auto data = at::empty(x.sizes(), x.options().dtype(type));
  auto scale = at::empty({x.size(0), x.size(1), 1}, x.options());
  const float* xp = x.data_ptr<float>();
  float* sp = scale.data_ptr<float>();
  const bool int8 = type == at::kChar;
  void* dp = data.data_ptr();
  for (int64_t r = 0; r < R; ++r) {
    const float* row = xp + r * D;
    if (int8) {
      sp[r] = int8_codes(row, D, static_cast<int8_t*>(dp) + r * D);
      continue;
    }
    const float s = absmax_scale(row, D, 448.f), safe = s == 0.f ? 1.f : s;
    sp[r] = s;
    c10::Float8_e4m3fn* out = static_cast<c10::Float8_e4m3fn*>(dp) + r * D;
    for (int64_t d = 0; d < D; ++d) out[d] = c10::Float8_e4m3fn(std::clamp(row[d] / safe, -448.f, 448.f));
  }
  return {data, scale};
}

// The step's new keys/values go to their pool slots first (``write`` >= 0), then every (row, head) attends
// the slots key_slots[starts[row] : starts[row + 1]] in that order. q [W, Hq, D] fp32; stores [Hkv, S, D]
// (fp32, bf16, fp16, int8 or fp8; int8/fp8 with per-row scales [Hkv, S, 1]).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                           const at::Tensor& k_scale_new, const at::Tensor& v_scale_new, at::Tensor k, at::Tensor v,
                           at::Tensor k_scale, at::Tensor v_scale, const at::Tensor& write, const at::Tensor& key_slots,
                           const at::Tensor& starts, double scale, int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "spectoolkit::paged_attention: q is fp32 [W, Hq, D]");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == v.scalar_type() && k.is_contiguous() &&
                  v.is_contiguous(),
              "spectoolkit::paged_attention: k/v stores [Hkv, S, D] of one dtype");
  const auto qc = q.contiguous();
  const auto wc = write.to(at::kLong).contiguous();
  const auto sc = key_slots.to(at::kLong).contiguous();
  const auto st = starts.to(at::kLong).contiguous();
  const int64_t W = qc.size(0), Hq = qc.size(1), D = qc.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(wc.numel() == W && st.numel() == W + 1 && Hq % Hkv == 0 && k.size(2) == D,
              "spectoolkit::paged_attention: shapes");
  TORCH_CHECK(D % PANEL == 0 && D <= MAX_HEAD_DIM, "spectoolkit::paged_attention: head dim a multiple of 16 up to ",
              MAX_HEAD_DIM, ", not ", D);
  const int64_t* slots = sc.data_ptr<int64_t>();
  for (int64_t i = 0; i < sc.numel(); ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < S, "spectoolkit::paged_attention: key slot outside the pool");
  const int64_t* first = st.data_ptr<int64_t>();
  for (int64_t r = 0; r < W; ++r)
    TORCH_CHECK(first[r] < first[r + 1] && first[r + 1] <= sc.numel(), "spectoolkit::paged_attention: every row "
                "attends at least one slot, within key_slots");
  const int64_t* wp = wc.data_ptr<int64_t>();
  store_rows(k_new, k, wp, W);
  store_rows(v_new, v, wp, W);
  store_rows(k_scale_new, k_scale, wp, W);
  store_rows(v_scale_new, v_scale, wp, W);
  KvRows kv{nullptr, {k.data_ptr(), v.data_ptr()}, {nullptr, nullptr}, D};
  if (k_scale.numel()) {
    TORCH_CHECK(k_scale.scalar_type() == at::kFloat && k_scale.numel() == Hkv * S && v_scale.numel() == Hkv * S,
                "spectoolkit::paged_attention: scales fp32 [Hkv, S, 1]");
    kv.scale[0] = k_scale.data_ptr<float>();
    kv.scale[1] = v_scale.data_ptr<float>();
  }
  switch (k.scalar_type()) {
    case at::kFloat: kv.row = widened_row<float>; break;
    case at::kBFloat16: kv.row = widened_row<c10::BFloat16>; break;
    case at::kHalf: kv.row = widened_row<c10::Half>; break;
    case at::kChar: kv.row = widened_row<int8_t>; break;
    case at::kFloat8_e4m3fn: kv.row = widened_row<c10::Float8_e4m3fn>; break;
    default: TORCH_CHECK(false, "spectoolkit::paged_attention: KV stored as fp32, bf16, fp16, int8 or fp8");
  }
  auto out = at::empty_like(qc);
  const AttendFn fn = ATTEND[resolve_isa(isa)];
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, W * Hq, 1, [&](int64_t i0, int64_t i1) { fn(qp, Hq, Hkv, S, slots, first, s, op, i0, i1, kv); });
  return out;
}

#include "layer.inc"

int64_t cpu_isa() { return best_isa(); }

// XOR of a buffer's 64-bit words on every thread (contiguous parts, 32-byte loads where AVX2 runs, 4 independent
// chains): reading memory at the rate this CPU streams it, what conditions' read bandwidth times.
__attribute__((target("avx2"))) uint64_t xor_avx2(const uint64_t* p, int64_t a, int64_t b) {
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int64_t i = a * 8; i < b * 8; i += 16)
    for (int j = 0; j < 4; ++j)
      acc[j] = _mm256_xor_si256(acc[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 4 * j)));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(_mm256_xor_si256(acc[0], acc[1]),
                                                                          _mm256_xor_si256(acc[2], acc[3])));
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
}

int64_t read_words(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.is_contiguous() && buffer.nbytes() % 128 == 0, "spectoolkit::read_words: 128-byte multiple");
  const uint64_t* p = static_cast<const uint64_t*>(buffer.data_ptr());
  const int64_t n = static_cast<int64_t>(buffer.nbytes() / 8);
  const bool avx2 = isa_runs(AVX2);
  std::vector<uint64_t> parts(at::get_num_threads() + 1, 0);
  at::parallel_for(0, n / 16, 1 << 13, [&](int64_t a, int64_t b) {
    uint64_t x = 0;
    if (avx2) {
      x = xor_avx2(p, 2 * a, 2 * b);
    } else {
      for (int64_t i = a * 16; i < b * 16; ++i) x ^= p[i];
    }
    parts[at::get_thread_num()] ^= x;
  });
  uint64_t total = 0;
  for (const uint64_t x : parts) total ^= x;
  return static_cast<int64_t>(total);
}

bool isa_available(int64_t isa) { return isa_runs(isa); }

// The bytes ahead the linears prefetch their weight stream from now on, in every thread (0: none).
void set_stream_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes <= (1 << 20), "spectoolkit::set_stream_prefetch: 0 to 1 MiB ahead, not ", bytes);
  stream_prefetch.store(bytes);
}

int64_t get_stream_prefetch() { return stream_prefetch.load(); }

}  // namespace

TORCH_LIBRARY(spectoolkit, m) {
  m.def("linear(Tensor x, Tensor w, Tensor scales, Tensor zeros, Tensor? bias, int n, int group, int isa=-1, "
        "int fmt=0) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor k_scale_new, Tensor v_scale_new, "
        "Tensor(a!) k, Tensor(b!) v, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor write, Tensor key_slots, "
        "Tensor starts, float scale, int isa=-1) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps, int isa=-1) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up, int isa=-1) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int isa=-1) -> Tensor");
  m.def("rope_table(Tensor inv_freq, int first, int count, float scaling) -> (Tensor, Tensor)");
  m.def("attn_in(Tensor hidden, Tensor norm_w, float eps, Tensor[] qkv, int[] meta, Tensor cos, Tensor sin, int Hq, "
        "int Hkv, int D, Tensor q_norm_w, Tensor k_norm_w, float qk_eps, int isa=-1) -> (Tensor, Tensor, Tensor)");
  m.def("layer_tail(Tensor hidden, Tensor q, Tensor k_rows, Tensor v_rows, Tensor(a!) k, Tensor(b!) v, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor write, Tensor key_slots, "
        "Tensor starts, float scale, Tensor norm_w, float eps, Tensor[] linears, int[] meta, int isa=-1) -> Tensor");
  m.def("decoder_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] meta, float[] eps, "
        "Tensor(a!)[] stores, Tensor write, Tensor key_slots, Tensor starts, int Hq, int Hkv, int D, float scale, "
        "int[] capture, int isa=-1) -> (Tensor, Tensor)");
  m.def("kv_encode(Tensor rows, Tensor store, bool scaled) -> (Tensor, Tensor)");
  m.def("quantize_activations(Tensor x, int isa=0) -> (Tensor, Tensor)");
  m.def("int_sums(Tensor x, Tensor w, Tensor scales, Tensor zeros, int n, int group, int isa=-1, int fmt=0) -> Tensor");
  m.def("cpu_isa() -> int", &cpu_isa);
  m.def("read_words(Tensor buffer) -> int", &read_words);
  m.def("isa_available(int isa) -> bool", &isa_available);
  m.def("set_stream_prefetch(int bytes) -> ()", &set_stream_prefetch);
  m.def("stream_prefetch() -> int", &get_stream_prefetch);
}
TORCH_LIBRARY_IMPL(spectoolkit, CPU, m) {
  m.impl("linear", &linear);
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
  m.impl("rope_table", &rope_table);
  m.impl("attn_in", &attn_in);
  m.impl("layer_tail", &layer_tail);
  m.impl("decoder_layers", &decoder_layers);
  m.impl("kv_encode", &kv_encode);
  m.impl("quantize_activations", &quantize_activations);
  m.impl("int_sums", &int_sums);
}
