// Integer dot products for llmlib's int8 and int4 weights: AVX-512 VNNI, or AVX2 where the CPU
// has no AVX-512.
//
// The weight-only kernels PyTorch ships for the CPU turn every stored code back into a float and
// multiply in floating point. VNNI multiplies bytes by bytes: one `vpdpbusd` takes 64 unsigned
// bytes and 64 signed ones and adds each group of four products into one of 16 int32 lanes. AVX2
// takes two instructions for half as many bytes: `vpmaddubsw` multiplies 32 unsigned bytes by 32
// signed ones and adds neighbours into 16-bit sums, `vpmaddwd` against ones adds those pairs into
// 32-bit lanes. To use either, the activations must be integers too, so each row of the input is
// rounded to int8 in blocks of 32 values with one float scale per block (what llama.cpp's Q8_0
// does), and each block's integer sum is scaled back into a float accumulator.
//
// Weights are stored in tiles of 64 output channels. Inside a tile, for every group of four input
// columns, 64 channels x 4 codes lie side by side (256 bytes): one 64-byte load then holds four
// consecutive codes of 16 channels, the layout both instruction sets want against four
// activation bytes broadcast to every lane.
//
//   int8: w[n, k] = scale[n] * (u[n, k] - 128), u stored as uint8 (VNNI's unsigned operand); the
//         128 comes back out as 128 * (sum of the block's activation codes). On AVX2 the 16-bit
//         sums would overflow (2 x 255 x 127), so the kernel takes the signed code q = u - 128,
//         multiplies |q| by x carrying q's sign (at most 2 x 128 x 127), as llama.cpp does.
//   int4: w[n, k] = d[n, g] * q[n, k] + m[n, g] for group g = k / group_size, q in 0..15; two
//         groups of four columns share each 64-byte load (low and high nibbles).
//   int8 in groups (GGUF's Q8_0, Q5_x, Q6_K, ... once their constants are multiplied out):
//         w[n, k] = d[n, g] * (u[n, k] - 128) + m[n, g], u stored as for int8; groups of 16
//         split each activation block in two halves, each summed and corrected on its own.
//         A k-quant's d is a float16 per 256 weights times a small integer per group; kept as
//         that integer (int8) and the float per 256 apart, d costs 1.25 bytes per group instead
//         of a float32's 4 (the product does not fit a float16).
//   int6 in groups (Q6_K, and any 8-bit group codes in -32..31): the same constants, the codes
//         c = q + 32 in 0..63 kept in six bits, as the file keeps Q6_K: per 16 columns, two
//         int4-style nibble planes and one plane of the top two bits of four column quads.
//
// Python (llmlib/vnni.py) packs the weights; tests/test_vnni.py checks each product against the
// same arithmetic in float64.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t QK = 32;    // activation block: one int8 scale per 32 values
constexpr int64_t TILE = 64;  // output channels per weight tile
constexpr int64_t UNIT = 256;  // weights per k-quant super-block: one float unit of the d's
// bytes ahead of the loads to ask the memory system for: a step streams every weight from
// memory once, and the hardware prefetcher alone starts over at each 4 KiB page
constexpr int64_t PREFETCH = 4096;

// ---- sixteen lanes: one AVX-512 register, or two AVX2 ones ---------------------------------
// F16: 16 floats; I16: 64 bytes, read as 16 int32 sums or as 16 channels x 4 codes.
#if defined(__AVX512VNNI__)
// groups of 16 channels worked on per pass over a tile: all four (R rows x 4 integer and float
// accumulators fit in 32 registers)
constexpr int J = 4;
constexpr int32_t INT8_OFFSET = 128;  // dpbusd reads the stored u = q + 128 as it is
struct F16 {
  __m512 v;
};
struct I16 {
  __m512i v;
};
inline F16 fzero() { return {_mm512_setzero_ps()}; }
inline F16 fset(float f) { return {_mm512_set1_ps(f)}; }
inline F16 fload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F16 fload(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline F16 fload(const at::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline F16 fmul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline void fstore(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
inline I16 izero() { return {_mm512_setzero_si512()}; }
inline I16 iload(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline I16 iset(int32_t v) { return {_mm512_set1_epi32(v)}; }
inline void istore(uint8_t* p, I16 a) { _mm512_storeu_si512(p, a.v); }
inline I16 iadd8(I16 a, int8_t b) { return {_mm512_add_epi8(a.v, _mm512_set1_epi8(b))}; }
inline F16 to_float(I16 a, int32_t minus) {
  return {_mm512_cvtepi32_ps(_mm512_sub_epi32(a.v, _mm512_set1_epi32(minus)))};
}
inline void nibbles(I16 raw, I16& lo, I16& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  lo = {_mm512_and_si512(raw.v, low)};
  hi = {_mm512_and_si512(_mm512_srli_epi16(raw.v, 4), low)};
}
// 6-bit codes of four column quads: the low nibbles of quads 0-1 (l01) and 2-3 (l23), the
// top two bits of all four in one byte (h, quad i in bits 2i..2i+1)
inline void sixes(I16 l01, I16 l23, I16 h, I16 (&q)[4]) {
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  q[0] = {_mm512_or_si512(_mm512_and_si512(l01.v, low), _mm512_and_si512(_mm512_slli_epi16(h.v, 4), top))};
  q[1] = {_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l01.v, 4), low),
                          _mm512_and_si512(_mm512_slli_epi16(h.v, 2), top))};
  q[2] = {_mm512_or_si512(_mm512_and_si512(l23.v, low), _mm512_and_si512(h.v, top))};
  q[3] = {_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l23.v, 4), low),
                          _mm512_and_si512(_mm512_srli_epi16(h.v, 2), top))};
}
// the int32 sums less `minus`, as floats (whatever the build's int8 offset)
inline F16 to_float_less(I16 a, int32_t minus) {
  return {_mm512_cvtepi32_ps(_mm512_sub_epi32(a.v, _mm512_set1_epi32(minus)))};
}
// acc += four products per lane of stored int8 codes and activation codes
inline I16 dot_int8(I16 acc, I16 u, I16 x) { return {_mm512_dpbusd_epi32(acc.v, u.v, x.v)}; }
// acc += four products of low nibbles with x0 and four of high nibbles with x1, per lane
inline I16 dot_int4(I16 acc, I16 lo, I16 x0, I16 hi, I16 x1) {
  return {_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc.v, lo.v, x0.v), hi.v, x1.v)};
}

