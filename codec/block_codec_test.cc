#include "codec/block_codec.h"

#include <string>
#include <vector>

#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

// Real KV blocks from tests/data (stories260K on GPL-3 text), in block layout.
std::vector<std::vector<uint8_t>> RealBlocks(const char* dump, BlockGeometry* g) {
  absl::StatusOr<KvDump> d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + dump);
  EXPECT_TRUE(d.ok()) << d.status();
  *g = BlockGeometry{d->num_layers, d->num_kv_heads, 16, d->head_dim, d->dtype};
  std::vector<std::vector<uint8_t>> blocks;
  for (size_t b = 0; b < d->num_tokens() / 16; ++b) {
    blocks.emplace_back(g->num_bytes());
    GatherBlock(*g, d->num_tokens(), d->k.data(), d->v.data(), b, absl::MakeSpan(blocks.back()));
  }
  return blocks;
}

class CodecRoundTrip : public testing::TestWithParam<Encoding> {};

TEST_P(CodecRoundTrip, RealBlocksDecodeBitExact) {
  BlockGeometry g;
  for (const auto& block : RealBlocks("GPL-3", &g)) {
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, block, {.encoding = GetParam()});
    ASSERT_TRUE(e.ok()) << e.status();
    std::vector<uint8_t> out(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out)).ok());
    ASSERT_EQ(out, block);
    absl::StatusOr<BlockHeader> h = ParseBlock(e->bytes);
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(h->geometry, g);
    EXPECT_EQ(h->encoding, GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Encodings, CodecRoundTrip,
                         testing::Values(Encoding::kRaw, Encoding::kLossless));

TEST(Codec, LosslessIsSmallerThanRawOnRealKv) {
  BlockGeometry g;
  size_t raw = 0, lossless = 0;
  for (const auto& block : RealBlocks("genesis_1-3", &g)) {
    raw += block.size();
    lossless += EncodeBlock(g, block, {.encoding = Encoding::kLossless})->bytes.size();
  }
  EXPECT_LT(lossless, raw);
}

TEST(Codec, LosslessIsAtLeast15PercentSmallerThanFp16OnEveryRealDump) {
  for (const char* dump :
       {"sessions/s0", "sessions/s1", "sessions/s2", "sessions/s3", "neardup/n0", "neardup/n1",
        "neardup/n2", "neardup/n3", "genesis_1-3", "GPL-3", "story_prompt"}) {
    BlockGeometry g;
    size_t raw = 0, lossless = 0;
    for (const auto& block : RealBlocks(dump, &g)) {
      raw += block.size();
      const std::string bytes = EncodeBlock(g, block, {.encoding = Encoding::kLossless})->bytes;
      lossless += bytes.size();
      std::vector<uint8_t> out(g.num_bytes());
      ASSERT_TRUE(DecodeBlock(bytes, absl::MakeSpan(out)).ok());
      ASSERT_EQ(out, block) << dump;
    }
    EXPECT_GE(static_cast<double>(raw) / lossless, 1.15) << dump;
  }
}

TEST(Codec, EveryFlippedBitIsDataLossNeverWrongBytes) {
  BlockGeometry g;
  const auto block = RealBlocks("story_prompt", &g)[3];
  const std::string good = EncodeBlock(g, block, {.encoding = Encoding::kLossless})->bytes;
  std::vector<uint8_t> out(g.num_bytes());
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] ^= static_cast<char>(1 << (i % 8));
    absl::Status s = DecodeBlock(bad, absl::MakeSpan(out));
    ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << "byte " << i << ": " << s;
  }
}

TEST(Codec, TruncatedBlocksAreDataLoss) {
  BlockGeometry g;
  const auto block = RealBlocks("story_prompt", &g)[0];
  const std::string good = EncodeBlock(g, block, {.encoding = Encoding::kRaw})->bytes;
  std::vector<uint8_t> out(g.num_bytes());
  for (size_t len = 0; len < good.size(); len += 7) {
    EXPECT_EQ(DecodeBlock(good.substr(0, len), absl::MakeSpan(out)).code(),
              absl::StatusCode::kDataLoss);
  }
}

TEST(Codec, WrongSizedInputIsInvalidArgumentNamingKv) {
  BlockGeometry g{.num_layers = 5, .num_kv_heads = 4, .block_tokens = 16, .head_dim = 8};
  std::vector<uint8_t> short_block(g.num_bytes() - 2);
  absl::StatusOr<EncodedBlock> e = EncodeBlock(g, short_block, {});
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("kv:"), absl::string_view::npos);
}

TEST(KvLayout, GatherThenScatterRestoresTheSequence) {
  absl::StatusOr<KvDump> d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/story_prompt");
  ASSERT_TRUE(d.ok());
  BlockGeometry g{d->num_layers, d->num_kv_heads, 16, d->head_dim, d->dtype};
  std::vector<uint8_t> k(d->k.size()), v(d->v.size()), block(g.num_bytes());
  const size_t full = d->num_tokens() / 16;
  for (size_t b = 0; b < full; ++b) {
    GatherBlock(g, d->num_tokens(), d->k.data(), d->v.data(), b, absl::MakeSpan(block));
    ScatterBlock(g, d->num_tokens(), block, b, k.data(), v.data());
  }
  // Every token of every full block is back; the partial tail is untouched (zero).
  const size_t row = d->num_tokens() * d->head_dim * 2;
  for (size_t r = 0; r < d->k.size() / row; ++r) {
    const size_t n = full * 16 * d->head_dim * 2;
    ASSERT_EQ(0, memcmp(k.data() + r * row, d->k.data() + r * row, n));
    ASSERT_EQ(0, memcmp(v.data() + r * row, d->v.data() + r * row, n));
  }
}

}  // namespace
}  // namespace kvtrie
