// Tests of VerifyEncodedBlock (codec/block_verify.h): every accepted format passes, every wrong
// field gets its own named INVALID_ARGUMENT, and no byte string crashes it or the decoder.
#include "codec/block_verify.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/crc32c.h"
#include "codec/predictor_state.h"
#include "codec/testing_blocks.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

EncodeOptions Fast(Encoding e) {
  EncodeOptions o;
  o.encoding = e;
  o.profile = Profile::kFast;
  o.target_rel_rms = 0.1;
  return o;
}

std::string Encode(const RealBlocks& r, size_t b, const EncodeOptions& o,
                   const PredictionContext& ctx = {}) {
  absl::StatusOr<EncodedBlock> e = EncodeBlock(r.geometry, r.blocks[b], o, ctx);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? e->bytes : std::string();
}

// The block with its params and payload replaced, in a valid envelope (a correct CRC).
std::string Rewrap(absl::string_view encoded, absl::string_view params, absl::string_view payload,
                   uint64_t reference_node_id = 0) {
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded);
  EXPECT_TRUE(h.ok()) << h.status();
  return internal::WriteEnvelope(h->encoding, h->geometry, reference_node_id, params, payload,
                                 h->profile, h->predictor_version);
}

std::string Payload(absl::string_view encoded) { return std::string(ParseBlock(encoded)->payload); }
std::string Params(absl::string_view encoded) { return std::string(ParseBlock(encoded)->params); }

// Fails unless `encoded` is rejected with INVALID_ARGUMENT whose message contains `want`.
void ExpectRejected(const BlockGeometry& g, absl::string_view encoded, absl::string_view want) {
  absl::StatusOr<BlockHeader> h = VerifyEncodedBlock(g, encoded);
  ASSERT_FALSE(h.ok()) << "accepted; wanted " << want;
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
  EXPECT_NE(h.status().message().find(want), absl::string_view::npos) << h.status();
}

class BlockVerifyTest : public ::testing::Test {
 protected:
  void SetUp() override { r_ = LoadRealBlocks("genesis_1-3"); }
  RealBlocks r_;
};

TEST_F(BlockVerifyTest, AcceptsRawFastLosslessAndFastResidual) {
  for (Encoding e : {Encoding::kRaw, Encoding::kLossless, Encoding::kResidual}) {
    const std::string bytes = Encode(r_, 3, Fast(e));
    absl::StatusOr<BlockHeader> h = VerifyEncodedBlock(r_.geometry, bytes);
    ASSERT_TRUE(h.ok()) << EncodingName(e) << ": " << h.status();
    EXPECT_EQ(h->encoding, e);
    EXPECT_EQ(h->predictor_version, 0u);
  }
}

TEST_F(BlockVerifyTest, AcceptsABlockCodedAgainstALearnedStateAndReturnsItsVersion) {
  const TokenBlocks d = LoadTokenBlocks("GPL-3");
  auto learner = PredictorLearner::Create(d.real.geometry, {});
  ASSERT_TRUE(learner.ok());
  for (size_t b = 0; b < d.real.blocks.size(); ++b) {
    ASSERT_TRUE((*learner)
                    ->Observe(d.real.blocks[b], d.tokens[b], static_cast<uint32_t>(b * 16),
                              b ? d.tokens[b - 1].back() : -1)
                    .ok());
  }
  absl::StatusOr<std::shared_ptr<const PredictorState>> state = (*learner)->Fit(7);
  ASSERT_TRUE(state.ok()) << state.status();
  PredictionContext ctx;
  ctx.learned = state->get();
  ctx.tokens = d.tokens[2];
  ctx.first_position = 32;
  ctx.previous_token = d.tokens[1].back();
  const std::string bytes = Encode(d.real, 2, Fast(Encoding::kResidual), ctx);
  absl::StatusOr<BlockHeader> h = VerifyEncodedBlock(d.real.geometry, bytes, state->get());
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->predictor_version, 7u);
  // The same params in a block that names no version: a learned head with no state.
  absl::StatusOr<BlockHeader> parsed = ParseBlock(bytes);
  const std::string unnamed =
      internal::WriteEnvelope(Encoding::kResidual, d.real.geometry, 0, parsed->params,
                              parsed->payload, Profile::kFast, /*predictor_version=*/0);
  ExpectRejected(d.real.geometry, unnamed, "names no predictor_version");
}

TEST_F(BlockVerifyTest, EachWrongEnvelopeFieldIsNamed) {
  const BlockGeometry& g = r_.geometry;
  const std::string good = Encode(r_, 1, Fast(Encoding::kResidual));
  std::string crc = good;
  crc[crc.size() / 2] ^= 1;
  ExpectRejected(g, crc, "CRC-32C mismatch");
  std::string magic = good;
  magic[0] = 'X';
  ExpectRejected(g, magic, "bad magic");
  BlockGeometry other = g;
  other.head_dim = g.head_dim * 2;
  ExpectRejected(other, good, "head_dim: the block has 8, the model 16");
  other = g;
  other.num_layers = g.num_layers + 1;
  ExpectRejected(other, good, "num_layers:");
  other = g;
  other.block_tokens = 32;
  ExpectRejected(other, good, "block_tokens:");
  other = g;
  other.dtype = DType::kBf16;
  ExpectRejected(other, good, "dtype: the block is fp16, the model bf16");
  ExpectRejected(g,
                 Encode(r_, 1,
                        [] {
                          EncodeOptions o = Fast(Encoding::kInt8);
                          o.profile = Profile::kCompact;
                          return o;
                        }()),
                 "encoding: int8 is not accepted");
  EncodeOptions compact = Fast(Encoding::kResidual);
  compact.profile = Profile::kCompact;
  ExpectRejected(g, Encode(r_, 1, compact), "of the compact profile is not accepted");
  compact.encoding = Encoding::kLossless;
  ExpectRejected(g, Encode(r_, 1, compact), "of the compact profile is not accepted");
  ExpectRejected(g, Rewrap(good, Params(good), Payload(good), /*reference_node_id=*/42),
                 "reference_node_id: 42, must be 0");
}

