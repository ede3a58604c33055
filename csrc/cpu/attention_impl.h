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
    float m = -INFINITY;
    for (s = row.lo; s < row.stop; ++s) {
      if (row.hidden(s)) {
        p[s] = -INFINITY;
        continue;
      }
      m = std::max(m, p[s]);
      ++n;
    }
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
      if (a.D == 64) attention_rows_v<4, T>(a, begin, end, p);
      else if (a.D == 128) attention_rows_v<8, T>(a, begin, end, p);
      else attention_rows_v<16, T>(a, begin, end, p);
    };
    return bf16 ? run(c10::BFloat16()) : run(float());
  }
  if (bf16)
    attention_rows<c10::BFloat16>(a, begin, end, p, acc, qf);
  else
    attention_rows<float>(a, begin, end, p, acc, qf);
}
