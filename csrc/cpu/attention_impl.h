// Batch-invariant verification attention on CPU for the CPU kernels, included once per
// instruction set inside its own namespace (with `#pragma GCC target` around it). Self-contained: its includes are guarded, so inside an ISA's namespace they add nothing.
//
// Each query row's softmax runs over exactly the positions it sees (the cached prefix from its
// sliding window's start, then the chain or tree positions its mask allows), in position order, in fp32: a row's result never
// depends on how many queries share the call or how much of the cache is passed, so a verify
// gives every token the bits of decoding it alone. Its contract and spec are kernels/
// verify_attention.py's `verify_attention_ref` (the torch counterpart is `verify_attention_tiled`).
#pragma once
#include "common.h"

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // 16 lanes, loaded from unaligned rows

// q . k over D values in a fixed order: 16 lanes of partial sums, then the lanes in order.
template <typename T>
inline float dot_fixed(const float* __restrict q, const T* __restrict k, int64_t D) {
  float acc[16] = {};
  int64_t l = 0;
  for (; l + 16 <= D; l += 16)
    for (int j = 0; j < 16; ++j) acc[j] += q[l + j] * float(k[l + j]);
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; l < D; ++l) s += q[l] * float(k[l]);
  return s;
}

// Query row r of the flattened (b, i, h) grid: the positions it reads (lo..stop, its sliding window's
// start first), which of them its chain or tree mask hides, and where its K, V and output rows are.
template <typename T>
struct QueryRow {
  int64_t i, n0, stop, lo;
  const T *q, *k, *v;  // the query; the first K and V rows of its KV head (a position's: + s * stride)
  T* o;
  const bool* tm;

  QueryRow(const AttnArgs& a, int64_t r) {
    const int64_t b = r / (a.Q * a.Hq), h = r % a.Hq, kh = h / (a.Hq / a.Hkv);
    // positions in the order 0, Q-1, 1, Q-2, ...: a thread's contiguous share of rows mixes short and
    // long prefixes (in a prefill, row i reads i + 1 keys; in position order one thread got 3/4 of it)
    const int64_t u = r / a.Hq % a.Q;
    i = u % 2 ? a.Q - 1 - u / 2 : u / 2;
    n0 = a.lens[b];
    // a chain's query sees no new token after its own: a prefill's rows stop there (half the work)
    stop = std::min<int64_t>(a.L, n0 + (a.tree ? a.Q : i + 1));
    lo = a.window ? std::max<int64_t>(0, a.window[b * a.Q + i]) : 0;
    q = static_cast<const T*>(a.q) + b * a.qs[0] + i * a.qs[1] + h * a.qs[2];
    k = static_cast<const T*>(a.k) + b * a.ks[0] + kh * a.ks[2];
    v = static_cast<const T*>(a.v) + b * a.vs[0] + kh * a.vs[2];
    o = static_cast<T*>(a.out) + b * a.os[0] + i * a.os[1] + h * a.os[2];
    tm = a.tree ? a.tree + b * a.tree_bs + i * a.Q : nullptr;
  }

  bool hidden(int64_t s) const {  // s - n0 >= 0: one of the new tokens
    const int64_t j = s - n0;
    return j >= 0 && (tm ? !tm[j] : j > i);
  }
};

// Hides the positions `row` may not see (-inf in p) and returns the max of the others' scores; n: their
// count. The max in a local: kept in an array, each step had waited on a store (2x the loop).
template <typename T>
inline float mask_and_max(const QueryRow<T>& row, float* p, int64_t& n) {
  float m = -INFINITY;
  n = 0;
  for (int64_t s = row.lo; s < row.stop; ++s) {
    if (row.hidden(s)) {
      p[s] = -INFINITY;
      continue;
    }
    m = std::max(m, p[s]);
    ++n;
  }
  return m;
}

// ---- The same arithmetic, vectorized for head dims of 16 * ND (64, 128, 256): bit for bit the loops
// of attention_rows below. A key's 16 lane sums are added in lane order, as dot_fixed does, for 16
// keys at once: their 16 x 16 partial sums transposed in registers (four stages of two-source
// shuffles), then 15 vector adds. The query and the output row stay in registers.
typedef int32_t v16i __attribute__((vector_size(64)));