TEST_F(BlockVerifyTest, AWrongFormatVersionIsNamed) {
  // Version 2 behind a matching CRC, so the version check is what fails.
  std::string body = Encode(r_, 1, Fast(Encoding::kRaw));
  body.resize(body.size() - 4);
  body[4] = 2;
  const uint32_t crc = Crc32c(body);
  body.append(reinterpret_cast<const char*>(&crc), 4);
  ExpectRejected(r_.geometry, body, "unsupported format_version 2");
}

TEST_F(BlockVerifyTest, EachWrongPayloadBoundIsNamed) {
  const BlockGeometry& g = r_.geometry;
  const std::string raw = Encode(r_, 1, Fast(Encoding::kRaw));
  ExpectRejected(g, Rewrap(raw, "", Payload(raw).substr(1)), "bytes of RAW, the block needs");
  const std::string fl = Encode(r_, 1, Fast(Encoding::kLossless));
  std::string p = Payload(fl);
  const uint32_t huge = 0xFFFFFFF0u;
  std::memcpy(p.data(), &huge, 4);
  ExpectRejected(g, Rewrap(fl, Params(fl), p), "zstd frame (4294967280 bytes) runs past");
  ExpectRejected(g, Rewrap(fl, Params(fl), Payload(fl).substr(0, Payload(fl).size() - 1)),
                 "bytes of low byte planes");
  ExpectRejected(g, Rewrap(fl, "\x06", Payload(fl)), "not the fast LOSSLESS params");
  // The learned mode (codec/fast_lossless_learned.h) needs the envelope to name a state.
  ExpectRejected(g, Rewrap(fl, "\x05", Payload(fl)), "names no state version");

  const std::string fr = Encode(r_, 1, Fast(Encoding::kResidual));
  const std::string pay = Payload(fr);
  // A segment size that overflows the payload.
  p = pay;
  std::memcpy(p.data(), &huge, 4);
  ExpectRejected(g, Rewrap(fr, Params(fr), p),
                 "segment 0 (4294967280 bytes) runs past the payload");
  // A truncated lane: segment 0 says it holds lanes / 2 lane states and a half.
  const std::string fp = Params(fr);
  const int lanes = static_cast<uint8_t>(fp[2]);
  ASSERT_GE(lanes, 2);
  const uint32_t cut = 4 * (lanes / 2) + 2;
  std::memcpy(p.data(), &cut, 4);
  ExpectRejected(g, Rewrap(fr, Params(fr), p),
                 absl::StrCat("segment 0 lane ", lanes / 2, " runs past the segment"));
  // The payload cut anywhere, and the params cut anywhere: always a named error.
  for (size_t n = 0; n < pay.size(); n += 7) {
    EXPECT_FALSE(VerifyEncodedBlock(g, Rewrap(fr, Params(fr), pay.substr(0, n))).ok()) << n;
  }
  const std::string params = Params(fr);
  for (size_t n = 0; n < params.size(); ++n) {
    EXPECT_FALSE(VerifyEncodedBlock(g, Rewrap(fr, params.substr(0, n), pay)).ok()) << n;
  }
  // A lane state below 2^16.
  p = pay;
  ASSERT_EQ(fp[1] & 2, 0) << "no zero planes without a learned state";
  const size_t per_segment = static_cast<uint8_t>(fp[4]) | (static_cast<uint8_t>(fp[5]) << 8);
  const size_t segments = (2 * g.num_layers + per_segment - 1) / per_segment;
  std::memset(p.data() + 4 * segments + 4 * (lanes - 1), 0, 4);
  ExpectRejected(g, Rewrap(fr, Params(fr), p),
                 absl::StrCat("segment 0 lane ", lanes - 1, " starts below 2^16"));
  // Bucket bits missing at the end.
  ExpectRejected(g, Rewrap(fr, Params(fr), pay + "x"), "bytes of bucket bits");
}

TEST_F(BlockVerifyTest, NoFlippedByteCrashesTheVerifierOrTheDecoder) {
  const BlockGeometry& g = r_.geometry;
  std::vector<uint8_t> out(g.num_bytes());
  for (Encoding e : {Encoding::kRaw, Encoding::kLossless, Encoding::kResidual}) {
    const std::string good = Encode(r_, 2, Fast(e));
    const std::string params = Params(good), payload = Payload(good);
    for (size_t i = 0; i < params.size() + payload.size(); i += 3) {
      std::string pa = params, py = payload;
      char& c = i < pa.size() ? pa[i] : py[i - pa.size()];
      c = static_cast<char>(c ^ 0x5a);
      const std::string bad = Rewrap(good, pa, py);
      if (VerifyEncodedBlock(g, bad).ok()) (void)DecodeBlock(bad, absl::MakeSpan(out));
    }
  }
}

}  // namespace
}  // namespace kvtrie
