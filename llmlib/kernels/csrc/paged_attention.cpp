// Decode attention straight out of the paged KV pool (the batching engine's CPU path).
//
// A decoding sequence has one query per head and attends over every key of its sequence. Done
// with PyTorch's operators, the keys and values of a batch of sequences are first gathered out of
// their blocks into one padded tensor (a copy of everything the step reads), and only then handed
// to scaled_dot_product_attention, which reads it all again. Here each sequence walks its own
// block table and reads every key and value once, in place: the query heads that share a KV head
// (grouped-query attention) score each key while it is in registers, the rows of neighbouring KV
// heads (which lie side by side) are read in the same pass, and the softmax is taken online,
// chunk by chunk (the running maximum, sum and weighted values of flash attention), so nothing of
// size "keys" is ever written. A long sequence's keys are cut into spans of SPAN keys that the
// threads share; each span's running sums are merged at the end (flash decoding), so one long
// request keeps every thread busy.
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
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.x, b.x)}; }
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
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
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
      _mm_prefetch(reinterpret_cast<const char*>(p + j * stride) + b, _MM_HINT_T1);
}

constexpr int64_t CHUNK = 64;  // keys scored, exponentiated and summed together (4 vectors)
// Query heads one pass over a chunk serves: those of up to 4 KV heads, at most MAXG together
// (registers), or those of one KV head, at most 8 at a time.
#if defined(__AVX512F__)
constexpr int MAXG = 12;
#else
constexpr int MAXG = 6;  // AVX2: half the registers, each V16 two of them
#endif
constexpr int G1 = 8;
#if defined(__AVX512F__)
constexpr bool TWO_SUMS = true;
#else
constexpr bool TWO_SUMS = false;
#endif
constexpr int MAXQ = MAXG > G1 ? MAXG : G1;  // query heads in a pass, at most
constexpr int64_t SPAN = 256;  // keys per work item: a long sequence's keys go to many threads

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

