#include "codec/crc32c.h"

#include <random>
#include <string>

#include "gtest/gtest.h"

namespace kvtrie {
namespace {

TEST(Crc32c, MatchesTheStandardCheckValue) { EXPECT_EQ(Crc32c("123456789"), 0xE3069283u); }

TEST(Crc32c, MatchesRfc3720TestVectors) {
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62A8AB43u);
}

TEST(Crc32c, ExtendEqualsOneShotAtEverySplit) {
  std::string s;
  for (int i = 0; i < 100; ++i) s.push_back(static_cast<char>(i * 37 + 11));
  const uint32_t whole = Crc32c(s);
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    EXPECT_EQ(Crc32cExtend(Crc32cExtend(0, s.data(), cut), s.data() + cut, s.size() - cut), whole);
  }
}

// The bit-at-a-time definition, independent of both fast paths.
uint32_t Reference(const std::string& s) {
  uint32_t crc = 0xffffffffu;
  for (unsigned char ch : s) {
    crc ^= ch;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1)));
  }
  return ~crc;
}

TEST(Crc32c, LargeBuffersMatchTheBitwiseDefinition) {
  // Around the three-lane strides (768 bytes, 24 KiB, and multiples), at odd offsets and
  // lengths.
  std::mt19937 rng(7);
  std::string big(200000, '\0');
  for (char& c : big) c = static_cast<char>(rng());
  for (size_t n : {0ul, 7ul, 767ul, 768ul, 769ul, 1543ul, 24575ul, 24576ul, 24577ul, 32761ul,
                   49152ul, 73731ul, 199990ul}) {
    for (size_t off : {0ul, 3ul}) {
      const std::string s = big.substr(off, n);
      ASSERT_EQ(Crc32c(s), Reference(s)) << "n=" << n << " off=" << off;
      // Extended from a non-zero CRC, split inside a lane.
      const size_t cut = n / 3 + 1 < n ? n / 3 + 1 : n;
      EXPECT_EQ(Crc32cExtend(Crc32cExtend(0, s.data(), cut), s.data() + cut, n - cut), Crc32c(s));
    }
  }
}

}  // namespace
}  // namespace kvtrie