inline __m512 load_row16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Round one row to int8 in blocks of QK: xq = round(x / d), d = max|x| / 127 per block.
template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* xq, float* sx, int32_t* sum) {
  static_assert(QK == 32, "two vectors of 16 per block");
  for (int64_t b = 0; b < K / QK; ++b) {
    const __m512 v0 = load_row16(x + b * QK), v1 = load_row16(x + b * QK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.f;
    const __m512 id = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    // round to nearest, ties to even (the default MXCSR mode), as std::nearbyint would
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * QK), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * QK + 16), _mm512_cvtsepi32_epi8(q1));
    sx[b] = d;
    sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}
#else  // AVX2 + FMA + F16C: each lane pair is two 256-bit halves of eight
// one group of 16 channels per pass over a tile: 16 registers hold R rows x (2 + 2) halves of
// accumulators for one group only
constexpr int J = 1;
constexpr int32_t INT8_OFFSET = 0;  // the sign trick multiplies by q = u - 128 directly
struct F16 {
  __m256 lo, hi;
};
struct I16 {
  __m256i lo, hi;
};
inline F16 fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 fset(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline F16 fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline F16 fload(const at::Half* p) { return {half8(p), half8(p + 8)}; }
inline __m256 byte8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline F16 fload(const int8_t* p) { return {byte8(p), byte8(p + 8)}; }
inline F16 fmul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 fmadd(F16 a, F16 b, F16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline void fstore(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline I16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 iload(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline I16 iset(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline void istore(uint8_t* p, I16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), a.hi);
}
inline I16 iadd8(I16 a, int8_t b) {
  const __m256i v = _mm256_set1_epi8(b);
  return {_mm256_add_epi8(a.lo, v), _mm256_add_epi8(a.hi, v)};
}
inline F16 to_float(I16 a, int32_t) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline void nibbles(I16 raw, I16& lo, I16& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  lo = {_mm256_and_si256(raw.lo, low), _mm256_and_si256(raw.hi, low)};
  hi = {_mm256_and_si256(_mm256_srli_epi16(raw.lo, 4), low),
        _mm256_and_si256(_mm256_srli_epi16(raw.hi, 4), low)};
}
inline __m256i six8(__m256i l, __m256i h, int lshift, int hshift) {
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i lo = _mm256_and_si256(lshift ? _mm256_srli_epi16(l, 4) : l, low);
  const __m256i hs = hshift > 0 ? _mm256_slli_epi16(h, hshift)
                                : hshift < 0 ? _mm256_srli_epi16(h, -hshift) : h;
  return _mm256_or_si256(lo, _mm256_and_si256(hs, top));
}
// 6-bit codes of four column quads (see the AVX-512 version)
inline void sixes(I16 l01, I16 l23, I16 h, I16 (&q)[4]) {
  q[0] = {six8(l01.lo, h.lo, 0, 4), six8(l01.hi, h.hi, 0, 4)};
  q[1] = {six8(l01.lo, h.lo, 1, 2), six8(l01.hi, h.hi, 1, 2)};
  q[2] = {six8(l23.lo, h.lo, 0, 0), six8(l23.hi, h.hi, 0, 0)};
  q[3] = {six8(l23.lo, h.lo, 1, -2), six8(l23.hi, h.hi, 1, -2)};
}
inline F16 to_float_less(I16 a, int32_t minus) {
  const __m256i m = _mm256_set1_epi32(minus);
  return {_mm256_cvtepi32_ps(_mm256_sub_epi32(a.lo, m)), _mm256_cvtepi32_ps(_mm256_sub_epi32(a.hi, m))};
}
// 16-bit pair sums -> 32-bit sums of four, added to acc
inline __m256i widen_add(__m256i acc, __m256i pairs) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline __m256i dot8_int8(__m256i acc, __m256i u, __m256i x) {
  const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(char(0x80)));  // u - 128, as int8
  // |q| (unsigned; -128 reads as 128) times x with q's sign: q * x without 16-bit overflow
  return widen_add(acc, _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)));
}
inline I16 dot_int8(I16 acc, I16 u, I16 x) {
  return {dot8_int8(acc.lo, u.lo, x.lo), dot8_int8(acc.hi, u.hi, x.hi)};
}
inline __m256i dot8_int4(__m256i acc, __m256i lo, __m256i x0, __m256i hi, __m256i x1) {
  // each 16-bit sum is at most 2 x 15 x 128, so the two nibbles' sums add before widening
  return widen_add(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)));
}
inline I16 dot_int4(I16 acc, I16 lo, I16 x0, I16 hi, I16 x1) {
  return {dot8_int4(acc.lo, lo.lo, x0.lo, hi.lo, x1.lo), dot8_int4(acc.hi, lo.hi, x0.hi, hi.hi, x1.hi)};
}