// One chunk of keys (cnt <= CHUNK; key j's row of a KV head at cur[j] + head * R) for NK
// neighbouring KV heads and the G query heads that share each: qf[0..NK*G), scaled, float32.
// NK and G are known at compile time, so the partial sums live in registers, and the NK heads'
// rows of a key, which lie side by side, are read together. The state carried from chunk to
// chunk is acc[q] (the weighted values' sum, not yet divided), mx[q] (the running maximum score)
// and sum[q] (the running sum of exp(score - maximum)): flash attention's online softmax. An
// int8 key's scale multiplies its scores, an int8 value's the weight it is summed with. A query
// head's arithmetic does not depend on which heads share its pass.
template <typename K, int NK, int G>
void chunk_heads(const float* qf, float* acc, float* mx, float* sum, float* s, const K* kpool,
                 const K* vpool, const int64_t* cur, int64_t cnt, float softcap, int64_t D,
                 int64_t R) {
  constexpr bool coded = std::is_same_v<K, int8_t>;
  constexpr int QN = NK * G;
  const int64_t nv = D / 16;
  for (int64_t j = 0; j < cnt; ++j) {  // scores: every query head, one key at a time
    V16 part[QN];
    for (int q = 0; q < QN; ++q) part[q] = vset(0.0f);
    for (int64_t v = 0; v < nv; ++v) {
      for (int h = 0; h < NK; ++h) {
        const V16 k = vload(kpool + cur[j] + h * R + v * 16);
        for (int g = 0; g < G; ++g) {
          const int q = h * G + g;
          part[q] = vfma(vload(qf + q * D + v * 16), k, part[q]);
        }
      }
    }
    for (int h = 0; h < NK; ++h) {
      const float ks = coded ? row_scale(kpool + cur[j] + h * R, D) : 1.0f;
      for (int g = 0; g < G; ++g) {
        const int q = h * G + g;
        s[q * CHUNK + j] = coded ? vsum(part[q]) * ks : vsum(part[q]);
      }
    }
  }
  V16 al[QN];
  for (int q = 0; q < QN; ++q) {  // the online softmax: rescale what came before
    float* sq = s + q * CHUNK;
    if (softcap > 0.0f)
      for (int64_t j = 0; j < cnt; ++j) sq[j] = softcap * std::tanh(sq[j] / softcap);
    // a chunk shorter than CHUNK: the lanes past it score -inf, and weigh 0 after the exp
    for (int64_t j = cnt; j < CHUNK; ++j) sq[j] = -std::numeric_limits<float>::infinity();
    float m = mx[q];
    for (int64_t c = 0; c < CHUNK; c += 16) m = std::max(m, vmax(vload(sq + c)));
    const float alpha = std::exp(mx[q] - m);  // exp(-inf) = 0 on the first keys
    V16 total = vset(0.0f);
    for (int64_t c = 0; c < CHUNK; c += 16) {
      const V16 e = vexp(vsub(vload(sq + c), vset(m)));
      vstore(sq + c, e);
      total = vadd(e, total);
    }
    for (int64_t j = cnt; j < CHUNK; ++j) sq[j] = 0.0f;
    sum[q] = sum[q] * alpha + vsum(total);
    mx[q] = m;
    al[q] = vset(alpha);
  }
  if constexpr (coded) {  // from here a weight multiplies codes: fold each value's scale in
    for (int64_t j = 0; j < cnt; ++j)
      for (int h = 0; h < NK; ++h) {
        const float vs = row_scale(vpool + cur[j] + h * R, D);
        for (int g = 0; g < G; ++g) s[(h * G + g) * CHUNK + j] *= vs;
      }
  }
  for (int64_t v = 0; v < nv; ++v) {  // the values, weighted: QN running sums per slice
    // two sums per query head, of the even and the odd keys, where registers allow: twice the
    // independent chains of products for the processor to overlap. It depends on G alone, not on
    // how many heads share the pass: a query's arithmetic must not change with its batch.
    constexpr bool two = TWO_SUMS && G <= 3;
    V16 a[QN], b[QN];
    for (int q = 0; q < QN; ++q) a[q] = vmul(vload(acc + q * D + v * 16), al[q]), b[q] = vset(0.0f);
    int64_t j = 0;
    if constexpr (two) {
      for (; j + 1 < cnt; j += 2) {
        for (int h = 0; h < NK; ++h) {
          const V16 x = vload(vpool + cur[j] + h * R + v * 16);
          const V16 y = vload(vpool + cur[j + 1] + h * R + v * 16);
          for (int g = 0; g < G; ++g) {
            const int q = h * G + g;
            a[q] = vfma(vset(s[q * CHUNK + j]), x, a[q]);
            b[q] = vfma(vset(s[q * CHUNK + j + 1]), y, b[q]);
          }
        }
      }
    }
    for (; j < cnt; ++j) {
      for (int h = 0; h < NK; ++h) {
        const V16 x = vload(vpool + cur[j] + h * R + v * 16);
        for (int g = 0; g < G; ++g) {
          const int q = h * G + g;
          a[q] = vfma(vset(s[q * CHUNK + j]), x, a[q]);
        }
      }
    }
    for (int q = 0; q < QN; ++q) vstore(acc + q * D + v * 16, two ? vadd(a[q], b[q]) : a[q]);
  }
}

template <typename K>
using ChunkFn = void (*)(const float*, float*, float*, float*, float*, const K*, const K*,
                         const int64_t*, int64_t, float, int64_t, int64_t);

template <typename K, int NK>
ChunkFn<K> by_heads(int64_t g) {
  switch (g) {  // pairs with NK > 1 and NK * G > MAXG are never asked for (kv_heads_per_pass)
#define LLMLIB_G(G) \
  case G:           \
    if constexpr (NK == 1 || NK * G <= MAXG) return chunk_heads<K, NK, G>; \
    break;
    LLMLIB_G(1) LLMLIB_G(2) LLMLIB_G(3) LLMLIB_G(4) LLMLIB_G(5) LLMLIB_G(6) LLMLIB_G(7) LLMLIB_G(8)
#undef LLMLIB_G
  }
  return nullptr;
}

template <typename K>
ChunkFn<K> chunk_fn(int64_t nk, int64_t g) {
  switch (nk) {
    case 1: return by_heads<K, 1>(g);
    case 2: return by_heads<K, 2>(g);
    case 3: return by_heads<K, 3>(g);
    default: return by_heads<K, 4>(g);
  }
}

// KV heads read in one pass over a chunk: up to 4, as many as keep NK * G <= MAXG (at least 1).
inline int64_t kv_heads_per_pass(int64_t G) {
  return std::max<int64_t>(1, std::min<int64_t>(4, MAXG / G));
}

