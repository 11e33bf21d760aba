// Tests of the block envelope (codec/envelope.h): what WriteEnvelope and AddEnvelopeChecks write
// ParseBlock reads back field by field, PeekPredictorVersion names the state of a block the codec
// really coded against one, and every truncated or damaged envelope is DATA_LOSS.
#include "codec/envelope.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/predictor_state.h"
#include "codec/testing_blocks.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

const BlockGeometry kGeometry{2, 2, 16, 8, DType::kFp16};

TEST(Envelope, WriteThenParseGivesBackEveryField) {
  const std::string params = "\x01\x02params", payload(40, 'p');
  const std::string bytes =
      internal::WriteEnvelope(Encoding::kResidual, kGeometry, 42, params, payload,
                              Profile::kCompact, /*predictor_version=*/7);
  for (const bool verified : {false, true}) {
    absl::StatusOr<BlockHeader> h = verified ? ParseVerifiedBlock(bytes) : ParseBlock(bytes);
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(h->format_version, 1u);
    EXPECT_EQ(h->encoding, Encoding::kResidual);
    EXPECT_EQ(h->profile, Profile::kCompact);
    EXPECT_EQ(h->geometry, kGeometry);
    EXPECT_EQ(h->reference_node_id, 42u);
    EXPECT_EQ(h->predictor_version, 7u);
    EXPECT_EQ(h->predictor_fingerprint, 0u);
    EXPECT_FALSE(h->has_content_checksum);
    EXPECT_FALSE(h->reference_shift.enabled);
    EXPECT_EQ(h->params, params);
    EXPECT_EQ(h->payload, payload);
    // Views into the encoded bytes, not copies.
    EXPECT_GE(h->payload.data(), bytes.data());
    EXPECT_LE(h->payload.data() + h->payload.size(), bytes.data() + bytes.size());
  }
  // Fixed header + version + two lengths + params + payload + CRC-32C.
  EXPECT_EQ(bytes.size(), 24u + 4 + 4 + params.size() + 4 + payload.size() + 4);
}

TEST(Envelope, FastProfileAndShiftedReferenceRoundTrip) {
  const std::string fast = internal::WriteEnvelope(Encoding::kLossless, kGeometry, 0, "\x04",
                                                   "zstd frame", Profile::kFast);
  absl::StatusOr<BlockHeader> h = ParseBlock(fast);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->profile, Profile::kFast);
  EXPECT_EQ(h->encoding, Encoding::kLossless);
  EXPECT_EQ(h->predictor_version, 0u);
  EXPECT_EQ(h->params, "\x04");

  ReferenceShift shift{.enabled = true,
                       .token_shift = 3,
                       .rotation = -5,
                       .log_rope_base = kLogRopeBase10000,
                       .reference_parent_node_id = 99};
  ASSERT_TRUE(internal::CheckReferenceShift(kGeometry, shift).ok());
  const std::string shifted = internal::WriteEnvelope(Encoding::kLossless, kGeometry, 12, "\x03",
                                                      "diff", Profile::kCompact, 0, &shift);
  h = ParseBlock(shifted);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(h->reference_shift.enabled);
  EXPECT_EQ(h->reference_shift.token_shift, 3u);
  EXPECT_EQ(h->reference_shift.rotation, -5);
  EXPECT_EQ(h->reference_shift.log_rope_base, kLogRopeBase10000);
  EXPECT_EQ(h->reference_shift.reference_parent_node_id, 99u);
  EXPECT_EQ(h->reference_node_id, 12u);
  EXPECT_EQ(h->params, "\x03");  // the shift's prefix is taken off
  EXPECT_EQ(h->payload, "diff");
}

TEST(Envelope, AddedChecksKeepEveryFieldAndAddTheirOwn) {
  const std::string plain = internal::WriteEnvelope(Encoding::kResidual, kGeometry, 0, "pp",
                                                    "payload", Profile::kFast, 5);
  const uint64_t checksum = 0x0123456789abcdefull;
  const std::string checked =
      internal::AddEnvelopeChecks(plain, /*fingerprint=*/0xfeedull, &checksum);
  EXPECT_EQ(checked.size(), plain.size() + 16);
  absl::StatusOr<BlockHeader> h = ParseBlock(checked);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->predictor_version, 5u);
  EXPECT_EQ(h->predictor_fingerprint, 0xfeedull);
  EXPECT_TRUE(h->has_content_checksum);
  EXPECT_EQ(h->content_checksum, checksum);
  EXPECT_EQ(h->params, "pp");
  EXPECT_EQ(h->payload, "payload");
  // The version stays at offset 24 whatever follows it.
  EXPECT_EQ(PeekPredictorVersion(checked), 5u);

  // A block that names no version gets no fingerprint, only the checksum.
  const std::string unnamed =
      internal::WriteEnvelope(Encoding::kRaw, kGeometry, 0, "", std::string(16, 'r'));
  const std::string unnamed_checked = internal::AddEnvelopeChecks(unnamed, 0xfeedull, &checksum);
  EXPECT_EQ(unnamed_checked.size(), unnamed.size() + 8);
  h = ParseBlock(unnamed_checked);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->predictor_fingerprint, 0u);
  EXPECT_TRUE(h->has_content_checksum);
  EXPECT_EQ(PeekPredictorVersion(unnamed_checked), 0u);
}

