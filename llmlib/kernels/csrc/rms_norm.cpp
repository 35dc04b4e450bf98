// RMSNorm in one pass over each row, for the eager CPU path (llmlib.norm.rms_norm).
//
// PyTorch's CPU rms_norm is a composite of separate operators (a cast to float32, a square, a
// mean, an rsqrt, two products and a cast back), each a pass over the tensor and a call of its
// own. A decode step of the batching engine runs 61 of them on a few rows, and a prefill step on
// hundreds of rows. Here each row is read twice from cache (the sum of squares, then the scaled
// product) and written once, in float32 arithmetic whatever the storage, rounded once at the end:
//
//   y = x / sqrt(mean(x^2) + eps) * w
//
// tests/test_norm_kernel.py checks it against torch.nn.functional.rms_norm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstring>

namespace {

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  // round to nearest even, as PyTorch's float -> bfloat16 conversion does (NaN stays NaN)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

inline __mmask16 tail(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

template <typename T, typename W>
void norm_rows(const T* x, const W* w, T* y, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * D;
    T* yr = y + r * D;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t j = 0; j < D; j += 16) {
      const __m512 v = load16(xr + j, tail(D - j));
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / float(D) + eps);
    const __m512 s = _mm512_set1_ps(inv);
    for (int64_t j = 0; j < D; j += 16) {
      const __mmask16 m = tail(D - j);
      store16(yr + j, _mm512_mul_ps(_mm512_mul_ps(load16(xr + j, m), s), load16(w + j, m)), m);
    }
  }
}

template <typename T, typename W>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, double eps) {
  const int64_t D = x.size(-1), rows = x.numel() / D;
  const T* xp = x.data_ptr<T>();
  const W* wp = w.data_ptr<W>();
  T* yp = y.data_ptr<T>();
  // a few rows cost less than waking a second thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1));
  at::parallel_for(0, rows, grain, [&](int64_t a, int64_t e) {
    norm_rows<T, W>(xp + a * D, wp, yp + a * D, e - a, D, float(eps));
  });
}

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w_, double eps) {
  TORCH_CHECK(x_.dim() >= 1 && w_.dim() == 1 && w_.size(0) == x_.size(-1),
              "rms_norm: weight must be [D] for x [..., D]");
  TORCH_CHECK(x_.device().is_cpu() && w_.device().is_cpu(), "rms_norm: CPU tensors");
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  at::Tensor y = at::empty_like(x);
  const auto xt = x.scalar_type(), wt = w.scalar_type();
  if (xt == at::kFloat && wt == at::kFloat) run<float, float>(x, w, y, eps);
  else if (xt == at::kFloat && wt == at::kBFloat16) run<float, c10::BFloat16>(x, w, y, eps);
  else if (xt == at::kBFloat16 && wt == at::kBFloat16) run<c10::BFloat16, c10::BFloat16>(x, w, y, eps);
  else TORCH_CHECK(false, "rms_norm: float32 or bfloat16, got ", xt, " and ", wt);
  return y;
}

}  // namespace

TORCH_LIBRARY(llmlib_norm, lib) { lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmlib_norm, CPU, lib) { lib.impl("rms_norm", &rms_norm); }
