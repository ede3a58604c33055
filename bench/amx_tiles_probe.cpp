// Where the time of a Q4_K product on AMX tiles goes (issue 39: cheaper verifies on Xeons with AMX).
// Standalone, one thread, the target's gate/up shape (17920 x 1536), random bytes:
//
//   g++ -O3 -march=sapphirerapids bench/amx_tiles_probe.cpp -o /tmp/amx_probe && /tmp/amx_probe
//
// Q4_K scales every 32 values by a per-row 6-bit scale, so a tile multiply (TDPBSUD) can cover only
// one sub-block: K = 32 per multiply, and each multiply's int32 sums must leave the tile (TILESTORED)
// to be scaled with vector instructions before the next sub-block. The loop below is that kernel's
// shape (what csrc/quant_x8_impl.h's dot_q4k_z computes with vpdpbusd), timed whole and with one part
// removed at a time:
//   full        the nibbles split into a B tile, A straight from the activations, multiply, store, scale;
//   no store    without TILESTORED and the scaling (wrong sums: timing only);
//   no B        without building the B tile (wrong sums: timing only).
// It prints ms per product, best of 5. Needs AMX-INT8 and a kernel that grants tile data.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {
constexpr int N = 17920, K = 1536, NB = K / 256, GROUP_BYTES = NB * 144 * 8;  // 8 interleaved rows per group

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(int R) {  // 0, 1: C (R x 16 int32); 2, 3: A (R x 32 int8); 4, 5: B (8 x 64 uint8)
  TileConfig c;
  for (int t = 0; t < 2; ++t) c.rows[t] = R, c.colsb[t] = 64, c.rows[2 + t] = R, c.colsb[2 + t] = 32, c.rows[4 + t] = 8, c.colsb[4 + t] = 64;
  asm volatile("ldtilecfg %0" : : "m"(c));  // GCC 12's _tile_loadconfig declares 8 bytes: the stores would die
}

enum Mode { kFull, kNoStore, kNoB };

template <int R, Mode MODE>
void product(const uint8_t* w, const int8_t* x, int32_t* sink) {
  alignas(64) uint8_t lo[512], hi[512];
  alignas(64) int32_t clo[R * 16], chi[R * 16];
  const __m512i m4 = _mm512_set1_epi8(0xF);
  __m512i total = _mm512_setzero_si512();
  configure(R);
  for (int g = 0; g < N / 8; g += 2) {  // two groups: 16 weight rows per tile
    for (int i = 0; i < NB; ++i) {
      const uint8_t* g0 = w + g * GROUP_BYTES + i * 1152;
      const uint8_t* g1 = g0 + GROUP_BYTES;
      __m512i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        for (int t = 0; t < 8; ++t) {
          const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g0 + 128 + 256 * c + 32 * t));
          const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g1 + 128 + 256 * c + 32 * t));
          const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
          if (MODE == kNoB) {
            total = _mm512_add_epi32(total, q);
          } else {
            _mm512_store_si512(lo + 64 * t, _mm512_and_si512(q, m4));
            _mm512_store_si512(hi + 64 * t, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
          }
        }
        const int8_t* xc = x + 256 * i + 64 * c;
        _tile_loadd(2, xc, K);
        _tile_loadd(3, xc + 32, K);
        _tile_loadd(4, lo, 64);
        _tile_loadd(5, hi, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 3, 5);
        if (MODE != kNoStore) {
          _tile_stored(0, clo, 64);
          _tile_stored(1, chi, 64);
          const __m512i s = _mm512_set1_epi32(c + 3);
          for (int r = 0; r < R; ++r)
            isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(clo + 16 * r), s),
                                                                 _mm512_mullo_epi32(_mm512_load_si512(chi + 16 * r), s)));
        }
      }
      for (int r = 0; r < R; ++r) total = _mm512_add_epi32(total, isum[r]);
    }
  }
  if (MODE == kNoStore) {
    _tile_stored(0, clo, 64);
    total = _mm512_add_epi32(total, _mm512_load_si512(clo));
  }
  _mm512_storeu_si512(sink, total);
  _tile_release();
}

template <int R, Mode MODE>
double best_ms(const uint8_t* w, const int8_t* x) {
  int32_t sink[16];
  double best = 1e9;
  for (int k = 0; k < 5; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    product<R, MODE>(w, x, sink);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    best = ms < best ? ms : best;
  }
  return best;
}

template <int R>
void row(const uint8_t* w, const int8_t* x) {
  std::printf("%2d rows: full %.2f ms, no store %.2f ms, no B %.2f ms\n", R, best_ms<R, kFull>(w, x),
              best_ms<R, kNoStore>(w, x), best_ms<R, kNoB>(w, x));
}
}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::fprintf(stderr, "this kernel does not grant AMX tile data\n");
    return 1;
  }
  const size_t bytes = size_t(N / 8) * GROUP_BYTES;
  auto* w = static_cast<uint8_t*>(std::aligned_alloc(64, bytes));
  auto* x = static_cast<int8_t*>(std::aligned_alloc(64, 16 * K));
  for (size_t i = 0; i < bytes; ++i) w[i] = uint8_t(std::rand());
  for (int i = 0; i < 16 * K; ++i) x[i] = int8_t(std::rand());
  row<1>(w, x);
  row<8>(w, x);
  row<16>(w, x);
  return 0;
}