inline __m256 load_row8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_row8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Round one row to int8 in blocks of QK: xq = round(x / d), d = max|x| / 127 per block.
template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* xq, float* sx, int32_t* sum) {
  static_assert(QK == 32, "four vectors of 8 per block");
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / QK; ++b) {
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load_row8(x + b * QK + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float d = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1))) / 127.f;
    const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i q[4];  // round to nearest, ties to even (the default MXCSR mode)
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    // saturating packs work within 128-bit lanes; the permutation puts the 32 codes in order
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * QK),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    sx[b] = d;
    sum[b] = _mm_cvtsi128_si32(t);
  }
}
#endif

inline I16 broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return iset(v);
}

template <typename T>
inline void store16(T* y, F16 v) {
  if constexpr (std::is_same_v<T, float>) {
    fstore(y, v);
  } else {
    alignas(64) float tmp[16];
    fstore(tmp, v);
    for (int i = 0; i < 16; ++i) y[i] = static_cast<T>(tmp[i]);
  }
}

// the accumulators of one pass over a tile, R rows x J groups of 16 channels, in registers
template <int R, typename V>
inline void fill(V (&a)[R][J], V v) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) a[r][j] = v;
}

// R rows of activations against one int8 tile: y[r][0..64), J groups of 16 channels per pass.
// Each load of weights feeds R instructions, one per row.
template <int R, typename T>
void int8_tile(const uint8_t* w, const float* scale, const int8_t* xq, const float* sx,
               const int32_t* sum, int64_t K, T* y, int64_t ldy) {
  const int64_t nb = K / QK;
  for (int j0 = 0; j0 < 4; j0 += J) {
    F16 accf[R][J];
    fill(accf, fzero());
    for (int64_t b = 0; b < nb; ++b) {
      I16 acc[R][J];
      fill(acc, izero());
      const uint8_t* wb = w + b * QK * TILE;
      for (int64_t g = 0; g < QK / 4; ++g) {
        I16 xv[R];
        for (int r = 0; r < R; ++r) xv[r] = broadcast4(xq + r * K + b * QK + g * 4);
        const uint8_t* wg = wb + g * 4 * TILE + j0 * 64;
        for (int j = 0; j < J; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(wg + j * 64 + PREFETCH), _MM_HINT_T0);
          const I16 wv = iload(wg + j * 64);
          for (int r = 0; r < R; ++r) acc[r][j] = dot_int8(acc[r][j], wv, xv[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int32_t corr = INT8_OFFSET * sum[r * nb + b];
        const F16 sv = fset(sx[r * nb + b]);
        for (int j = 0; j < J; ++j) accf[r][j] = fmadd(to_float(acc[r][j], corr), sv, accf[r][j]);
      }
    }
    for (int j = 0; j < J; ++j) {
      const F16 sc = fload(scale + (j0 + j) * 16);
      for (int r = 0; r < R; ++r) store16(y + r * ldy + (j0 + j) * 16, fmul(accf[r][j], sc));
    }
  }
}

// R rows of activations against one int4 tile: y[r][0..64). `d` and `m` are this tile's
// [K / group, 64] constants: float16, or (a k-quant's, Q4_K's) int8 integers that `du` and `mu`,
// this tile's [K / 256, 64] float16 units, multiply (the block's d and -dmin).
template <int R, typename C, typename T>
void int4_tile(const uint8_t* w, const C* d, const C* m, const at::Half* du, const at::Half* mu,
               int64_t group, const int8_t* xq, const float* sx, const int32_t* sum, int64_t K,
               T* y, int64_t ldy) {
  const int64_t nb = K / QK;
  for (int j0 = 0; j0 < 4; j0 += J) {
    F16 accf[R][J];
    fill(accf, fzero());
    for (int64_t b = 0; b < nb; ++b) {
      I16 acc[R][J];
      fill(acc, izero());
      const uint8_t* wb = w + b * (QK / 2) * TILE;  // 32 columns x 64 channels, two per byte
      for (int64_t p = 0; p < QK / 8; ++p) {
        I16 x0[R], x1[R];
        for (int r = 0; r < R; ++r) {
          x0[r] = broadcast4(xq + r * K + b * QK + p * 8);
          x1[r] = broadcast4(xq + r * K + b * QK + p * 8 + 4);
        }
        const uint8_t* wp = wb + p * 4 * TILE + j0 * 64;
        for (int j = 0; j < J; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(wp + j * 64 + PREFETCH), _MM_HINT_T0);
          I16 lo, hi;
          nibbles(iload(wp + j * 64), lo, hi);
          for (int r = 0; r < R; ++r) acc[r][j] = dot_int4(acc[r][j], lo, x0[r], hi, x1[r]);
        }
      }
      const int64_t g = (b * QK) / group;
      for (int j = 0; j < J; ++j) {
        F16 dv = fload(d + g * TILE + (j0 + j) * 16);
        F16 mv = fload(m + g * TILE + (j0 + j) * 16);
        if constexpr (std::is_same_v<C, int8_t>) {
          const int64_t at = (b * QK / UNIT) * TILE + (j0 + j) * 16;
          dv = fmul(dv, fload(du + at));
          mv = fmul(mv, fload(mu + at));
        }
        for (int r = 0; r < R; ++r) {
          const float e = sx[r * nb + b];
          const F16 ms = fset(e * static_cast<float>(sum[r * nb + b]));
          accf[r][j] = fmadd(fmul(to_float(acc[r][j], 0), fset(e)), dv, accf[r][j]);
          accf[r][j] = fmadd(mv, ms, accf[r][j]);
        }
      }
    }
    for (int j = 0; j < J; ++j)
      for (int r = 0; r < R; ++r) store16(y + r * ldy + (j0 + j) * 16, accf[r][j]);
  }
}

// R rows of activations against one 8-bit group tile: y[r][0..64), w[n, k] = d[n, g] * (u[n, k] -
// 128) + m[n, g] for group g = k / group, u stored as in int8_tile. `d` and `m` are this tile's
// [K / group, 64] constants (float16, or float32 where float16 does not hold them exactly, or
// int8 integers that `u`, this tile's [K / 256, 64] float32 units, multiplies). The
// integer sums run over S columns at a time: 32 (an activation block) for groups that are
// multiples of 32, 16 for groups of 16, where each half of a block meets its own group's
// constants and takes its own correction `sum` (the activation codes summed over those S columns).
template <int R, int S, typename C, typename M, typename T>
void int8g_tile(const uint8_t* w, const C* d, const M* m, const float* u, int64_t group,
                const int8_t* xq, const float* sx, const int32_t* sum, int64_t K, T* y,
                int64_t ldy) {
  static_assert(QK % S == 0 && S % 4 == 0, "S columns divide an activation block");
  const int64_t nb = K / QK, ns = K / S;
  for (int j0 = 0; j0 < 4; j0 += J) {
    F16 accf[R][J];
    fill(accf, fzero());
    for (int64_t s = 0; s < ns; ++s) {
      I16 acc[R][J];
      fill(acc, izero());
      const uint8_t* ws = w + s * S * TILE;
      for (int64_t g = 0; g < S / 4; ++g) {
        I16 xv[R];
        for (int r = 0; r < R; ++r) xv[r] = broadcast4(xq + r * K + s * S + g * 4);
        const uint8_t* wg = ws + g * 4 * TILE + j0 * 64;
        for (int j = 0; j < J; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(wg + j * 64 + PREFETCH), _MM_HINT_T0);
          const I16 wv = iload(wg + j * 64);
          for (int r = 0; r < R; ++r) acc[r][j] = dot_int8(acc[r][j], wv, xv[r]);
        }
      }
      const int64_t b = s * S / QK, grp = s * S / group;
      for (int j = 0; j < J; ++j) {
        F16 dv = fload(d + grp * TILE + (j0 + j) * 16);
        if (u != nullptr) dv = fmul(dv, fload(u + (s * S / UNIT) * TILE + (j0 + j) * 16));
        for (int r = 0; r < R; ++r) {
          const float e = sx[r * nb + b];
          const int32_t xs = sum[r * ns + s];
          const F16 q = fmul(to_float(acc[r][j], INT8_OFFSET * xs), fset(e));  // e * sum q x
          accf[r][j] = fmadd(q, dv, accf[r][j]);
        }
        if (m != nullptr) {  // offsets (Q5_1, ...); Q8_0 and Q6_K have none
          const F16 mv = fload(m + grp * TILE + (j0 + j) * 16);
          for (int r = 0; r < R; ++r)
            accf[r][j] = fmadd(mv, fset(sx[r * nb + b] * static_cast<float>(sum[r * ns + s])),
                               accf[r][j]);
        }
      }
    }
    for (int j = 0; j < J; ++j)
      for (int r = 0; r < R; ++r) store16(y + r * ldy + (j0 + j) * 16, accf[r][j]);
  }
}

