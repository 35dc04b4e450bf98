// Decode attention straight out of the paged KV pool (the batching engine's CPU path).
//
// A decoding sequence has one query per head and attends over every key of its sequence. Done
// with PyTorch's operators, the keys and values of a batch of sequences are first gathered out of
// their blocks into one padded tensor (a copy of everything the step reads), and only then handed
// to scaled_dot_product_attention, which reads it all again. Here each (sequence, KV head) pair
// walks its own block table and reads every key and value once, in place: the query heads that
// share the KV head (grouped-query attention) score each key while it is in registers, and the
// softmax is taken online, block by block (the running maximum, sum and weighted values of
// flash attention), so nothing of size "keys" is ever written.
//
//   pool layout: [num_blocks, block_size, kv_heads, head_dim], token-major (llmlib.engine.paged_cache)
//   q:           [n, heads, head_dim], float32 or bfloat16: the pool's dtype, or either over an
//                int8 pool
//   int8 pools:  [num_blocks, block_size, kv_heads, head_dim + 4]: each (token, head) row holds
//                head_dim codes, then its float32 scale in four bytes (x = code * scale), so a
//                row is read in one place and the pool stays one tensor (kv_cache_dtype="int8")
//   table:       [n, max_blocks] int64, the blocks of each sequence in order (padding unread)
//   lens:        [n] int64, keys each query sees: its position + 1
//   window:      > 0: only the last `window` of those keys (a sliding-window layer)
//   softcap:     > 0: scores squashed to softcap * tanh(score / softcap) (Gemma 2)
//
// The result is float32 [n, heads, head_dim]. tests/test_paged_kernel.py checks it against
// llmlib's own attention functions over the gathered keys.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Sixteen floats at a time: one AVX-512 register, or two AVX2 ones where the CPU has no AVX-512
// (llmlib.native builds this file for whichever the CPU has). The kernel below is written once
// against these few operations.
#if defined(__AVX512F__)
struct V16 {
  __m512 x;
};
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 vload(const c10::BFloat16* p) {
  // a bfloat16 is the top half of a float32: widen to 32 bits and shift into place
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16))};
}
inline V16 vload(const int8_t* p) {  // sixteen int8 codes, widened to floats
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.x); }
inline V16 vset(float f) { return {_mm512_set1_ps(f)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.x, b.x)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.x, b.x)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.x, b.x, c.x)}; }
inline float vsum(V16 a) { return _mm512_reduce_add_ps(a.x); }
inline float vmax(V16 a) { return _mm512_reduce_max_ps(a.x); }
// exp of 16 floats: 2^n * 2^f with n = round(x * log2 e) and |f| <= 1/2, 2^f by its Taylor
// series to degree 7 (relative error below 1e-8, under float32's own rounding)
inline V16 vexp(V16 v) {
  const __m512 x = _mm512_max_ps(v.x, _mm512_set1_ps(-87.0f));  // exp(-87) is 0 to a softmax weight
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.6931471805599453f));
  static const float c[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return {_mm512_scalef_ps(p, n)};
}
#else  // AVX2 and FMA: two halves of eight
struct V16 {
  __m256 lo, hi;
};
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
inline V16 vload(const c10::BFloat16* p) { return {widen8(p), widen8(p + 8)}; }
inline __m256 codes8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline V16 vload(const int8_t* p) { return {codes8(p), codes8(p + 8)}; }
inline void vstore(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 vset(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 vfma(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}
inline float vsum(V16 a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float vmax(V16 a) {
  const __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 b = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  b = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_shuffle_ps(b, b, 1)));
}
// the same series as the AVX-512 version; 2^n is built in the exponent bits, which the clamp at
// -87 keeps normal (n >= -126)
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(y, n), _mm256_set1_ps(0.6931471805599453f));
  static const float c[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  __m256 p = _mm256_set1_ps(c[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline V16 vexp(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }
#endif

template <typename T>
inline void prefetch_rows(const T* p, int64_t rows, int64_t stride, int64_t D) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + j * stride) + b, _MM_HINT_T0);
}

constexpr int64_t CHUNK = 16;  // keys scored, exponentiated and summed together (one vector)
constexpr int64_t MAXG = 8;    // query heads per pass over a KV head's keys (registers)

// The scale of an int8 pool row: the four bytes after its codes (1 for a float pool, unused).
template <typename K>
inline float row_scale(const K* row, int64_t D) {
  if constexpr (std::is_same_v<K, int8_t>) {
    float f;
    std::memcpy(&f, row + D, sizeof f);
    return f;
  } else {
    return 1.0f;
  }
}

