#include "codec/rans.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvtrie {
namespace {

TEST(Rans, SkewedSymbolsRoundTripNearTheirEntropy) {
  std::mt19937 rng(1);
  std::geometric_distribution<int> geo(0.6);  // p(s) = 0.6 * 0.4^s
  std::vector<int> symbols(20000);
  for (int& s : symbols) s = std::min(geo(rng), 15);
  AdaptiveModel em;
  RansEncoder enc;
  for (int s : symbols) enc.Put(em, s);
  std::string out;
  enc.Finish(&out);

  double entropy = 0;  // bits per symbol of the source
  for (int s = 0; s < 16; ++s) {
    const double p = s < 15 ? 0.6 * std::pow(0.4, s) : std::pow(0.4, 15);
    entropy -= p * std::log2(p);
  }
  const double bits = 8.0 * out.size() / symbols.size();
  EXPECT_LT(bits, entropy * 1.03 + 0.01) << "entropy " << entropy;
  EXPECT_GT(bits, entropy * 0.97);

  AdaptiveModel dm;
  RansDecoder dec(out);
  for (size_t i = 0; i < symbols.size(); ++i) ASSERT_EQ(dec.Get(dm), symbols[i]) << i;
  EXPECT_TRUE(dec.Finish().ok());
}

TEST(Rans, IntegersWithEscapesAndRawBitsRoundTrip) {
  std::mt19937 rng(2);
  std::vector<int32_t> values;
  for (int i = 0; i < 5000; ++i) {
    const int mag = i % 7 == 0 ? 1 << (rng() % 15) : static_cast<int>(rng() % 5);
    values.push_back((rng() & 1) ? mag : -mag);
  }
  values.push_back(32767);
  values.push_back(-32767);
  values.push_back(-32768);
  AdaptiveModel m, esc;
  RansEncoder enc;
  for (size_t i = 0; i < values.size(); ++i) {
    PutInt(enc, m, esc, values[i]);
    enc.PutBits(static_cast<uint32_t>(i), 16);
  }
  std::string out;
  enc.Finish(&out);
  AdaptiveModel dm, desc;
  RansDecoder dec(out);
  for (size_t i = 0; i < values.size(); ++i) {
    int32_t v;
    ASSERT_TRUE(GetInt(dec, dm, desc, &v));
    ASSERT_EQ(v, values[i]) << i;
    ASSERT_EQ(dec.GetBits(16), i & 0xffff);
  }
  EXPECT_TRUE(dec.Finish().ok());
}

TEST(Rans, AdaptationKeepsEveryFrequencyPositive) {
  AdaptiveModel m;
  for (int i = 0; i < 100000; ++i) m.Update(0);
  uint32_t total = 0;
  for (int s = 0; s < 16; ++s) {
    EXPECT_GE(m.freq(s), 1u) << s;
    total += m.freq(s);
  }
  EXPECT_EQ(total, AdaptiveModel::kTotal);
  EXPECT_LT(m.CostBits(0), 0.01);  // an always-seen symbol becomes nearly free
}

TEST(Rans, TruncatedOrExtendedStreamsAreDataLoss) {
  AdaptiveModel m;
  RansEncoder enc;
  for (int i = 0; i < 1000; ++i) enc.Put(m, (i * 7) % 16);
  std::string out;
  enc.Finish(&out);
  for (size_t len : {size_t{0}, size_t{3}, out.size() / 2, out.size() - 1}) {
    AdaptiveModel dm;
    RansDecoder dec(absl::string_view(out).substr(0, len));
    for (int i = 0; i < 1000; ++i) dec.Get(dm);
    EXPECT_EQ(dec.Finish().code(), absl::StatusCode::kDataLoss) << len;
  }
  AdaptiveModel dm;
  const std::string longer = out + "x";
  RansDecoder dec(longer);
  for (int i = 0; i < 1000; ++i) dec.Get(dm);
  EXPECT_EQ(dec.Finish().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace kvtrie
