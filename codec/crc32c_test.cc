#include "codec/crc32c.h"

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

}  // namespace
}  // namespace kvtrie
