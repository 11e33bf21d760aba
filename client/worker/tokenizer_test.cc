#include "client/worker/tokenizer.h"

#include <string>
#include <vector>

#include "client/worker/gguf.h"
#include "client/worker/test_model.h"
#include "gtest/gtest.h"

namespace kvtrie::worker {
namespace {

// A tiny vocabulary: <unk> <s> </s>, the 256 byte tokens, then pieces with merge scores.
Tokenizer TinyTokenizer() {
  std::vector<std::string> pieces = {"<unk>", "<s>", "</s>"};
  std::vector<float> scores = {0, 0, 0};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    pieces.push_back(buf);
    scores.push_back(0);
  }
  for (const auto& [p, s] : std::vector<std::pair<std::string, float>>{{" ", -1},
                                                                       {"a", -1},
                                                                       {"b", -1},
                                                                       {"c", -1},
                                                                       {"ab", -3},
                                                                       {"bc", -2},
                                                                       {" a", -5},
                                                                       {"abc", -4},
                                                                       {"\xC3\xA9", -1}}) {
    pieces.push_back(p);
    scores.push_back(s);
  }
  return Tokenizer(pieces, scores, 1, 2);
}

uint32_t Id(const Tokenizer& t, const std::string& piece) {
  for (uint32_t i = 0; i < t.vocab_size(); ++i) {
    if (t.piece(i) == piece) return i;
  }
  return UINT32_MAX;
}

TEST(Tokenizer, EmptyTextIsJustBos) {
  Tokenizer t = TinyTokenizer();
  EXPECT_EQ(t.Encode("", true, false), std::vector<uint32_t>{1});
  EXPECT_EQ(t.Encode("", true, true), (std::vector<uint32_t>{1, 2}));
}

TEST(Tokenizer, MergesHighestScoringPairFirst) {
  Tokenizer t = TinyTokenizer();
  // " abc": " " a b c -> bc (-2) wins over ab (-3): " " a bc -> "a"+"bc" is "abc" (-4) vs
  // " a" (-5): abc. Result: BOS, " ", "abc".
  EXPECT_EQ(t.Encode("abc", true, false), (std::vector<uint32_t>{1, Id(t, " "), Id(t, "abc")}));
}

TEST(Tokenizer, UnknownBytesFallBackToByteTokens) {
  Tokenizer t = TinyTokenizer();
  // "é" is in the vocabulary as one code point; "ü" (C3 BC) is not: two byte tokens.
  EXPECT_EQ(t.Encode("\xC3\xA9\xC3\xBC", false, false),
            (std::vector<uint32_t>{Id(t, " "), Id(t, "\xC3\xA9"), 0xC3 + 3, 0xBC + 3}));
  EXPECT_EQ(t.DecodeAll(t.Encode("\xC3\xA9\xC3\xBCz\n", true, false)), "\xC3\xA9\xC3\xBCz\n");
}

TEST(Tokenizer, DecodeDropsLeadingSpaceAfterBos) {
  Tokenizer t = TinyTokenizer();
  EXPECT_EQ(t.Decode(1, Id(t, " a")), "a");
  EXPECT_EQ(t.Decode(Id(t, "b"), Id(t, " a")), " a");
  EXPECT_EQ(t.Decode(5, '\n' + 3), "\n");
}

TEST(Tokenizer, Stories260KVocabularyReadsSentencePieceSpaces) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  const Tokenizer& t = model->tokenizer();
  EXPECT_EQ(t.vocab_size(), 512u);
  EXPECT_EQ(t.piece(265), " the");
  EXPECT_EQ(t.piece(3), "<0x00>");
  EXPECT_EQ(t.bos_id(), 1u);
  EXPECT_EQ(t.eos_id(), 2u);
  const std::vector<uint32_t> ids = t.Encode("In the beginning", true, false);
  EXPECT_EQ(ids, (std::vector<uint32_t>{1, 359, 416, 265, 329, 428, 271, 416, 299}));
  EXPECT_EQ(t.DecodeAll(ids), "In the beginning");
}

TEST(Gguf, RejectsBadMagicAndUnsupportedVersion) {
  EXPECT_EQ(GgufFile::Parse("GGML", "x").status().code(), absl::StatusCode::kInvalidArgument);
  std::string v1("GGUF\x01\0\0\0", 8);
  absl::Status s = GgufFile::Parse(v1, "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("version 1"), absl::string_view::npos) << s;
  std::string truncated("GGUF\x03\0\0\0\x01\0\0", 11);
  EXPECT_EQ(GgufFile::Parse(truncated, "x").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Gguf, ReadsStories260KMetadataAndTensors) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  absl::StatusOr<GgufFile> f = GgufFile::Open(testing::TestModelPath());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(*f->GetString("general.architecture"), "llama");
  EXPECT_EQ(*f->GetUint("llama.block_count"), 5u);
  const GgufTensorInfo* k = f->FindTensor("blk.0.attn_k.weight");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->ne, (std::vector<uint64_t>{64, 32}));
  EXPECT_EQ(f->GetUint("no.such.key").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(f->GetUint("general.architecture").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtrie::worker
