// Integer dot products for llmlib's int8 and int4 weights: AVX-512 VNNI.
//
// The weight-only kernels PyTorch ships for the CPU turn every stored code back into a float and
// multiply in floating point. VNNI multiplies bytes by bytes: one `vpdpbusd` takes 64 unsigned
// bytes and 64 signed ones and adds each group of four products into one of 16 int32 lanes. To
// use it the activations must be integers too, so each row of the input is rounded to int8 in
// blocks of 32 values with one float scale per block (what llama.cpp's Q8_0 does), and each
// block's integer sum is scaled back into a float accumulator.
//
// Weights are stored in tiles of 64 output channels. Inside a tile, for every group of four input
// columns, 64 channels x 4 codes lie side by side (256 bytes): one 64-byte load then holds four
// consecutive codes of 16 channels, the layout `vpdpbusd` wants against four activation bytes
// broadcast to every lane.
//
//   int8: w[n, k] = scale[n] * (u[n, k] - 128), u stored as uint8 (the unsigned operand);
//         the 128 comes back out as 128 * (sum of the block's activation codes).
//   int4: w[n, k] = d[n, g] * q[n, k] + m[n, g] for group g = k / group_size, q in 0..15; two
//         groups of four columns share each 64-byte load (low and high nibbles).
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
#include <vector>

namespace {

constexpr int64_t QK = 32;    // activation block: one int8 scale per 32 values
constexpr int64_t TILE = 64;  // output channels per weight tile
// bytes ahead of the loads to ask the memory system for: a step streams every weight from
// memory once, and the hardware prefetcher alone starts over at each 4 KiB page
constexpr int64_t PREFETCH = 4096;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Round one row to int8 in blocks of QK: xq = round(x / d), d = max|x| / 127 per block.
template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* xq, float* sx, int32_t* sum) {
  static_assert(QK == 32, "two vectors of 16 per block");
  for (int64_t b = 0; b < K / QK; ++b) {
    const __m512 v0 = load16(x + b * QK), v1 = load16(x + b * QK + 16);
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

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <typename T>
inline void store16(T* y, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(y, v);
  } else {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    for (int i = 0; i < 16; ++i) y[i] = static_cast<T>(tmp[i]);
  }
}

// R rows x 4 groups of 16 channels: the accumulators of one tile, in registers
template <int R>
inline void zero(__m512 (&a)[R][4]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_ps();
}
template <int R>
inline void zero(__m512i (&a)[R][4]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_si512();
}

// R rows of activations against one int8 tile: y[r][0..64). Each 64-byte load of weights feeds
// R instructions, one per row (the registers hold R x 4 integer and float accumulators).
template <int R, typename T>
void int8_tile(const uint8_t* w, const float* scale, const int8_t* xq, const float* sx,
               const int32_t* sum, int64_t K, T* y, int64_t ldy) {
  const int64_t nb = K / QK;
  __m512 accf[R][4];
  zero(accf);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[R][4];
    zero(acc);
    const uint8_t* wb = w + b * QK * TILE;
    for (int64_t g = 0; g < QK / 4; ++g) {
      __m512i xv[R];
      for (int r = 0; r < R; ++r) xv[r] = broadcast4(xq + r * K + b * QK + g * 4);
      const uint8_t* wg = wb + g * 4 * TILE;
      for (int j = 0; j < 4; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(wg + j * 64 + PREFETCH), _MM_HINT_T0);
        const __m512i wv = _mm512_loadu_si512(wg + j * 64);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], wv, xv[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_set1_epi32(128 * sum[r * nb + b]);
      const __m512 sv = _mm512_set1_ps(sx[r * nb + b]);
      for (int j = 0; j < 4; ++j)
        accf[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], corr)), sv,
                                     accf[r][j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 sc = _mm512_loadu_ps(scale + j * 16);
    for (int r = 0; r < R; ++r) store16(y + r * ldy + j * 16, _mm512_mul_ps(accf[r][j], sc));
  }
}