// Keys begin..end-1 of one sequence for the query heads of KV heads h0..h1-1 (q: the query's
// first head): a span's part of softmax(q K) V per query head, written as acc_out (the weighted
// values' sum, not yet divided) and ml = {max, sum}, which combine() merges over spans. Keys go
// chunk by chunk, and within a chunk KV head by KV head: a token's rows of all heads lie side by
// side, so each cache line read is used at once. The chunks count from the span's start (the
// window's start plus a multiple of SPAN), whatever the block size, so where the running softmax
// is rescaled depends on the query's position alone: a query gets the same sums in any pool and
// any batch (the batch-invariant mode relies on it). Each key's row is found through the table
// on its own, as a chunk may span blocks.
template <typename Q, typename K>
void attend_span(const Q* q, const K* kpool, const K* vpool, const int64_t* blocks,
                 int64_t begin, int64_t end, float scale, float softcap, int64_t bs, int64_t hkv,
                 int64_t h0, int64_t h1, int64_t G, int64_t D, int64_t R, float* acc_out,
                 float* ml, float* buf) {
  const int64_t nh = (h1 - h0) * G, nv = D / 16, first = h0 * G;
  float* qf = buf;           // [nh, D] queries, scaled
  float* acc = qf + nh * D;  // [nh, D] running sums of probability-weighted values
  float* mx = acc + nh * D;  // [nh] running maximum scores
  float* sum = mx + nh;      // [nh] running sums of exp(score - maximum)
  float* s = sum + nh;       // [MAXQ, CHUNK] scores, then weights, of the current keys
  for (int64_t g = 0; g < nh; ++g) {
    for (int64_t v = 0; v < nv; ++v) {
      vstore(qf + g * D + v * 16, vmul(vload(q + (first + g) * D + v * 16), vset(scale)));
      vstore(acc + g * D + v * 16, vset(0.0f));
    }
    mx[g] = -std::numeric_limits<float>::infinity();
    sum[g] = 0.0f;
  }
  int64_t cur[CHUNK], nxt[CHUNK];  // element offset of each key's row of KV head 0
  auto rows_of = [&](int64_t t, int64_t n, int64_t* r) {
    int64_t b = t / bs, o = t % bs;  // block and slot of key t, then stepped key by key
    for (int64_t j = 0; j < n; ++j) {
      r[j] = (blocks[b] * bs + o) * hkv * R;
      if (++o == bs) o = 0, ++b;
    }
  };
  int64_t cnt = std::min(end - begin, CHUNK);
  rows_of(begin, cnt, cur);
  for (int64_t t0 = begin; t0 < end;) {
    const int64_t n2 = std::min(end - t0 - cnt, CHUNK);
    if (n2 > 0) {  // ask for the next keys and values now: the blocks lie anywhere
      rows_of(t0 + cnt, n2, nxt);
      for (int64_t j = 0; j < n2; ++j) {
        prefetch_rows(kpool + nxt[j] + h0 * R, 1, 0, (h1 - h0) * R);
        prefetch_rows(vpool + nxt[j] + h0 * R, 1, 0, (h1 - h0) * R);
      }
    }
    for (int64_t h = h0; h < h1;) {
      const int64_t nk = std::min(kv_heads_per_pass(G), h1 - h);
      for (int64_t g0 = 0; g0 < G; g0 += G1) {  // more than G1 query heads: passes of G1
        const int64_t i = (h - h0) * G + g0;
        chunk_fn<K>(nk, std::min<int64_t>(G1, G - g0))(qf + i * D, acc + i * D, mx + i, sum + i, s,
                                                kpool + h * R, vpool + h * R, cur, cnt, softcap,
                                                D, R);
      }
      h += nk;
    }
    t0 += cnt;
    std::copy(nxt, nxt + std::max<int64_t>(n2, 0), cur);
    cnt = n2;
  }
  std::copy(acc, acc + nh * D, acc_out);
  for (int64_t g = 0; g < nh; ++g) ml[2 * g] = mx[g], ml[2 * g + 1] = sum[g];
}

