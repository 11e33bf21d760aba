#include "codec/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace kvtrie {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // 0x1EDC6F41 reflected

constexpr std::array<std::array<uint32_t, 256>, 8> MakeTables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1)));
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
  return t;
}
constexpr auto kTables = MakeTables();

uint32_t ExtendPortable(uint32_t crc, const uint8_t* p, size_t n) {
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;
    crc = kTables[7][w & 0xff] ^ kTables[6][(w >> 8) & 0xff] ^ kTables[5][(w >> 16) & 0xff] ^
          kTables[4][(w >> 24) & 0xff] ^ kTables[3][(w >> 32) & 0xff] ^
          kTables[2][(w >> 40) & 0xff] ^ kTables[1][(w >> 48) & 0xff] ^ kTables[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ kTables[0][(crc ^ *p++) & 0xff];
  return crc;
}

// Operators that shift a CRC register past `len` zero bytes (so crc(A || B) =
// Shift(crc(A), |B|) ^ crc(B), registers started at 0), as 4 byte-indexed tables (M. Adler's
// crc32c.c): GF(2) 32x32 matrices, squared from the operator of one zero bit.
uint32_t Gf2Times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    ++mat;
  }
  return sum;
}
void Gf2Square(uint32_t* square, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = Gf2Times(mat, mat[n]);
}
using ShiftTables = std::array<std::array<uint32_t, 256>, 4>;
ShiftTables MakeShiftTables(size_t len) {  // len: a power of two, >= 2
  uint32_t even[32], odd[32];
  odd[0] = kPoly;  // one zero bit
  for (int n = 1; n < 32; ++n) odd[n] = 1u << (n - 1);
  Gf2Square(even, odd);  // two zero bits
  Gf2Square(odd, even);  // four
  for (;;) {
    Gf2Square(even, odd);  // a byte, then 4, 16, ... bytes
    len >>= 1;
    if (len == 0) break;
    Gf2Square(odd, even);  // 2, 8, 32, ... bytes
    len >>= 1;
    if (len == 0) {
      std::memcpy(even, odd, sizeof(even));
      break;
    }
  }
  ShiftTables t{};
  for (uint32_t n = 0; n < 256; ++n) {
    for (int b = 0; b < 4; ++b) t[b][n] = Gf2Times(even, n << (8 * b));
  }
  return t;
}
uint32_t Shift(const ShiftTables& t, uint32_t crc) {
  return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
}

#if defined(__x86_64__)
// The `crc32` instruction has a latency of 3 cycles and a throughput of 1: three independent
// streams over adjacent lanes keep it busy (3x one stream), then the lanes' CRCs are combined
// with the shift tables: 8 KiB lanes while 24 KiB are left, then 256-byte lanes (RocksDB
// checksums its WAL in 32 KiB fragments).
constexpr size_t kLongLane = 8192;
constexpr size_t kShortLane = 256;
const ShiftTables& LongShift() {
  static const ShiftTables* const t = new ShiftTables(MakeShiftTables(kLongLane));
  return *t;
}
const ShiftTables& ShortShift() {
  static const ShiftTables* const t = new ShiftTables(MakeShiftTables(kShortLane));
  return *t;
}

// Three lanes of `lane` bytes from p while 3 x lane bytes are left; advances p and n.
__attribute__((target("sse4.2"))) inline uint64_t ThreeLanes(uint64_t c, const uint8_t*& p,
                                                             size_t& n, size_t lane,
                                                             const ShiftTables& shift) {
  while (n >= 3 * lane) {
    uint64_t c1 = 0, c2 = 0;
    for (const uint8_t* end = p + lane; p < end; p += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p, 8);
      std::memcpy(&w1, p + lane, 8);
      std::memcpy(&w2, p + 2 * lane, 8);
      c = _mm_crc32_u64(c, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    c = Shift(shift, static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c1);
    c = Shift(shift, static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c2);
    p += 2 * lane;
    n -= 3 * lane;
  }
  return c;
}

__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = crc;
  if (n >= 3 * kLongLane) c = ThreeLanes(c, p, n, kLongLane, LongShift());
  if (n >= 3 * kShortLane) c = ThreeLanes(c, p, n, kShortLane, ShortShift());
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
const bool kHaveSse42 = __builtin_cpu_supports("sse4.2");
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  crc = kHaveSse42 ? ExtendSse42(crc, p, n) : ExtendPortable(crc, p, n);
#else
  crc = ExtendPortable(crc, p, n);
#endif
  return ~crc;
}

}  // namespace kvtrie
