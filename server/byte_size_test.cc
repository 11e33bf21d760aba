#include "server/byte_size.h"

#include <gtest/gtest.h>

namespace kvtrie {
namespace {

uint64_t Parse(const char* text) {
  uint64_t v = 0;
  std::string error;
  EXPECT_TRUE(ParseByteSize(text, &v, &error)) << text << ": " << error;
  return v;
}

TEST(ByteSize, BinaryAndDecimalUnitsDiffer) {
  EXPECT_EQ(Parse("8GiB"), 8ull << 30);
  EXPECT_EQ(Parse("512KiB"), 512ull << 10);
  EXPECT_EQ(Parse("1MiB"), 1ull << 20);
  EXPECT_EQ(Parse("1MB"), 1000000ull);
  EXPECT_EQ(Parse("2kB"), 2000ull);
  EXPECT_EQ(Parse("3GB"), 3000000000ull);
  EXPECT_EQ(Parse("1TiB"), 1ull << 40);
  EXPECT_EQ(Parse("4096"), 4096ull);
  EXPECT_EQ(Parse("4096B"), 4096ull);
  EXPECT_EQ(Parse(" 16 MiB "), 16ull << 20);
  EXPECT_EQ(Parse("1.5GiB"), 3ull << 29);
}

TEST(ByteSize, RejectsGarbageAndOverflowNamingTheText) {
  for (const char* bad : {"", "GiB", "8 XB", "-1", "1e3", "abc", "99999999999TiB", "1.2.3MB"}) {
    uint64_t v = 0;
    std::string error;
    EXPECT_FALSE(ParseByteSize(bad, &v, &error)) << bad;
    EXPECT_NE(error.find(std::string("'") + bad + "'"), std::string::npos) << error;
  }
}

TEST(ByteSize, FormatsTheShortestExactForm) {
  EXPECT_EQ(FormatByteSize(8ull << 30), "8GiB");
  EXPECT_EQ(FormatByteSize(1000000), "1MB");
  EXPECT_EQ(FormatByteSize(0), "0");
  EXPECT_EQ(FormatByteSize(1000001), "1000001");
  EXPECT_EQ(FormatByteSize(2000000000), "2GB");  // also 1953125KiB: the smaller number wins
  EXPECT_EQ(FormatByteSize(5000), "5kB");
  for (uint64_t v : {1ull << 30, 1000000ull, 12345ull, 1536ull, 5000ull}) {
    uint64_t back = 0;
    std::string error;
    ASSERT_TRUE(ParseByteSize(FormatByteSize(v), &back, &error));
    EXPECT_EQ(back, v);
  }
}

}  // namespace
}  // namespace kvtrie
