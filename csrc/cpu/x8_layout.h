// The interleaved ("x8") layout of GGUF blocks, defined here once: the packer, the unpacker and the
// kernels (x8_impl.h, x8_zmm_impl.h) read these offsets; Python packs through the binding
// (`_quantext.pack_x8`, kernels/quant_pack.py).
//
// Eight weight rows per group, block by block: lane r of every 256-bit vector holds row r, so one
// vector instruction serves eight rows, their scales unpack in one pass and each row's sum ends in
// its own lane (no horizontal sum). A byte permutation of the file's blocks (Q6_K's values also
// recoded bit by bit), same size plus zero rows up to a multiple of 8. Per group and block:
//   Q4_0 / Q5_0 (8 x 18 / 8 x 22 bytes): d [8 rows][2]; (Q5_0) qh [8 rows][4], each row's 32 high bits;
//     qs [4 t][8 rows][4]: value bytes 4t .. 4t + 3 of each row (byte l: values l and l + 16).
//   Q4_K (8 x 144): d [8 rows][2]; dmin [8 rows][2]; scales [3 words][8 rows][4] (the 12 packed 6-bit
//     scale / min bytes as three 32-bit words); qs [4 c][8 t][8 rows][4]: bytes 32c + 4t .. + 3 of the 128.
//   Q6_K (8 x 210): d [8 rows][2]; scales [4 words][8 rows][4] (16 int8 sub-block scales);
//     values [2 h][8 t][3][8 rows][4]: per (h, t), byte b of row r, with v_k the 6-bit value
//     128h + 32k + 4t + b: A = v_0 | (v_2 >> 4) << 6, B = v_1 | (v_3 >> 4) << 6, C = (v_2 & 15) | (v_3 & 15) << 4.
// Q6_K's recoding: the file's order (low nibbles of v_0 | v_2 and of v_1 | v_3, then the four values'
// high bits) costs 18 vector instructions per four vectors of values, A / B / C 11 (v_0 = A & 63,
// v_2 = (C & 15) | (A >> 2 & 48)): +11-17% on the one-row loop in cache, +5-7% streamed
// (docs/design.md, "Experiments", CPU kernels).
#pragma once
#include "common.h"

#include <array>