// Query heads q[0..G) (G at compile time, so their partial sums live in registers) that share
// one KV head, over keys start..len-1 of one sequence; out[g] = softmax(q[g] K) V. A pool row is
// R elements apart (D, or D + 4 for int8 codes and their scale); an int8 key's scale multiplies
// its scores, an int8 value's the weight it is summed with.
template <typename Q, typename K, int G>
void attend_heads(const Q* q, const K* kpool, const K* vpool, const int64_t* blocks, int64_t len,
                  int64_t window, float scale, float softcap, int64_t bs, int64_t hkv, int64_t h,
                  int64_t D, int64_t R, float* out, float* buf) {
  constexpr bool coded = std::is_same_v<K, int8_t>;
  const int64_t nv = D / 16;
  float* qf = buf;            // [G, D] queries, scaled
  float* acc = qf + G * D;    // [G, D] running sum of probability-weighted values
  float* s = acc + G * D;     // [G, CHUNK] scores, then weights, of the current keys
  float mx[G], sum[G];        // running maximum score; running sum of exp(score - maximum)
  for (int g = 0; g < G; ++g) {
    for (int64_t v = 0; v < nv; ++v) {
      vstore(qf + g * D + v * 16, vmul(vload(q + g * D + v * 16), vset(scale)));
      vstore(acc + g * D + v * 16, vset(0.0f));
    }
    mx[g] = -std::numeric_limits<float>::infinity();
    sum[g] = 0.0f;
  }
  const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  // Keys go in chunks of CHUNK counted from the window's start, whatever the block size: where
  // the running softmax is rescaled then depends on the query's position alone, so a query gets
  // the same sums in any pool (the batch-invariant mode relies on it). Each key's row is found
  // through the table on its own, as a chunk may span blocks.
  int64_t cur[CHUNK], nxt[CHUNK];  // element offset of each key's row (head h) in the pools
  auto rows_of = [&](int64_t t, int64_t n, int64_t* r) {
    int64_t b = t / bs, o = t % bs;  // block and slot of key t, then stepped key by key
    for (int64_t j = 0; j < n; ++j) {
      r[j] = ((blocks[b] * bs + o) * hkv + h) * R;
      if (++o == bs) o = 0, ++b;
    }
  };
  int64_t cnt = std::min(len - start, CHUNK);
  rows_of(start, cnt, cur);
  for (int64_t t0 = start; t0 < len;) {
    const int64_t n2 = std::min(len - t0 - cnt, CHUNK);
    if (n2 > 0) {  // ask for the next keys and values now: the blocks lie anywhere
      rows_of(t0 + cnt, n2, nxt);
      for (int64_t j = 0; j < n2; ++j) {
        prefetch_rows(kpool + nxt[j], 1, 0, R);
        prefetch_rows(vpool + nxt[j], 1, 0, R);
      }
    }
    for (int64_t j = 0; j < cnt; ++j) {  // scores: every query head, one key at a time
      V16 part[G];
      for (int g = 0; g < G; ++g) part[g] = vset(0.0f);
      for (int64_t v = 0; v < nv; ++v) {
        const V16 k = vload(kpool + cur[j] + v * 16);
        for (int g = 0; g < G; ++g) part[g] = vfma(vload(qf + g * D + v * 16), k, part[g]);
      }
      if constexpr (coded) {
        const float ks = row_scale(kpool + cur[j], D);
        for (int g = 0; g < G; ++g) s[g * CHUNK + j] = vsum(part[g]) * ks;
      } else {
        for (int g = 0; g < G; ++g) s[g * CHUNK + j] = vsum(part[g]);
      }
    }
    V16 al[G];
    for (int g = 0; g < G; ++g) {  // the online softmax: rescale what came before
      float* sg = s + g * CHUNK;
      if (softcap > 0.0f)
        for (int64_t j = 0; j < cnt; ++j) sg[j] = softcap * std::tanh(sg[j] / softcap);
      // a chunk shorter than CHUNK: the lanes past it score -inf, and weigh 0 after the exp
      for (int64_t j = cnt; j < CHUNK; ++j) sg[j] = -std::numeric_limits<float>::infinity();
      const V16 sc = vload(sg);
      const float m = std::max(mx[g], vmax(sc));
      const float alpha = std::exp(mx[g] - m);  // exp(-inf) = 0 on the first keys
      vstore(sg, vexp(vsub(sc, vset(m))));
      for (int64_t j = cnt; j < CHUNK; ++j) sg[j] = 0.0f;
      sum[g] = sum[g] * alpha + vsum(vload(sg));
      mx[g] = m;
      al[g] = vset(alpha);
    }
    if constexpr (coded) {  // from here a weight multiplies codes: fold each value's scale in
      for (int64_t j = 0; j < cnt; ++j) {
        const float vs = row_scale(vpool + cur[j], D);
        for (int g = 0; g < G; ++g) s[g * CHUNK + j] *= vs;
      }
    }
    for (int64_t v = 0; v < nv; ++v) {  // the values, weighted: G running sums per slice
      V16 a[G];
      for (int g = 0; g < G; ++g) a[g] = vmul(vload(acc + g * D + v * 16), al[g]);
      for (int64_t j = 0; j < cnt; ++j) {
        const V16 x = vload(vpool + cur[j] + v * 16);
        for (int g = 0; g < G; ++g) a[g] = vfma(vset(s[g * CHUNK + j]), x, a[g]);
      }
      for (int g = 0; g < G; ++g) vstore(acc + g * D + v * 16, a[g]);
    }
    t0 += cnt;
    std::copy(nxt, nxt + std::max<int64_t>(n2, 0), cur);
    cnt = n2;
  }
  for (int g = 0; g < G; ++g) {
    const V16 inv = vset(1.0f / sum[g]);
    for (int64_t v = 0; v < nv; ++v) vstore(out + g * D + v * 16, vmul(vload(acc + g * D + v * 16), inv));
  }
}