// R rows of activations against one 6-bit tile: y[r][0..64), w[n, k] = d[n, g] * (c[n, k] - 32)
// + m[n, g], c in 0..63 (GGUF's Q6_K as stored). Per 16 columns the tile holds 768 bytes: the
// low nibbles (quads 0-1, then 2-3, each 4 x 64 bytes as in int4_tile) and the top two bits of
// all four quads (4 x 64 bytes). Integer sums run over S columns (16 for groups of 16, else
// an activation block's 32), each corrected by 32 times the activation codes' sum over them
// (`sum`, K / S per row); the constants are as in int8g_tile.
template <int R, int S, typename C, typename M, typename T>
void int6_tile(const uint8_t* w, const C* d, const M* m, const float* u, int64_t group,
               const int8_t* xq, const float* sx, const int32_t* sum, int64_t K, T* y,
               int64_t ldy) {
  constexpr int64_t BYTES = 16 * TILE * 6 / 8;  // per 16 columns
  const int64_t nb = K / QK, ns = K / S;
  for (int j0 = 0; j0 < 4; j0 += J) {
    F16 accf[R][J];
    fill(accf, fzero());
    for (int64_t s = 0; s < ns; ++s) {
      I16 acc[R][J];
      fill(acc, izero());
      for (int64_t h = 0; h < S / 16; ++h) {  // S columns summed in integers, 16 at a time
        const int64_t c0 = s * S + h * 16;
        const uint8_t* ws = w + (c0 / 16) * BYTES;
        I16 x[R][4];
        for (int r = 0; r < R; ++r)
          for (int g = 0; g < 4; ++g) x[r][g] = broadcast4(xq + r * K + c0 + g * 4);
        for (int j = 0; j < J; ++j) {
          const uint8_t* wj = ws + (j0 + j) * 64;
          _mm_prefetch(reinterpret_cast<const char*>(wj + PREFETCH), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(wj + 256 + PREFETCH), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(wj + 512 + PREFETCH), _MM_HINT_T0);
          I16 q[4];
          sixes(iload(wj), iload(wj + 256), iload(wj + 512), q);
          for (int r = 0; r < R; ++r) {
            acc[r][j] = dot_int4(acc[r][j], q[0], x[r][0], q[1], x[r][1]);
            acc[r][j] = dot_int4(acc[r][j], q[2], x[r][2], q[3], x[r][3]);
          }
        }
      }
      const int64_t b = s * S / QK, grp = s * S / group;
      for (int j = 0; j < J; ++j) {
        F16 dv = fload(d + grp * TILE + (j0 + j) * 16);
        if (u != nullptr) dv = fmul(dv, fload(u + (s * S / UNIT) * TILE + (j0 + j) * 16));
        for (int r = 0; r < R; ++r) {
          const F16 q = fmul(to_float_less(acc[r][j], 32 * sum[r * ns + s]), fset(sx[r * nb + b]));
          accf[r][j] = fmadd(q, dv, accf[r][j]);
        }
        if (m != nullptr) {
          const F16 mv = fload(m + grp * TILE + (j0 + j) * 16);
          for (int r = 0; r < R; ++r)
            accf[r][j] = fmadd(mv, fset(sx[r * nb + b] * static_cast<float>(sum[r * ns + s])),
                               accf[r][j]);
        }
      }
    }
    for (int j = 0; j < J; ++j)
      for (int r = 0; r < R; ++r) store16(y + r * ldy + (j0 + j) * 16, accf[r][j]);
  }
}

