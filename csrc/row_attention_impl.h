// Batch-invariant verification attention on CPU for quant_matmul.cpp's extension, included once per
// instruction set inside its own namespace (with `#pragma GCC target` around it). No includes here.
//
// Each query row's softmax runs over exactly the positions it sees (the cached prefix from its
// sliding window's start, then the chain or tree positions its mask allows), in position order, in fp32: a row's result never
// depends on how many queries share the call or how much of the cache is passed, so a verify
// gives every token the bits of decoding it alone. Its contract and spec are kernels/
// verify_attention.py's `verify_attention_ref` (the torch counterpart is `verify_attention_tiled`).

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

// Query rows begin..end of the flattened (b, i, h) grid; `p`: scratch of L floats, `acc`: D floats.
template <typename T>
void attention_rows(const AttnArgs& a, int64_t begin, int64_t end, float* p, float* acc, float* qf) {
  const T *Q = static_cast<const T*>(a.q), *K = static_cast<const T*>(a.k), *V = static_cast<const T*>(a.v);
  T* O = static_cast<T*>(a.out);
  const int64_t G = a.Hq / a.Hkv;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t b = r / (a.Q * a.Hq), i = r / a.Hq % a.Q, h = r % a.Hq, kh = h / G;
    const int64_t n0 = a.lens[b], stop = std::min<int64_t>(a.L, n0 + a.Q);
    const int64_t lo = a.window ? std::max<int64_t>(0, a.window[b * a.Q + i]) : 0;  // a sliding window's start
    const T* q = Q + b * a.qs[0] + i * a.qs[1] + h * a.qs[2];
    for (int64_t l = 0; l < a.D; ++l) qf[l] = float(q[l]) * a.scale;
    const bool* tm = a.tree ? a.tree + b * a.tree_bs + i * a.Q : nullptr;
    int64_t n = 0;  // visible positions, in order: their scores in p[0..n)
    float m = -INFINITY;
    for (int64_t s = lo; s < stop; ++s) {
      const int64_t j = s - n0;  // >= 0: one of the new tokens
      if (j >= 0 && (tm ? !tm[j] : j > i)) {
        p[s] = -INFINITY;
        continue;
      }
      p[s] = dot_fixed(qf, K + b * a.ks[0] + s * a.ks[1] + kh * a.ks[2], a.D);
      m = std::max(m, p[s]);
      ++n;
    }
    for (int64_t l = 0; l < a.D; ++l) acc[l] = 0.0f;
    float sum = 0.0f;
    for (int64_t s = lo; s < stop && n > 0; ++s) {
      if (p[s] == -INFINITY) continue;
      const float e = std::exp(p[s] - m);
      sum += e;
      const T* v = V + b * a.vs[0] + s * a.vs[1] + kh * a.vs[2];
      for (int64_t l = 0; l < a.D; ++l) acc[l] += e * float(v[l]);
    }
    T* o = O + b * a.os[0] + i * a.os[1] + h * a.os[2];
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t l = 0; l < a.D; ++l) o[l] = T(acc[l] * inv);
  }
}

inline void row_attention(bool bf16, const AttnArgs& a, int64_t begin, int64_t end, float* p, float* acc,
                          float* qf) {
  if (bf16)
    attention_rows<c10::BFloat16>(a, begin, end, p, acc, qf);
  else
    attention_rows<float>(a, begin, end, p, acc, qf);
}