template <typename Q, typename K>
using HeadsFn = void (*)(const Q*, const K*, const K*, const int64_t*, int64_t, int64_t, float,
                         float, int64_t, int64_t, int64_t, int64_t, int64_t, float*, float*);

template <typename Q, typename K>
HeadsFn<Q, K> heads_fn(int64_t g) {
  switch (g) {
    case 1: return attend_heads<Q, K, 1>;
    case 2: return attend_heads<Q, K, 2>;
    case 3: return attend_heads<Q, K, 3>;
    case 4: return attend_heads<Q, K, 4>;
    case 5: return attend_heads<Q, K, 5>;
    case 6: return attend_heads<Q, K, 6>;
    case 7: return attend_heads<Q, K, 7>;
    default: return attend_heads<Q, K, 8>;
  }
}

template <typename Q, typename K>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
         const at::Tensor& lens, double scale, int64_t window, double softcap, at::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k.size(1), hkv = k.size(2), R = k.size(3), maxb = table.size(1);
  const int64_t G = H / hkv;              // query heads per KV head
  const int64_t parts = (G + MAXG - 1) / MAXG;  // passes over each KV head's keys
  const Q* qp = q.data_ptr<Q>();
  const K* kp = k.data_ptr<K>();
  const K* vp = v.data_ptr<K>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * hkv * parts, 1, [&](int64_t a, int64_t e) {
    std::vector<float> buf(2 * MAXG * D + MAXG * CHUNK);
    for (int64_t w = a; w < e; ++w) {
      const int64_t i = w / (hkv * parts), h = (w / parts) % hkv, c = w % parts;
      const int64_t g0 = c * MAXG, ng = std::min(MAXG, G - g0);
      const int64_t head = h * G + g0;  // first query head of this pass
      heads_fn<Q, K>(ng)(qp + (i * H + head) * D, kp, vp, tp + i * maxb, lp[i], window,
                         float(scale), float(softcap), bs, hkv, h, D, R, op + (i * H + head) * D,
                         buf.data());
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& table, const at::Tensor& lens, double scale,
                            int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(),
              "decode_attention: q [n, H, D], pools [blocks, block_size, Hkv, D]");
  const bool coded = k.scalar_type() == at::kChar;
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (coded || q.scalar_type() == k.scalar_type()),
              "decode_attention: q and the pools must share a dtype (or the pools be int8)");
  TORCH_CHECK(q.size(2) + (coded ? 4 : 0) == k.size(3) && q.size(2) % 16 == 0,
              "decode_attention: pool rows of head_dim (int8: head_dim + 4), head_dim % 16");
  TORCH_CHECK(q.size(1) % k.size(2) == 0, "decode_attention: heads must be a multiple of Hkv");
  TORCH_CHECK(table.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  table.dim() == 2 && table.size(0) == q.size(0) && lens.numel() == q.size(0),
              "decode_attention: table [n, max_blocks] and lens [n], int64");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
                  table.is_contiguous() && lens.is_contiguous(),
              "decode_attention: contiguous inputs");
  auto lens_max = q.size(0) ? lens.max().item<int64_t>() : 0;
  TORCH_CHECK(lens_max <= table.size(1) * k.size(1), "decode_attention: lens exceed the table");
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  const auto qt = q.scalar_type();
  if (qt == at::kFloat && !coded)
    run<float, float>(q, k, v, table, lens, scale, window, softcap, out);
  else if (qt == at::kBFloat16 && !coded)
    run<c10::BFloat16, c10::BFloat16>(q, k, v, table, lens, scale, window, softcap, out);
  else if (qt == at::kFloat)
    run<float, int8_t>(q, k, v, table, lens, scale, window, softcap, out);
  else if (qt == at::kBFloat16)
    run<c10::BFloat16, int8_t>(q, k, v, table, lens, scale, window, softcap, out);
  else
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 queries, got ", qt);
  return out;
}

}  // namespace

TORCH_LIBRARY(llmlib_paged, lib) {
  lib.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor table, Tensor lens, float scale, "
      "int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmlib_paged, CPU, lib) { lib.impl("decode_attention", &decode_attention); }