// With many rows a tile is read from memory once and then from cache, once per pair of rows, so
// the next tile is asked for a slice at a time while this one is worked on (before each pair):
// the memory stream then runs under the arithmetic instead of between tiles.
inline void prefetch_slice(const uint8_t* next, int64_t bytes, int64_t pair, int64_t pairs) {
  const int64_t per = (bytes / pairs + 63) / 64 * 64;
  for (int64_t o = pair * per; o < std::min(bytes, (pair + 1) * per); o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
}

// The rounded activations: per-thread scratch (a decode step's rows are small; no allocation
// per product), filled by the calling thread before the parallel loop reads it.
// float32 or bfloat16 activations (check_input refuses the rest)
template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  if (t == at::kBFloat16) f(c10::BFloat16{});
  else f(float{});
}

struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
};

const QuantizedRows& quantize_rows(const at::Tensor& x) {
  thread_local QuantizedRows r;
  const int64_t M = x.size(0), K = x.size(1);
  r.q.resize(M * K);
  r.scale.resize(M * (K / QK));
  r.sum.resize(M * (K / QK));
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    for (int64_t i = 0; i < M; ++i)
      quantize_row(xp + i * K, K, r.q.data() + i * K, r.scale.data() + i * (K / QK),
                   r.sum.data() + i * (K / QK));
  });
  return r;
}

