// Two ways to run a Q4_K product on AMX tiles (issue 39: cheaper prefills on Xeons with AMX), timed.
// Standalone, one thread, the target's gate/up shape (17920 x 1536), random bytes, 16 activation rows:
//
//   g++ -O3 -march=sapphirerapids bench/amx_tiles_probe.cpp -o /tmp/amx_probe && /tmp/amx_probe
//
// Q4_K scales every 32 values by a per-row 6-bit scale, which a tile multiply (TDPBSUD) cannot apply.
// - per sub-block: a multiply covers one sub-block (32 values); its int32 sums are stored (TILESTORED)
//   and scaled with vector code before the next (the first version of csrc/cpu/amx_impl.h);
//   also timed without that store and scaling (wrong sums: where the time goes);
// - scales in the bytes: each scale s = l + 16 h (l < 16, h < 4) multiplies the 4-bit values inside
//   their bytes (q l <= 225, q h <= 45), so a super-block's 256 values accumulate in two tiles and
//   leave them once (csrc/cpu/amx_impl.h now).
// Both must give the same integer sums (checked against a scalar loop on a small shape first).
// Prints ms per product, best of 5. Needs AMX-INT8 and a kernel that grants tile data.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {
constexpr int R = 16;  // activation rows

struct Shape {
  int N, K;
  int nb() const { return K / 256; }
  int group_bytes() const { return nb() * 144 * 8; }  // 8 interleaved rows per group
};

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(const int (&rows)[8], const int (&colsb)[8]) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = rows[t], c.colsb[t] = colsb[t];
  asm volatile("ldtilecfg %0" : : "m"(c));  // GCC 12's _tile_loadconfig declares 8 bytes: the stores would die
}

// GCC 12's tile intrinsics declare no memory operands: scratch stores and tile loads / stores must be fenced.
inline void barrier() { asm volatile("" ::: "memory"); }

// A stand-in 6-bit scale of weight row n, sub-block j (from bytes the product never reads as values).
inline uint8_t scale(const uint8_t* g0, const uint8_t* g1, int n, int j) { return (n < 8 ? g0 : g1)[32 + (n % 8) * 8 + j] & 63; }

inline __m512i load2(const uint8_t* g0, const uint8_t* g1, int off) {  // two groups' 32-byte steps side by side
  const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g0 + off));
  const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g1 + off));
  return _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
}

// f(i, g0, g1, sc) for super-block i of every pair of groups g0, g1, with their sub-blocks' scales sc[j][n]
template <typename F>
void each_super_block(Shape s, const uint8_t* w, F f) {
  alignas(64) int32_t sc[8][16];
  for (int g = 0; g < s.N / 8; g += 2)
    for (int i = 0; i < s.nb(); ++i) {
      const uint8_t* g0 = w + g * s.group_bytes() + i * 1152;
      const uint8_t* g1 = g0 + s.group_bytes();
      for (int j = 0; j < 8; ++j)
        for (int n = 0; n < 16; ++n) sc[j][n] = scale(g0, g1, n, j);
      f(i, g0, g1, sc);
    }
}

// sum over super-blocks and rows of (r + 1) x row r's integer sums: one checksum per weight-row lane
template <bool STORE>
void per_sub_block(Shape s, const uint8_t* w, const int8_t* x, int32_t* sink) {
  configure({R, R, R, R, 8, 8, 0, 0}, {64, 64, 32, 32, 64, 64, 0, 0});
  alignas(64) uint8_t lo[512], hi[512];
  alignas(64) int32_t clo[R * 16], chi[R * 16];
  const __m512i m4 = _mm512_set1_epi8(0xF);
  __m512i total = _mm512_setzero_si512();
  each_super_block(s, w, [&](int i, const uint8_t* g0, const uint8_t* g1, const int32_t (&sc)[8][16]) {
      __m512i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        barrier();
        for (int t = 0; t < 8; ++t) {
          const __m512i q = load2(g0, g1, 128 + 256 * c + 32 * t);
          _mm512_store_si512(lo + 64 * t, _mm512_and_si512(q, m4));
          _mm512_store_si512(hi + 64 * t, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
        }
        barrier();
        _tile_loadd(2, x + 256 * i + 64 * c, s.K);
        _tile_loadd(3, x + 256 * i + 64 * c + 32, s.K);
        _tile_loadd(4, lo, 64);
        _tile_loadd(5, hi, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 3, 5);
        if (STORE) {
          _tile_stored(0, clo, 64);
          _tile_stored(1, chi, 64);
          barrier();
          const __m512i sl = _mm512_load_si512(sc[2 * c]), sh = _mm512_load_si512(sc[2 * c + 1]);
          for (int r = 0; r < R; ++r)
            isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(clo + 16 * r), sl),
                                                                 _mm512_mullo_epi32(_mm512_load_si512(chi + 16 * r), sh)));
        }
      }
      for (int r = 0; r < R; ++r) total = _mm512_add_epi32(total, _mm512_mullo_epi32(isum[r], _mm512_set1_epi32(r + 1)));
  });
  _mm512_storeu_si512(sink, total);
  _tile_release();
}

inline __m512i pair16(__m512i v) { return _mm512_or_si512(v, _mm512_slli_epi32(v, 16)); }