template <typename T>
inline v16 load16(const T* p) {
  float f[16];
  for (int j = 0; j < 16; ++j) f[j] = float(p[j]);
  v16 v;
  std::memcpy(&v, f, sizeof(v));
  return v;
}

// Stage w of the transpose swaps the off-diagonal w x w blocks of every 2w x 2w block.
template <int w>
inline void transpose_stage(v16* a) {
  v16i lo, hi;
  for (int c = 0; c < 16; ++c) {
    lo[c] = (c & w) ? 16 + c - w : c;
    hi[c] = (c & w) ? 16 + c : c + w;
  }
  for (int r = 0; r < 16; ++r)
    if (!(r & w)) {
      const v16 x = a[r], y = a[r + w];
      a[r] = __builtin_shuffle(x, y, lo);
      a[r + w] = __builtin_shuffle(x, y, hi);
    }
}

// p[0..16) = dot_fixed(q, k_j) for the 16 keys at k, k + stride, ...
template <int ND, typename T>
inline void dots16(const v16* q, const T* k, int64_t stride, float* p) {
  v16 acc[16];  // unrolled: GCC 12 otherwise runs each key's FMAs as one dependent chain through memory
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = v16{};
#pragma GCC unroll 16
  for (int c = 0; c < ND; ++c)
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) acc[j] += q[c] * load16(k + j * stride + 16 * c);
  transpose_stage<8>(acc);
  transpose_stage<4>(acc);
  transpose_stage<2>(acc);
  transpose_stage<1>(acc);
  v16 s = v16{} + acc[0];
  for (int j = 1; j < 16; ++j) s += acc[j];
  std::memcpy(p, &s, sizeof(s));
}

template <int ND, typename T>
void attention_rows_v(const AttnArgs& a, int64_t begin, int64_t end, float* p) {
  for (int64_t r = begin; r < end; ++r) {
    const QueryRow<T> row(a, r);
    float qf[16 * ND];
    for (int64_t l = 0; l < 16 * ND; ++l) qf[l] = float(row.q[l]) * a.scale;
    v16 qv[ND];
    for (int c = 0; c < ND; ++c) std::memcpy(&qv[c], qf + 16 * c, sizeof(v16));
    int64_t s = row.lo;
    for (; s + 16 <= row.stop; s += 16) dots16<ND>(qv, row.k + s * a.ks[1], a.ks[1], p + s);
    for (; s < row.stop; ++s) p[s] = dot_fixed(qf, row.k + s * a.ks[1], 16 * ND);
    int64_t n = 0;
    const float m = mask_and_max(row, p, n);
    v16 acc[ND];
    for (int c = 0; c < ND; ++c) acc[c] = v16{};
    float sum = 0.0f;
    for (s = row.lo; s < row.stop && n > 0; ++s) {
      if (p[s] == -INFINITY) continue;
      const float e = std::exp(p[s] - m);
      sum += e;
#pragma GCC unroll 16
      for (int c = 0; c < ND; ++c) acc[c] += e * load16(row.v + s * a.vs[1] + 16 * c);
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    float out[16 * ND];
    for (int c = 0; c < ND; ++c) std::memcpy(out + 16 * c, &acc[c], sizeof(v16));
    for (int64_t l = 0; l < 16 * ND; ++l) row.o[l] = T(out[l] * inv);
  }
}

#if defined(SE_AVX2) && !defined(SE_WIDE)
// AVX2 (16 ymm registers): dots16's 16 x 16 tile is 32 registers, and GCC lowered its 64-byte shuffles
// element by element: slower than the scalar loop (2026-12-06, AVX2 EPYC, one thread, 512 keys: 85 ns
// a query head and key against the scalar loop's 72). Here 8 keys at a time in native registers, each
// key's 16 lane sums as two halves (lanes 0-7, then 8-15, each pass 8 accumulators and the query's
// half), the halves transposed 8 x 8 and added in lane order: dot_fixed's operations in its order.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32 is exact: the bits moved up 16
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20), r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
}