TEST(Envelope, PeekPredictorVersionNamesTheStateOfARealBlock) {
  const TokenBlocks gpl = LoadTokenBlocks("GPL-3");
  const auto state = LearnState({&gpl}, 3);
  ASSERT_NE(state, nullptr);
  ASSERT_GE(gpl.real.blocks.size(), 3u);
  const BlockGeometry& g = gpl.real.geometry;
  EncodeOptions o;
  o.encoding = Encoding::kResidual;
  o.profile = Profile::kFast;
  o.target_rel_rms = 0.1;
  const size_t b = 2;
  PredictionContext ctx;
  ctx.learned = state.get();
  ctx.tokens = gpl.tokens[b];
  ctx.first_position = static_cast<uint32_t>(b * g.block_tokens);
  ctx.previous_token = gpl.tokens[b - 1].back();
  absl::StatusOr<EncodedBlock> e = EncodeBlock(g, gpl.real.blocks[b], o, ctx);
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_EQ(e->predictor_version, 3u) << "the learned state was not used";
  absl::StatusOr<BlockHeader> h = ParseBlock(e->bytes);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->predictor_version, 3u);
  EXPECT_EQ(h->predictor_fingerprint, state->fingerprint());
  EXPECT_TRUE(h->has_content_checksum);
  EXPECT_EQ(PeekPredictorVersion(e->bytes), 3u);

  // The same block without the state names none.
  absl::StatusOr<EncodedBlock> plain = EncodeBlock(g, gpl.real.blocks[b], o);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(PeekPredictorVersion(plain->bytes), 0u);
  EXPECT_EQ(PeekPredictorVersion(""), 0u);
}

TEST(Envelope, EveryTruncationIsDataLoss) {
  const uint64_t checksum = 17;
  const std::string full = internal::AddEnvelopeChecks(
      internal::WriteEnvelope(Encoding::kResidual, kGeometry, 0, "params", "payload bytes",
                              Profile::kFast, 9),
      0xabcull, &checksum);
  ASSERT_TRUE(ParseBlock(full).ok());
  for (size_t n = 0; n < full.size(); ++n) {
    const std::string cut = full.substr(0, n);
    for (const bool verified : {false, true}) {
      absl::StatusOr<BlockHeader> h = verified ? ParseVerifiedBlock(cut) : ParseBlock(cut);
      EXPECT_TRUE(absl::IsDataLoss(h.status()))
          << n << " bytes, verified " << verified << ": " << h.status();
    }
    // Peek reads only the version, and only when all of it is there.
    EXPECT_EQ(PeekPredictorVersion(cut), n >= 28 ? 9u : 0u) << n << " bytes";
  }
}

TEST(Envelope, DamagedEnvelopesAreDataLossNamingWhat) {
  const std::string good =
      internal::WriteEnvelope(Encoding::kRaw, kGeometry, 0, "", std::string(16, 'r'));
  ASSERT_TRUE(ParseBlock(good).ok());
  struct Case {
    size_t at;
    char value;
    const char* message;  // a substring of the error
  };
  const Case cases[] = {
      {0, 'X', "bad magic"},      {4, 2, "format_version"},
      {5, 9, "unknown encoding"}, {6, static_cast<char>(0xc8), "unknown dtype"},
      {7, 0x40, "unknown flags"},
  };
  for (const Case& c : cases) {
    std::string bad = good;
    bad[c.at] = c.value;
    absl::StatusOr<BlockHeader> h = ParseBlock(bad);
    EXPECT_TRUE(absl::IsDataLoss(h.status())) << c.at << ": " << h.status();
    if (c.at == 0) {
      EXPECT_NE(h.status().message().find(c.message), absl::string_view::npos) << h.status();
    }
    // The CRC-32C is checked first; without it the field's own check answers.
    h = ParseVerifiedBlock(bad);
    EXPECT_TRUE(absl::IsDataLoss(h.status())) << c.at << ": " << h.status();
    EXPECT_NE(h.status().message().find(c.message), absl::string_view::npos)
        << c.at << ": " << h.status();
  }
  std::string flipped = good;
  flipped[40] ^= 1;  // a payload byte: only the CRC-32C can tell
  absl::StatusOr<BlockHeader> h = ParseBlock(flipped);
  EXPECT_TRUE(absl::IsDataLoss(h.status()));
  EXPECT_NE(h.status().message().find("CRC-32C mismatch"), absl::string_view::npos) << h.status();
  EXPECT_TRUE(ParseVerifiedBlock(flipped).ok());  // verified bytes skip the CRC-32C pass
}

}  // namespace
}  // namespace kvtrie
