// One row of float32 activations times a float32 weight matrix: batch-1 decode's product.
//
// A decode step at batch 1 multiplies one vector by every weight matrix, and each weight is used
// for one multiply-add after it arrives from memory, so the product can go no faster than the
// matrix streams in. PyTorch hands this product to MKL's sgemv, which picks its code by CPU
// vendor: on CPUs it does not tune for, it streams the weights at a fraction of the memory's
// speed. Here each thread walks its own contiguous band of output rows, R rows at a time: one
// load of sixteen activations feeds R multiply-adds, one per row, and the R row streams run
// side by side, which the hardware prefetcher follows. Each row's sum is reduced once, at the end.
//
//   w: [N, K] float32, row-major (contiguous), K a multiple of 16
//   x: [K] float32
//   y: [N] float32, y[n] = sum_k w[n, k] * x[k]
//
// tests/test_matvec.py checks it against the same product in float64.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

namespace {

// Sixteen floats: one AVX-512 register, or two AVX2 ones (llmlib.native builds one or the other).
#if defined(__AVX512F__)
struct V16 {
  __m512 x;
};
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.x, b.x, c.x)}; }
inline float vsum(V16 a) { return _mm512_reduce_add_ps(a.x); }
#else
struct V16 {
  __m256 lo, hi;
};
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 vfma(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline float vsum(V16 a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
#endif

// rows per pass: R loads of weights share each load of activations, and R streams of memory
// run at once (8 measured ahead of 4 and 16; software prefetching measured no faster)
constexpr int64_t R = 8;

template <int64_t ROWS>
inline void dot_rows(const float* w, const float* x, int64_t K, float* y) {
  V16 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = vzero();
  for (int64_t k = 0; k < K; k += 16) {
    const V16 xv = vload(x + k);
    for (int64_t r = 0; r < ROWS; ++r) acc[r] = vfma(vload(w + r * K + k), xv, acc[r]);
  }
  for (int64_t r = 0; r < ROWS; ++r) y[r] = vsum(acc[r]);
}

at::Tensor matvec(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kFloat,
              "matvec: w must be a contiguous float32 matrix [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 16 == 0, "matvec: K must be a multiple of 16, got ", K);
  TORCH_CHECK(x.numel() == K && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "matvec: x must hold K = ", K, " float32 values on the CPU");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({N}, w.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // bands of whole passes, at least 64 KiB of weights each, so a small matrix stays on one thread
  const int64_t grain = std::max<int64_t>(1, (16384 / K + R - 1) / R);
  at::parallel_for(0, N / R, grain, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) dot_rows<R>(wp + i * R * K, xp, K, yp + i * R);
  });
  for (int64_t n = N / R * R; n < N; ++n) dot_rows<1>(wp + n * K, xp, K, yp + n);
  return y;
}

}  // namespace

TORCH_LIBRARY(llmlib_matvec, lib) { lib.def("matvec(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmlib_matvec, CPU, lib) { lib.impl("matvec", &matvec); }