// p[0..8) = dot_fixed(q, k_j) for the 8 keys at k, k + stride, ... (q: 16 * ND floats, scaled)
template <int ND, typename T>
inline void dots8(const float* q, const T* k, int64_t stride, float* p) {
  __m256 s = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int c = 0; c < ND; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + 16 * c + 8 * half);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, load8(k + j * stride + 16 * c + 8 * half), acc[j]);
    }
    transpose8(acc);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) s = _mm256_add_ps(s, acc[i]);
  }
  _mm256_storeu_ps(p, s);
}

// The query heads of one KV head (GQA: 6 of the 1.5B's 12 share each), up to kAttnGroup at a time, over
// one pass of its keys and values: a tile of 8 keys (dots8) and of 16 keys' 64 values (the weighted sum)
// is read from L2 once for all of them, not once per head. Each head's operations and their order are
// attention_rows' (a head's sums stored and reloaded between tiles: exact). p: kAttnGroup * L floats.
template <int ND, typename T>
void attention_heads(const AttnArgs& a, int64_t begin, int64_t end, float* p) {
  // Keys per pass of the weighted sum. Rows a power of two apart share few L1 sets: 64 rows' 256 bytes at
  // a 1 KiB stride (the 1.5B's KV rows) fell on 16 of the 64 sets and evicted one another before the
  // next head read them; 16 rows take 4 ways of those sets.
  constexpr int64_t kTile = 16;
  const int64_t G = a.Hq / a.Hkv, L = a.L;
  for (int64_t r = begin; r < end;) {
    const int64_t g = std::min<int64_t>({G - r % a.Hq % G, end - r, kAttnGroup});  // same b, query and KV head
    const QueryRow<T> row(a, r);
    alignas(32) float qf[kAttnGroup][16 * ND], out[kAttnGroup][16 * ND];
    float sum[kAttnGroup];
    for (int64_t j = 0; j < g; ++j) {
      const QueryRow<T> rj(a, r + j);
      for (int64_t l = 0; l < 16 * ND; ++l) qf[j][l] = float(rj.q[l]) * a.scale;
    }
    // The KV rows are a stride apart (Hkv * D values): each key's first touch missed L2 and the
    // hardware did not prefetch them (half the loop's samples at the loads); the next tile's rows are asked for.
    constexpr int64_t kLine = 64 / sizeof(T), kRowLines = 16 * ND / kLine;
    int64_t s = row.lo;
    for (; s + 8 <= row.stop; s += 8) {
      for (int64_t kk = 8; kk < 16 && s + kk < row.stop; ++kk)
        for (int64_t l = 0; l < kRowLines; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(row.k + (s + kk) * a.ks[1] + l * kLine), _MM_HINT_T0);
      for (int64_t j = 0; j < g; ++j) dots8<ND>(qf[j], row.k + s * a.ks[1], a.ks[1], p + j * L + s);
    }
    for (; s < row.stop; ++s)
      for (int64_t j = 0; j < g; ++j) p[j * L + s] = dot_fixed(qf[j], row.k + s * a.ks[1], 16 * ND);
    int64_t n = 0;
    for (int64_t j = 0; j < g; ++j) {
      float* pj = p + j * L;
      const float mj = mask_and_max(row, pj, n);
      float sj = 0.0f;
      // the weights in place (a hidden key keeps -inf), then their sum: summed in the same loop, the
      // running sum was spilled around every call of exp (no vector register survives a call)
      for (s = row.lo; s < row.stop && n > 0; ++s)
        if (pj[s] != -INFINITY) pj[s] = std::exp(pj[s] - mj);
      for (s = row.lo; s < row.stop && n > 0; ++s)
        if (pj[s] != -INFINITY) sj += pj[s];
      sum[j] = sj;
    }
    for (int64_t c0 = 0; c0 < 16 * ND; c0 += 64) {
      for (int64_t j = 0; j < g; ++j)
        for (int c = 0; c < 64; ++c) out[j][c0 + c] = 0.0f;
      for (int64_t s0 = row.lo; s0 < row.stop && n > 0; s0 += kTile) {
        const int64_t s1 = std::min(row.stop, s0 + kTile);
        for (int64_t j = 0; j < g; ++j) {
          const float* pj = p + j * L;
          __m256 acc[8];
#pragma GCC unroll 8
          for (int c = 0; c < 8; ++c) acc[c] = _mm256_load_ps(out[j] + c0 + 8 * c);
          for (s = s0; s < s1; ++s) {
            if (j == 0 && s + 4 < s1)  // the first head's pass brings the tile's values in
              for (int64_t l = 0; l < 64 / kLine; ++l)
                _mm_prefetch(reinterpret_cast<const char*>(row.v + (s + 4) * a.vs[1] + c0 + l * kLine), _MM_HINT_T0);
            if (pj[s] == -INFINITY) continue;
            const __m256 e = _mm256_set1_ps(pj[s]);
            const T* v = row.v + s * a.vs[1] + c0;
#pragma GCC unroll 8
            for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(e, load8(v + 8 * c), acc[c]);
          }
#pragma GCC unroll 8
          for (int c = 0; c < 8; ++c) _mm256_store_ps(out[j] + c0 + 8 * c, acc[c]);
        }
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      const QueryRow<T> rj(a, r + j);
      const float inv = sum[j] > 0.0f ? 1.0f / sum[j] : 0.0f;
      for (int64_t l = 0; l < 16 * ND; ++l) rj.o[l] = T(out[j][l] * inv);
    }
    r += g;
  }
}
#endif  // SE_AVX2 && !SE_WIDE

// Query rows begin..end of the flattened (b, i, h) grid; `p`: scratch of L floats, `acc`: D floats.
template <typename T>
void attention_rows(const AttnArgs& a, int64_t begin, int64_t end, float* p, float* acc, float* qf) {
  for (int64_t r = begin; r < end; ++r) {
    const QueryRow<T> row(a, r);
    for (int64_t l = 0; l < a.D; ++l) qf[l] = float(row.q[l]) * a.scale;
    int64_t n = 0;  // visible positions, in order: their scores in p[0..n)
    float m = -INFINITY;
    for (int64_t s = row.lo; s < row.stop; ++s) {
      if (row.hidden(s)) {
        p[s] = -INFINITY;
        continue;
      }
      p[s] = dot_fixed(qf, row.k + s * a.ks[1], a.D);
      m = std::max(m, p[s]);
      ++n;
    }
    for (int64_t l = 0; l < a.D; ++l) acc[l] = 0.0f;
    float sum = 0.0f;
    for (int64_t s = row.lo; s < row.stop && n > 0; ++s) {
      if (p[s] == -INFINITY) continue;
      const float e = std::exp(p[s] - m);
      sum += e;
      const T* v = row.v + s * a.vs[1];
      for (int64_t l = 0; l < a.D; ++l) acc[l] += e * float(v[l]);
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t l = 0; l < a.D; ++l) row.o[l] = T(acc[l] * inv);
  }
}

inline void row_attention(bool bf16, const AttnArgs& a, int64_t begin, int64_t end, float* p, float* acc,
                          float* qf) {
  if (!a.plain && (a.D == 64 || a.D == 128 || a.D == 256)) {
    const auto run = [&](auto t) {
      using T = decltype(t);
#if defined(SE_AVX2) && !defined(SE_WIDE)
      if (a.D == 64) attention_heads<4, T>(a, begin, end, p);
      else if (a.D == 128) attention_heads<8, T>(a, begin, end, p);
      else attention_heads<16, T>(a, begin, end, p);
#else
      if (a.D == 64) attention_rows_v<4, T>(a, begin, end, p);
      else if (a.D == 128) attention_rows_v<8, T>(a, begin, end, p);
      else attention_rows_v<16, T>(a, begin, end, p);
#endif
    };
    return bf16 ? run(c10::BFloat16()) : run(float());
  }
  if (bf16)
    attention_rows<c10::BFloat16>(a, begin, end, p, acc, qf);
  else
    attention_rows<float>(a, begin, end, p, acc, qf);
}