void scales_in_bytes(Shape s, const uint8_t* w, const int8_t* x, int32_t* sink) {
  configure({R, R, R, 0, 16, 16, 0, 0}, {64, 64, 64, 0, 64, 64, 0, 0});
  alignas(64) uint8_t bl[1024], bh[1024];
  alignas(64) int32_t cl[R * 16], ch[R * 16];
  const __m512i m4 = _mm512_set1_epi8(0xF), low4 = _mm512_set1_epi32(15);
  __m512i total = _mm512_setzero_si512();
  each_super_block(s, w, [&](int i, const uint8_t* g0, const uint8_t* g1, const int32_t (&sc)[8][16]) {
      _tile_zero(0);
      _tile_zero(1);
      for (int c = 0; c < 4; ++c) {
        __m512i l[2], h[2];
        for (int k = 0; k < 2; ++k) {
          const __m512i v = _mm512_load_si512(sc[2 * c + k]);
          l[k] = pair16(_mm512_and_si512(v, low4));
          h[k] = pair16(_mm512_srli_epi32(v, 4));
        }
        barrier();
        for (int t = 0; t < 8; ++t) {
          const __m512i q = load2(g0, g1, 128 + 256 * c + 32 * t);
          const __m512i vl = _mm512_and_si512(q, m4), vh = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
          _mm512_store_si512(bl + 64 * t, _mm512_mullo_epi16(vl, l[0]));
          _mm512_store_si512(bl + 512 + 64 * t, _mm512_mullo_epi16(vh, l[1]));
          _mm512_store_si512(bh + 64 * t, _mm512_mullo_epi16(vl, h[0]));
          _mm512_store_si512(bh + 512 + 64 * t, _mm512_mullo_epi16(vh, h[1]));
        }
        barrier();
        _tile_loadd(2, x + 256 * i + 64 * c, s.K);
        _tile_loadd(4, bl, 64);
        _tile_loadd(5, bh, 64);
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 2, 5);
      }
      _tile_stored(0, cl, 64);
      _tile_stored(1, ch, 64);
      barrier();
      for (int r = 0; r < R; ++r) {
        const __m512i v = _mm512_add_epi32(_mm512_load_si512(cl + 16 * r), _mm512_slli_epi32(_mm512_load_si512(ch + 16 * r), 4));
        total = _mm512_add_epi32(total, _mm512_mullo_epi32(v, _mm512_set1_epi32(r + 1)));
      }
  });
  _mm512_storeu_si512(sink, total);
  _tile_release();
}

void scalar(Shape s, const uint8_t* w, const int8_t* x, int32_t* sink) {
  std::memset(sink, 0, 64);
  for (int g = 0; g < s.N / 8; g += 2)
    for (int i = 0; i < s.nb(); ++i) {
      const uint8_t* g0 = w + g * s.group_bytes() + i * 1152;
      const uint8_t* g1 = g0 + s.group_bytes();
      for (int r = 0; r < R; ++r)
        for (int n = 0; n < 16; ++n) {
          int32_t isum = 0;
          for (int j = 0; j < 8; ++j) {
            int32_t dot = 0;
            for (int k = 0; k < 32; ++k) {
              const uint8_t b = (n < 8 ? g0 : g1)[128 + 256 * (j / 2) + 32 * (k / 4) + 4 * (n % 8) + k % 4];
              dot += (j % 2 ? b >> 4 : b & 15) * x[r * s.K + 256 * i + 32 * j + k];
            }
            isum += dot * scale(g0, g1, n, j);
          }
          sink[n] += isum * (r + 1);
        }
    }
}

template <typename F>
double best_ms(F f, int32_t* sink) {
  double best = 1e9;
  for (int k = 0; k < 5; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    f(sink);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    best = ms < best ? ms : best;
  }
  return best;
}
}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::fprintf(stderr, "this kernel does not grant AMX tile data\n");
    return 1;
  }
  const Shape big{17920, 1536}, small{32, 512};
  const size_t bytes = size_t(big.N / 8) * big.group_bytes();
  auto* w = static_cast<uint8_t*>(std::aligned_alloc(64, bytes));
  auto* x = static_cast<int8_t*>(std::aligned_alloc(64, R * big.K));
  for (size_t i = 0; i < bytes; ++i) w[i] = uint8_t(std::rand());
  for (int i = 0; i < R * big.K; ++i) x[i] = int8_t(std::rand());
  int32_t ref[16], a[16], b[16];
  scalar(small, w, x, ref);
  per_sub_block<true>(small, w, x, a);
  scales_in_bytes(small, w, x, b);
  if (std::memcmp(ref, a, 64) || std::memcmp(ref, b, 64)) {
    std::fprintf(stderr, "sums differ from the scalar loop: per sub-block %d, scales in the bytes %d\n",
                 std::memcmp(ref, a, 64) != 0, std::memcmp(ref, b, 64) != 0);
    return 1;
  }
  const double full = best_ms([&](int32_t* o) { per_sub_block<true>(big, w, x, o); }, a);
  const double bare = best_ms([&](int32_t* o) { per_sub_block<false>(big, w, x, o); }, a);
  const double fold = best_ms([&](int32_t* o) { scales_in_bytes(big, w, x, o); }, b);
  std::printf("%d rows, same sums as a scalar loop: per sub-block %.2f ms (without its stores and scaling %.2f ms), "
              "scales in the bytes %.2f ms\n", R, full, bare, fold);
  return 0;
}