void check_input(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": expected x [M, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
}

// x [M, K] (float32 or bfloat16) @ int8 tiles [N / 64, K * 64] -> [M, N] in x's dtype
at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& scale) {
  const int64_t tiles = w.size(0), N = tiles * TILE, K = w.size(1) / TILE;
  TORCH_CHECK(K % QK == 0 && scale.numel() == N && scale.scalar_type() == at::kFloat,
              "int8_linear: bad weight layout");
  check_input(x_, K, "int8_linear");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows& r = quantize_rows(x);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const float* sp = scale.data_ptr<float>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, tiles, 1, [&](int64_t a, int64_t e) {
      for (int64_t t = a; t < e; ++t) {
        const uint8_t* wt = wp + t * K * TILE;
        int64_t i = 0;
        for (; i + 2 <= M; i += 2) {  // two rows share each load of the tile
          if (M > 2 && t + 1 < e) prefetch_slice(wt + K * TILE, K * TILE, i / 2, M / 2);
          int8_tile<2>(wt, sp + t * TILE, r.q.data() + i * K, r.scale.data() + i * (K / QK),
                       r.sum.data() + i * (K / QK), K, yp + i * N + t * TILE, N);
        }
        if (i < M)
          int8_tile<1>(wt, sp + t * TILE, r.q.data() + i * K, r.scale.data() + i * (K / QK),
                       r.sum.data() + i * (K / QK), K, yp + i * N + t * TILE, N);
      }
    });
  });
  return y;
}

// x [M, K] @ int4 tiles [N / 64, K * 32] with float16 d, m [N / 64, K / group * 64], or int8
// d, m with float16 units du, mu [N / 64, K / 256 * 64] (else empty) -> [M, N]
at::Tensor int4_linear(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& d,
                       const at::Tensor& m, const std::optional<at::Tensor>& du_,
                       const std::optional<at::Tensor>& mu_, int64_t group) {
  const int64_t tiles = w.size(0), N = tiles * TILE, K = w.size(1) * 2 / TILE;
  TORCH_CHECK(K % QK == 0 && group % QK == 0 && K % group == 0, "int4_linear: bad group size");
  const bool units = d.scalar_type() == at::kChar;
  // none (a compiled graph passes an empty constant as none) or empty: no units
  const at::Tensor du = du_.has_value() ? *du_ : at::Tensor(), mu = mu_.has_value() ? *mu_ : at::Tensor();
  TORCH_CHECK(!units || (du.defined() && mu.defined()), "int4_linear: int8 constants need units");
  TORCH_CHECK((d.scalar_type() == at::kHalf || units) && m.scalar_type() == d.scalar_type() &&
                  d.numel() == N * (K / group) && m.numel() == d.numel() && d.is_contiguous() &&
                  m.is_contiguous(),
              "int4_linear: bad constants");
  TORCH_CHECK(units ? (K % UNIT == 0 && du.scalar_type() == at::kHalf &&
                       mu.scalar_type() == at::kHalf && du.numel() == N * (K / UNIT) &&
                       mu.numel() == du.numel() && du.is_contiguous() && mu.is_contiguous())
                    : (!du.defined() || du.numel() == 0) && (!mu.defined() || mu.numel() == 0),
              "int4_linear: int8 constants take float16 units per 256 columns, others none");
  check_input(x_, K, "int4_linear");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), per_tile = (K / group) * TILE, per_unit = (K / UNIT) * TILE;
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows& r = quantize_rows(x);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const at::Half* dup = units ? du.data_ptr<at::Half>() : nullptr;
    const at::Half* mup = units ? mu.data_ptr<at::Half>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    auto run = [&](auto ctag) {
      using C = decltype(ctag);
      const C* dp = d.data_ptr<C>();
      const C* mp = m.data_ptr<C>();
      at::parallel_for(0, tiles, 1, [&](int64_t a, int64_t e) {
        for (int64_t t = a; t < e; ++t) {
          const uint8_t* wt = wp + t * K * TILE / 2;
          const C* dt = dp + t * per_tile;
          const C* mt = mp + t * per_tile;
          const at::Half* dut = units ? dup + t * per_unit : nullptr;
          const at::Half* mut = units ? mup + t * per_unit : nullptr;
          int64_t i = 0;
          for (; i + 2 <= M; i += 2) {  // two rows share each load (and unpacking) of the tile
            if (M > 2 && t + 1 < e) prefetch_slice(wt + K * TILE / 2, K * TILE / 2, i / 2, M / 2);
            int4_tile<2>(wt, dt, mt, dut, mut, group, r.q.data() + i * K,
                         r.scale.data() + i * (K / QK), r.sum.data() + i * (K / QK), K,
                         yp + i * N + t * TILE, N);
          }
          if (i < M)
            int4_tile<1>(wt, dt, mt, dut, mut, group, r.q.data() + i * K,
                         r.scale.data() + i * (K / QK), r.sum.data() + i * (K / QK), K,
                         yp + i * N + t * TILE, N);
        }
      });
    };
    if (units) run(int8_t{});
    else run(at::Half{});
  });
  return y;
}

