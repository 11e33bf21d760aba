#include "codec/rans_interleaved.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvtrie {
namespace irans {
namespace {

// Geometric-ish symbols, with a different distribution for each run of `run` symbols.
std::vector<uint8_t> Symbols(size_t n, size_t run, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> s(n);
  for (size_t i = 0; i < n; ++i) {
    std::geometric_distribution<int> geo(0.2 + 0.15 * ((i / run) % 4));
    s[i] = static_cast<uint8_t>(std::min(geo(rng), kMaxSymbols - 1));
  }
  return s;
}

std::vector<Table> TablesFor(const std::vector<uint8_t>& s, size_t run) {
  std::vector<Table> t;
  for (size_t i = 0; i < s.size(); i += run) {
    uint32_t counts[kMaxSymbols] = {};
    for (size_t k = i; k < i + run; ++k) ++counts[s[k]];
    t.push_back(NormalizeCounts(counts, kMaxSymbols));
  }
  return t;
}

struct Coded {
  std::vector<Table> tables;
  std::vector<DecodeTable> dec;
  std::vector<const Table*> tp;
  std::vector<const DecodeTable*> dp;
  std::string segment;
};

Coded Encode(const std::vector<uint8_t>& s, int lanes, size_t run) {
  Coded c;
  c.tables = TablesFor(s, run);
  c.dec.resize(c.tables.size());
  for (size_t i = 0; i < c.tables.size(); ++i) {
    BuildDecodeTable(c.tables[i], &c.dec[i]);
    c.tp.push_back(&c.tables[i]);
    c.dp.push_back(&c.dec[i]);
  }
  EncodeSegment(s, lanes, run, c.tp, &c.segment);
  return c;
}

TEST(RansInterleaved, RoundTripsEveryLaneCountScalarAndSimd) {
  for (int lanes : {1, 2, 4, 8, 16, 32}) {
    const size_t run = 4096;
    const std::vector<uint8_t> s = Symbols(4 * run, run, lanes);
    Coded c = Encode(s, lanes, run);
    std::vector<uint8_t> a(s.size()), b(s.size());
    ASSERT_TRUE(DecodeSegmentScalar(c.segment, lanes, run, c.dp, absl::MakeSpan(a)).ok());
    ASSERT_TRUE(DecodeSegment(c.segment, lanes, run, c.dp, absl::MakeSpan(b)).ok());
    EXPECT_EQ(HasAvx2(), __builtin_cpu_supports("avx2") != 0);  // the SIMD path ran if it can
    EXPECT_EQ(a, s) << lanes;
    EXPECT_EQ(b, s) << lanes;
  }
}

TEST(RansInterleaved, SimdAndScalarEncodersWriteTheSameBytes) {
  for (int lanes : {8, 16, 32}) {
    const size_t run = 2048;
    const std::vector<uint8_t> s = Symbols(8 * run, run, 11 + lanes);
    Coded simd = Encode(s, lanes, run);
    SetSimdForTesting(false);
    Coded scalar = Encode(s, lanes, run);
    SetSimdForTesting(true);
    EXPECT_EQ(simd.segment, scalar.segment) << lanes;
  }
  // Skewed tables (frequencies 1 and 4095) and uniform ones: the division estimate is exact.
  for (double p : {0.999, 0.5, 0.03}) {
    std::mt19937 rng(3);
    std::vector<uint8_t> s(1 << 14);
    std::geometric_distribution<int> geo(p);
    for (auto& v : s) v = static_cast<uint8_t>(std::min(geo(rng), kMaxSymbols - 1));
    Coded simd = Encode(s, 32, s.size());
    SetSimdForTesting(false);
    Coded scalar = Encode(s, 32, s.size());
    SetSimdForTesting(true);
    EXPECT_EQ(simd.segment, scalar.segment) << p;
    std::vector<uint8_t> out(s.size());
    ASSERT_TRUE(DecodeSegment(simd.segment, 32, s.size(), simd.dp, absl::MakeSpan(out)).ok());
    EXPECT_EQ(out, s);
  }
}

TEST(RansInterleaved, SizeIsCloseToTheEntropy) {
  const size_t run = 1 << 16;
  const std::vector<uint8_t> s = Symbols(run, run, 7);
  Coded c = Encode(s, 32, run);
  uint32_t counts[kMaxSymbols] = {};
  for (uint8_t v : s) ++counts[v];
  double h = 0;
  for (uint32_t k : counts)
    if (k) h -= k * std::log2(static_cast<double>(k) / s.size());
  EXPECT_LT(8.0 * c.segment.size(), 1.01 * h + 32 * 32);
  EXPECT_LT(CostBits(c.tables[0], counts, kMaxSymbols), 1.005 * h);
}

TEST(RansInterleaved, TablesSerializeAndRejectGarbage) {
  uint32_t counts[kMaxSymbols] = {900, 50, 40, 0, 3};
  const Table t = NormalizeCounts(counts, kMaxSymbols);
  EXPECT_EQ(t.num_symbols, 5);
  EXPECT_EQ(t.freq[3], 0);
  EXPECT_GT(t.freq[4], 0);
  std::string bytes;
  WriteTable(t, &bytes);
  absl::string_view in = bytes;
  Table u;
  ASSERT_TRUE(ReadTable(&in, &u).ok());
  EXPECT_TRUE(in.empty());
  for (int s = 0; s < 5; ++s) EXPECT_EQ(u.freq[s], t.freq[s]);
  // One symbol only: a second one gets frequency 1, so no frequency is kScale.
  uint32_t one[kMaxSymbols] = {0, 0, 7};
  const Table o = NormalizeCounts(one, kMaxSymbols);
  EXPECT_EQ(o.freq[2], kScale - 1);
  absl::string_view bad = "\x01";
  EXPECT_FALSE(ReadTable(&bad, &u).ok());
  const std::string over = std::string("\x02\x80\x20", 3);  // freq 4096: nothing left
  absl::string_view ov = over;
  EXPECT_FALSE(ReadTable(&ov, &u).ok());
}

TEST(RansInterleaved, TruncatedOrCorruptSegmentsAreDataLoss) {
  const size_t run = 2048;
  const std::vector<uint8_t> s = Symbols(2 * run, run, 3);
  Coded c = Encode(s, 32, run);
  std::vector<uint8_t> out(s.size());
  for (size_t cut : {size_t{2}, size_t{64}, c.segment.size() / 2}) {
    const std::string t = c.segment.substr(0, c.segment.size() - cut);
    EXPECT_EQ(DecodeSegment(t, 32, run, c.dp, absl::MakeSpan(out)).code(),
              absl::StatusCode::kDataLoss);
  }
  int detected = 0;
  for (size_t pos = 0; pos < c.segment.size(); pos += 97) {
    std::string bad = c.segment;
    bad[pos] ^= 0x10;
    const absl::Status st = DecodeSegment(bad, 32, run, c.dp, absl::MakeSpan(out));
    detected += !st.ok();
  }
  EXPECT_GT(detected, static_cast<int>(c.segment.size() / 97) * 9 / 10);
  EXPECT_FALSE(DecodeSegment(c.segment, 3, run, c.dp, absl::MakeSpan(out)).ok());
}

}  // namespace
}  // namespace irans
}  // namespace kvtrie