// R rows of activations against one int4 tile: y[r][0..64). `d` and `m` are this tile's
// [K / group, 64] float16 constants.
template <int R, typename T>
void int4_tile(const uint8_t* w, const at::Half* d, const at::Half* m, int64_t group,
               const int8_t* xq, const float* sx, const int32_t* sum, int64_t K, T* y,
               int64_t ldy) {
  const int64_t nb = K / QK;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 accf[R][4];
  zero(accf);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[R][4];
    zero(acc);
    const uint8_t* wb = w + b * (QK / 2) * TILE;  // 32 columns x 64 channels, two per byte
    for (int64_t p = 0; p < QK / 8; ++p) {
      __m512i x0[R], x1[R];
      for (int r = 0; r < R; ++r) {
        x0[r] = broadcast4(xq + r * K + b * QK + p * 8);
        x1[r] = broadcast4(xq + r * K + b * QK + p * 8 + 4);
      }
      const uint8_t* wp = wb + p * 4 * TILE;
      for (int j = 0; j < 4; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(wp + j * 64 + PREFETCH), _MM_HINT_T0);
        const __m512i raw = _mm512_loadu_si512(wp + j * 64);
        const __m512i lo = _mm512_and_si512(raw, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        for (int r = 0; r < R; ++r) {
          acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], lo, x0[r]);
          acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], hi, x1[r]);
        }
      }
    }
    const int64_t g = (b * QK) / group;
    for (int j = 0; j < 4; ++j) {
      const __m512 dv = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * TILE + j * 16)));
      const __m512 mv = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + g * TILE + j * 16)));
      for (int r = 0; r < R; ++r) {
        const float e = sx[r * nb + b];
        const __m512 sv = _mm512_set1_ps(e);
        const __m512 ms = _mm512_set1_ps(e * static_cast<float>(sum[r * nb + b]));
        accf[r][j] =
            _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][j]), sv), dv, accf[r][j]);
        accf[r][j] = _mm512_fmadd_ps(mv, ms, accf[r][j]);
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < R; ++r) store16(y + r * ldy + j * 16, accf[r][j]);
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

// x [M, K] @ int4 tiles [N / 64, K * 32] with float16 d, m [N / 64, K / group * 64] -> [M, N]
at::Tensor int4_linear(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& d,
                       const at::Tensor& m, int64_t group) {
  const int64_t tiles = w.size(0), N = tiles * TILE, K = w.size(1) * 2 / TILE;
  TORCH_CHECK(K % QK == 0 && group % QK == 0 && K % group == 0, "int4_linear: bad group size");
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf &&
                  d.numel() == N * (K / group) && m.numel() == d.numel(),
              "int4_linear: bad constants");
  check_input(x_, K, "int4_linear");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), per_tile = (K / group) * TILE;
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows& r = quantize_rows(x);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const at::Half* dp = d.data_ptr<at::Half>();
    const at::Half* mp = m.data_ptr<at::Half>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, tiles, 1, [&](int64_t a, int64_t e) {
      for (int64_t t = a; t < e; ++t) {
        const uint8_t* wt = wp + t * K * TILE / 2;
        int64_t i = 0;
        for (; i + 2 <= M; i += 2) {  // two rows share each load (and unpacking) of the tile
          if (M > 2 && t + 1 < e) prefetch_slice(wt + K * TILE / 2, K * TILE / 2, i / 2, M / 2);
          int4_tile<2>(wt, dp + t * per_tile, mp + t * per_tile, group, r.q.data() + i * K,
                       r.scale.data() + i * (K / QK), r.sum.data() + i * (K / QK), K,
                       yp + i * N + t * TILE, N);
        }
        if (i < M)
          int4_tile<1>(wt, dp + t * per_tile, mp + t * per_tile, group, r.q.data() + i * K,
                       r.scale.data() + i * (K / QK), r.sum.data() + i * (K / QK), K,
                       yp + i * N + t * TILE, N);
      }
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(llmlib_vnni, lib) {
  lib.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  lib.def("int4_linear(Tensor x, Tensor w, Tensor d, Tensor m, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmlib_vnni, CPU, lib) {
  lib.impl("int8_linear", &int8_linear);
  lib.impl("int4_linear", &int4_linear);
}