// the activation codes' sums over every 16 columns (groups of 16 correct each half block)
const std::vector<int32_t>& sums16(const QuantizedRows& r, int64_t n) {
  thread_local std::vector<int32_t> halves;
  halves.resize(n / 16);
  for (int64_t i = 0; i < n / 16; ++i) {
    int32_t s = 0;
    for (int64_t c = 0; c < 16; ++c) s += r.q[i * 16 + c];
    halves[i] = s;
  }
  return halves;
}

// One 6-bit tile (int6_tile's layout, K columns) widened to the 8-bit group tile's layout, u =
// c + 96 so that u - 128 = c - 32: the codes int6_tile multiplies, byte for byte. A prompt's many
// rows then go through int8g_tile and pay for the unpacking once a tile, not once a pair of rows;
// the integer sums, and so the results, are the same.
inline void widen6(const uint8_t* w, int64_t K, uint8_t* out) {
  constexpr int64_t BYTES = 16 * TILE * 6 / 8;  // per 16 columns
  for (int64_t c0 = 0; c0 < K; c0 += 16) {
    const uint8_t* ws = w + (c0 / 16) * BYTES;
    for (int j = 0; j < 4; ++j) {
      I16 q[4];
      sixes(iload(ws + j * 64), iload(ws + j * 64 + 256), iload(ws + j * 64 + 512), q);
      for (int g = 0; g < 4; ++g) istore(out + c0 * TILE + g * 4 * TILE + j * 64, iadd8(q[g], 96));
    }
  }
}

// rows of a 6-bit product from which its tiles are widened first (widen6)
constexpr int64_t WIDEN_ROWS = 16;

// R rows against one tile of 6- or 8-bit group codes (BITS), the same constants either way
template <int BITS, int R, int S, typename C, typename M, typename T>
inline void group_tile(const uint8_t* w, const C* d, const M* m, const float* u, int64_t group,
                       const int8_t* xq, const float* sx, const int32_t* sum, int64_t K, T* y,
                       int64_t ldy) {
  if constexpr (BITS == 8) int8g_tile<R, S>(w, d, m, u, group, xq, sx, sum, K, y, ldy);
  else int6_tile<R, S>(w, d, m, u, group, xq, sx, sum, K, y, ldy);
}

// one group product, its types fixed: BITS per code, S columns per integer sum (16 or 32),
// constants C, activations T; `sum` holds the activation codes' sums over every S columns,
// K / S per row
template <int BITS, int S, typename C, typename Mc, typename T>
void group_run(const uint8_t* wp, const C* dp, const Mc* mp, const float* up, int64_t group,
               const QuantizedRows& r, const int32_t* sum, int64_t M, int64_t K, int64_t tiles,
               T* yp) {
  const int64_t N = tiles * TILE, per_tile = (K / group) * TILE, nb = K / QK, ns = K / S;
  const int64_t per_unit = (K / UNIT) * TILE, bytes = K * TILE * BITS / 8;
  at::parallel_for(0, tiles, 1, [&](int64_t a, int64_t e) {
    std::vector<uint8_t> wide(BITS == 6 && M >= WIDEN_ROWS ? K * TILE : 0);
    for (int64_t t = a; t < e; ++t) {
      const uint8_t* wt = wp + t * bytes;
      const C* dt = dp + t * per_tile;
      const Mc* mt = mp ? mp + t * per_tile : nullptr;
      const float* ut = up ? up + t * per_unit : nullptr;
      int64_t i = 0;
      if (!wide.empty()) {  // many rows: unpack the tile once, then as 8-bit codes
        widen6(wt, K, wide.data());
        for (; i + 2 <= M; i += 2)
          group_tile<8, 2, S>(wide.data(), dt, mt, ut, group, r.q.data() + i * K,
                              r.scale.data() + i * nb, sum + i * ns, K, yp + i * N + t * TILE, N);
        if (i < M)
          group_tile<8, 1, S>(wide.data(), dt, mt, ut, group, r.q.data() + i * K,
                              r.scale.data() + i * nb, sum + i * ns, K, yp + i * N + t * TILE, N);
        continue;
      }
      for (; i + 2 <= M; i += 2) {  // two rows share each load (and unpacking) of the tile
        if (M > 2 && t + 1 < e) prefetch_slice(wt + bytes, bytes, i / 2, M / 2);
        group_tile<BITS, 2, S>(wt, dt, mt, ut, group, r.q.data() + i * K, r.scale.data() + i * nb,
                               sum + i * ns, K, yp + i * N + t * TILE, N);
      }
      if (i < M)
        group_tile<BITS, 1, S>(wt, dt, mt, ut, group, r.q.data() + i * K, r.scale.data() + i * nb,
                               sum + i * ns, K, yp + i * N + t * TILE, N);
    }
  });
}