namespace se {

constexpr int64_t kGroup = 8;  // rows per interleaved group
constexpr bool has_x8(int64_t q) { return q == kQ4_0 || q == kQ5_0 || q == kQ4_K || q == kQ6_K; }

// Where each field of a group's block starts (every format's fp16 d [8 rows][2] at 0): x8_byte places
// the bytes by these, and the kernels read at them.
constexpr int64_t kQ5High = 16;  // Q5_0: qh [8 rows][4]
constexpr int64_t kQ4KMins = 16, kQ4KScales = 32, kQ4KValues = 128;  // Q4_K: dmin, scale words, qs
constexpr int64_t kQ6Scales = 16, kQ6Values = 144;  // Q6_K: scale words, A/B/C values
// Q4_0 / Q5_0: where a group's value bytes start in its block (after d and Q5_0's high bits).
template <int Q>
constexpr int64_t kX8Values = Q == kQ5_0 ? kQ5High + 32 : 16;

// Where byte j of row r's block lands in its group's block (Q6_K: before its values are recoded).
template <int Q>
constexpr int64_t x8_byte(int64_t r, int64_t j) {
  if constexpr (Q == kQ4_0 || Q == kQ5_0) {
    if (j < 2) return 2 * r + j;
    if (Q == kQ5_0 && j < 6) return kQ5High + 4 * r + (j - 2);
    const int64_t v = j - (kBytes[Q] - 16);
    return kX8Values<Q> + 32 * (v / 4) + 4 * r + v % 4;
  } else if constexpr (Q == kQ4_K) {
    if (j < 2) return 2 * r + j;
    if (j < 4) return kQ4KMins + 2 * r + (j - 2);
    if (j < 16) return kQ4KScales + 32 * ((j - 4) / 4) + 4 * r + (j - 4) % 4;
    const int64_t v = j - 16;
    return kQ4KValues + 256 * (v / 32) + 32 * (v % 32 / 4) + 4 * r + v % 4;
  } else {  // Q6_K: the file's ql [2 h][2 c][32], qh [2 h][32], scales [16], d [2]
    if (j >= 208) return 2 * r + (j - 208);
    if (j >= 192) return kQ6Scales + 32 * ((j - 192) / 4) + 4 * r + (j - 192) % 4;
    const int64_t h = j < 128 ? j / 64 : (j - 128) / 32, c = j < 128 ? j % 64 / 32 : 2, k = j % 32;
    return kQ6Values + 96 * (8 * h + k / 4) + 32 * c + 4 * r + k % 4;
  }
}

// x8_byte for every (row, byte) of a group's block, row-major: [8 * kBytes[Q]].
template <int Q>
const std::array<int32_t, kGroup * kBytes[Q]>& x8_map() {
  static const auto map = [] {
    std::array<int32_t, kGroup * kBytes[Q]> m{};
    for (int64_t r = 0; r < kGroup; ++r)
      for (int64_t j = 0; j < kBytes[Q]; ++j) m[r * kBytes[Q] + j] = int32_t(x8_byte<Q>(r, j));
    return m;
  }();
  return map;
}

// Q6_K's values of one (h, t): the file's l0 (v_0 | v_2 << 4), l1 (v_1 | v_3 << 4) and high bits hb at
// v, v + 32, v + 64 -> A, B, C in place (encode), or back (decode).
inline void q6_recode(uint8_t* v, bool encode) {
  for (int i = 0; i < 32; ++i) {
    const uint8_t x = v[i], y = v[32 + i], z = v[64 + i];
    if (encode) {
      v[i] = (x & 15) | (z & 3) << 4 | (z >> 4 & 3) << 6;
      v[32 + i] = (y & 15) | (z >> 2 & 3) << 4 | (z >> 6) << 6;
      v[64 + i] = (x >> 4) | (y & 0xF0);
    } else {
      v[i] = (x & 15) | (z & 15) << 4;
      v[32 + i] = (y & 15) | (z & 0xF0);
      v[64 + i] = (x >> 4 & 3) | (y >> 4 & 3) << 2 | (x >> 6) << 4 | (y >> 6) << 6;
    }
  }
}

// The group's `rows` (each nb blocks, row_bytes apart; past `n` of them zero) -> its interleaved bytes.
template <int Q>
void pack_group(const uint8_t* rows, int64_t row_bytes, int64_t n, int64_t nb, uint8_t* p) {
  const auto& map = x8_map<Q>();
  for (int64_t i = 0; i < nb; ++i, p += kGroup * kBytes[Q]) {
    for (int64_t r = 0; r < kGroup; ++r)
      for (int64_t j = 0; j < kBytes[Q]; ++j)
        p[map[r * kBytes[Q] + j]] = r < n ? rows[r * row_bytes + i * kBytes[Q] + j] : 0;
    if constexpr (Q == kQ6_K)
      for (int64_t v = kQ6Values; v < kGroup * kBytes[Q]; v += 96) q6_recode(p + v, true);
  }
}

// Group g's first n rows of the file's layout back from the interleaved bytes (the baseline copy, tests).
template <int Q>
void unpack_group(const uint8_t* p, int64_t nb, uint8_t* rows /* [n][nb * kBytes[Q]] */, int64_t n = kGroup) {
  const auto& map = x8_map<Q>();
  const int64_t rb = nb * kBytes[Q];
  uint8_t block[kGroup * kBytes[Q]];
  for (int64_t i = 0; i < nb; ++i, p += kGroup * kBytes[Q]) {
    std::memcpy(block, p, sizeof(block));
    if constexpr (Q == kQ6_K)
      for (int64_t v = kQ6Values; v < kGroup * kBytes[Q]; v += 96) q6_recode(block + v, false);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < kBytes[Q]; ++j) rows[r * rb + i * kBytes[Q] + j] = block[map[r * kBytes[Q] + j]];
  }
}

}  // namespace se