// The spans' parts of one query head merged: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)
// with M the largest m_s, in span order. One span gives acc / l, as a single pass would.
inline void combine(const float* acc, const float* ml, int64_t spans, int64_t stride, int64_t D,
                    float* out) {
  float M = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < spans; ++s) M = std::max(M, ml[s * stride * 2]);
  float l = 0.0f;
  for (int64_t s = 0; s < spans; ++s) l += ml[s * stride * 2 + 1] * std::exp(ml[s * stride * 2] - M);
  const float inv = 1.0f / l;
  const int64_t nv = D / 16;
  for (int64_t v = 0; v < nv; ++v) {
    V16 o = vset(0.0f);
    for (int64_t s = 0; s < spans; ++s) {
      const float c = spans == 1 ? inv : std::exp(ml[s * stride * 2] - M) * inv;
      o = spans == 1 ? vmul(vload(acc + v * 16), vset(c))
                     : vfma(vload(acc + s * stride * D + v * 16), vset(c), o);
    }
    vstore(out + v * 16, o);
  }
}

// The first key a query sees (its window's start) and how many spans of SPAN keys it reads.
inline int64_t first_key(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}
inline int64_t spans_of(int64_t len, int64_t window) {
  return std::max<int64_t>(1, (len - first_key(len, window) + SPAN - 1) / SPAN);
}

// Work items are (sequence, span, group of KV heads): a long sequence's keys are shared out over
// the threads span by span, and an item reads a span's blocks once for all heads of its group.
// Where that leaves fewer items than threads (one short sequence), each KV head is a group. How
// the items are cut never changes a query's arithmetic.
template <typename Q, typename K>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
         const at::Tensor& lens, double scale, int64_t window, double softcap, int64_t spans,
         at::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k.size(1), hkv = k.size(2), R = k.size(3), maxb = table.size(1);
  const int64_t G = H / hkv;  // query heads per KV head
  const int64_t groups = n * spans >= 2 * at::get_num_threads() ? 1 : hkv;
  const int64_t per = hkv / groups;  // KV heads per item
  const Q* qp = q.data_ptr<Q>();
  const K* kp = k.data_ptr<K>();
  const K* vp = v.data_ptr<K>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  // each span's parts: [n, spans, H, D] weighted sums, [n, spans, H, 2] maximum and sum
  std::vector<float> acc(n * spans * H * D), ml(n * spans * H * 2);
  at::parallel_for(0, n * spans * groups, 1, [&](int64_t a, int64_t e) {
    std::vector<float> buf(2 * H * D + 2 * H + MAXQ * CHUNK);
    for (int64_t w = a; w < e; ++w) {
      const int64_t i = w / (spans * groups), sp = (w / groups) % spans, h0 = (w % groups) * per;
      if (sp >= spans_of(lp[i], window)) continue;  // a shorter sequence than the longest
      const int64_t begin = first_key(lp[i], window) + sp * SPAN;
      const int64_t end = std::min(lp[i], begin + SPAN);
      const int64_t part = (i * spans + sp) * H + h0 * G;
      attend_span<Q, K>(qp + i * H * D, kp, vp, tp + i * maxb, begin, end, float(scale),
                        float(softcap), bs, hkv, h0, h0 + per, G, D, R, acc.data() + part * D,
                        ml.data() + part * 2, buf.data());
    }
  });
  at::parallel_for(0, n * H, 1, [&](int64_t a, int64_t e) {
    for (int64_t w = a; w < e; ++w) {
      const int64_t i = w / H, head = w % H;
      const int64_t first = (i * spans) * H + head;
      combine(acc.data() + first * D, ml.data() + first * 2, spans_of(lp[i], window), H, D,
              op + w * D);
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
  const int64_t spans = q.size(0) ? spans_of(lens_max, window) : 1;
  const auto qt = q.scalar_type();
  if (qt == at::kFloat && !coded)
    run<float, float>(q, k, v, table, lens, scale, window, softcap, spans, out);
  else if (qt == at::kBFloat16 && !coded)
    run<c10::BFloat16, c10::BFloat16>(q, k, v, table, lens, scale, window, softcap, spans, out);
  else if (qt == at::kFloat)
    run<float, int8_t>(q, k, v, table, lens, scale, window, softcap, spans, out);
  else if (qt == at::kBFloat16)
    run<c10::BFloat16, int8_t>(q, k, v, table, lens, scale, window, softcap, spans, out);
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