// x [M, K] @ group tiles of BITS-bit codes [N / 64, K * 64 * BITS / 8] (8: int8_linear's
// layout; 6: int6_tile's) with d, m [N / 64, K / group * 64] (both float16 or both float32, or
// int8 d with float32 m; m empty: no offsets) and, for int8 d, its float32 units u
// [N / 64, K / 256 * 64] (else empty) -> [M, N]; group 16 or a multiple of 32
template <int BITS>
at::Tensor group_linear(const char* op, const at::Tensor& x_, const at::Tensor& w,
                        const at::Tensor& d, const at::Tensor& m, const at::Tensor& u,
                        int64_t group) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": expected contiguous uint8 tiles");
  const int64_t tiles = w.size(0), N = tiles * TILE, K = w.size(1) / (TILE * BITS / 8);
  TORCH_CHECK(w.size(1) == K * TILE * BITS / 8 && group > 0 && K % QK == 0 &&
                  (group == 16 || group % QK == 0) && K % group == 0,
              op, ": bad group size ", group, " for ", K, " columns");
  const bool units = d.scalar_type() == at::kChar;
  const at::ScalarType mt = units ? at::kFloat : d.scalar_type();
  TORCH_CHECK((d.scalar_type() == at::kHalf || d.scalar_type() == at::kFloat || units) &&
                  d.is_contiguous() && d.numel() == N * (K / group) &&
                  (m.numel() == 0 || (m.scalar_type() == mt && m.is_contiguous() &&
                                      m.numel() == d.numel())),
              op, ": bad constants");
  TORCH_CHECK(units ? (K % UNIT == 0 && u.scalar_type() == at::kFloat && u.is_contiguous() &&
                       u.numel() == N * (K / UNIT))
                    : u.numel() == 0,
              op, ": int8 constants take float32 units per 256 columns, others none");
  check_input(x_, K, op);
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows& r = quantize_rows(x);
  const std::vector<int32_t>& halves = group == 16 ? sums16(r, M * K) : r.sum;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* yp = y.data_ptr<scalar_t>();
    auto run = [&](auto ctag, auto mtag) {
      using C = decltype(ctag);
      using Mc = decltype(mtag);
      const C* dp = d.data_ptr<C>();
      const Mc* mp = m.numel() ? m.data_ptr<Mc>() : nullptr;
      const float* up = units ? u.data_ptr<float>() : nullptr;
      if (group == 16)  // groups of 16 take sums over 16 columns; larger ones over a block
        group_run<BITS, 16>(wp, dp, mp, up, group, r, halves.data(), M, K, tiles, yp);
      else
        group_run<BITS, QK>(wp, dp, mp, up, group, r, r.sum.data(), M, K, tiles, yp);
    };
    if (d.scalar_type() == at::kHalf) run(at::Half{}, at::Half{});
    else if (units) run(int8_t{}, float{});
    else run(float{}, float{});
  });
  return y;
}

at::Tensor int8g_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d,
                        const at::Tensor& m, const at::Tensor& u, int64_t group) {
  return group_linear<8>("int8g_linear", x, w, d, m, u, group);
}

at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d,
                       const at::Tensor& m, const at::Tensor& u, int64_t group) {
  return group_linear<6>("int6_linear", x, w, d, m, u, group);
}

}  // namespace

TORCH_LIBRARY(llmlib_vnni, lib) {
  lib.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  lib.def("int4_linear(Tensor x, Tensor w, Tensor d, Tensor m, Tensor? du, Tensor? mu, int group) -> Tensor");
  lib.def("int8g_linear(Tensor x, Tensor w, Tensor d, Tensor m, Tensor u, int group) -> Tensor");
  lib.def("int6_linear(Tensor x, Tensor w, Tensor d, Tensor m, Tensor u, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmlib_vnni, CPU, lib) {
  lib.impl("int8_linear", &int8_linear);
  lib.impl("int4_linear", &int4_linear);
  lib.impl("int8g_linear", &int8g_linear);
  lib.impl("int6_linear", &int6_linear);
}
