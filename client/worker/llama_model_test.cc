#include "client/worker/llama_model.h"

#include <cmath>
#include <string>

#include "client/worker/test_model.h"
#include "client/worker/worker_ops.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"

namespace kvtrie::worker {
namespace {

// |a - b| within a couple of fp16 rounding steps at the larger magnitude (our fp32 and the
// reference's differ in summation order, so an fp16 value may round to a neighbour), plus 1e-5
// absolute for values near zero that come out of cancellation (K/V here are O(0.1..10)).
bool WithinFp16Rounding(float a, float b) {
  const float mag = std::max(std::fabs(a), std::fabs(b));
  const float ulp = mag < 6.1e-5f ? 6e-8f : std::ldexp(1.0f, std::ilogb(mag) - 10);
  return std::fabs(a - b) <= 2 * ulp + 1e-5f;
}

TEST(LlamaModel, ReadsStories260KGeometryFromGguf) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  const LlamaConfig& c = model->config();
  EXPECT_EQ(c.dim, 64u);
  EXPECT_EQ(c.hidden_dim, 172u);
  EXPECT_EQ(c.num_layers, 5u);
  EXPECT_EQ(c.num_heads, 8u);
  EXPECT_EQ(c.num_kv_heads, 4u);
  EXPECT_EQ(c.head_dim(), 8u);
  EXPECT_EQ(c.vocab_size, 512u);
  EXPECT_NEAR(c.rms_norm_eps, 1e-5f, 1e-9f);
  EXPECT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(model->model_id(), "stories260K");
}

TEST(LlamaModel, GreedyFromBosTellsTheKnownStory) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  absl::StatusOr<Generation> g = GenerateGreedy(*model, "", 40);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->text.rfind("Once upon a time, there was a little girl named Lily. She loved to "
                          "play outside in the park.",
                          0),
            0u)
      << g->text;
}

TEST(LlamaModel, DumpOfGenesisReproducesTheReferenceDump) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  absl::StatusOr<std::string> text =
      ReadTextFile(std::string(KVTRIE_TESTDATA_DIR) + "/texts/genesis_1-3.txt");
  ASSERT_TRUE(text.ok()) << text.status();
  absl::StatusOr<KvDump> ref = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/genesis_1-3");
  ASSERT_TRUE(ref.ok()) << ref.status();
  absl::StatusOr<KvDump> got = DumpText(*model, *text, 512, 3000);
  ASSERT_TRUE(got.ok()) << got.status();

  ASSERT_EQ(got->token_ids, ref->token_ids);
  ASSERT_EQ(got->num_layers, ref->num_layers);
  ASSERT_EQ(got->num_kv_heads, ref->num_kv_heads);
  ASSERT_EQ(got->head_dim, ref->head_dim);
  ASSERT_EQ(got->dtype, DType::kFp16);
  ASSERT_EQ(ref->dtype, DType::kFp16);
  ASSERT_EQ(got->k.size(), ref->k.size());
  ASSERT_EQ(got->v.size(), ref->v.size());
  const size_t n = got->k.size() / 2;
  std::vector<float> gk(n), rk(n), gv(n), rv(n);
  ToFloat(DType::kFp16, got->k.data(), n, gk.data());
  ToFloat(DType::kFp16, ref->k.data(), n, rk.data());
  ToFloat(DType::kFp16, got->v.data(), n, gv.data());
  ToFloat(DType::kFp16, ref->v.data(), n, rv.data());
  size_t bad_k = 0, bad_v = 0, exact = 0;
  for (size_t i = 0; i < n; ++i) {
    exact += (gk[i] == rk[i]) + (gv[i] == rv[i]);
    if (!WithinFp16Rounding(gk[i], rk[i]) && bad_k++ < 5) {
      ADD_FAILURE() << "k[" << i << "] " << gk[i] << " vs reference " << rk[i];
    }
    if (!WithinFp16Rounding(gv[i], rv[i]) && bad_v++ < 5) {
      ADD_FAILURE() << "v[" << i << "] " << gv[i] << " vs reference " << rv[i];
    }
  }
  EXPECT_EQ(bad_k, 0u);
  EXPECT_EQ(bad_v, 0u);
  std::printf("genesis K/V: %zu of %zu fp16 values bit-identical to the reference\n", exact, 2 * n);
  ASSERT_EQ(got->surprisal_bits.size(), ref->surprisal_bits.size());
  for (size_t i = 1; i < got->surprisal_bits.size(); ++i) {
    ASSERT_NEAR(got->surprisal_bits[i], ref->surprisal_bits[i], 1e-3) << "token " << i;
  }
}

TEST(Sequence, ResumingFromExactPrefixKvEqualsComputingEverything) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  const std::vector<uint32_t> tokens = model->tokenizer().Encode(
      "Once upon a time, there was a big dog. The dog liked to run in the sun.", true, false);
  ASSERT_GT(tokens.size(), 20u);
  Sequence full(model, 64);
  ASSERT_TRUE(full.Extend(tokens).ok());

  const size_t cut = 16;
  Sequence resumed(model, 64);
  ASSERT_TRUE(resumed.LoadPrefix(full.ToKvDump(DType::kFp32, cut)).ok());
  ASSERT_TRUE(resumed.RecomputeLastLogits().ok());
  const std::vector<uint32_t> rest(tokens.begin() + cut, tokens.end());
  ASSERT_TRUE(resumed.Extend(rest).ok());
  EXPECT_EQ(resumed.tokens_computed(), tokens.size() - cut + 1);  // +1: logits of token cut-1
  EXPECT_EQ(resumed.tokens(), tokens);
  EXPECT_EQ(resumed.logits(), full.logits());
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ(resumed.surprisal_bits()[i], full.surprisal_bits()[i]) << i;
  }
  const KvDump a = full.ToKvDump(DType::kFp32), b = resumed.ToKvDump(DType::kFp32);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.v, b.v);
}

TEST(Sequence, Fp16KvCacheResumedFromItsFp16DumpIsBitIdentical) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  const std::vector<uint32_t> tokens = model->tokenizer().Encode(
      "The cat sat on the mat and looked at the bird in the tree for a long time.", true, false);
  Sequence full(model, 64, DType::kFp16);
  ASSERT_TRUE(full.Extend(tokens).ok());
  Sequence resumed(model, 64, DType::kFp16);
  ASSERT_TRUE(resumed.LoadPrefix(full.ToKvDump(DType::kFp16, 16)).ok());
  ASSERT_TRUE(resumed.RecomputeLastLogits().ok());
  const std::vector<uint32_t> rest(tokens.begin() + 16, tokens.end());
  ASSERT_TRUE(resumed.Extend(rest).ok());
  EXPECT_EQ(resumed.logits(), full.logits());
  EXPECT_EQ(resumed.ToKvDump(DType::kFp16).k, full.ToKvDump(DType::kFp16).k);
  EXPECT_EQ(resumed.ToKvDump(DType::kFp16).v, full.ToKvDump(DType::kFp16).v);
}

TEST(Sequence, TruncateThenExtendRunsAnotherTokenAtThatPosition) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  const std::vector<uint32_t> tokens =
      model->tokenizer().Encode("The dog ran to the park and played with a red ball.", true, false);
  ASSERT_GT(tokens.size(), 12u);
  Sequence seq(model, 64, DType::kFp16);
  ASSERT_TRUE(seq.Extend(absl::MakeConstSpan(tokens).subspan(0, 10)).ok());
  const uint32_t other = tokens[10] == 5 ? 6 : 5;
  ASSERT_TRUE(seq.Extend({other}).ok());  // a candidate at position 10
  const std::vector<float> k_other(seq.k(2, 1, 10), seq.k(2, 1, 10) + 8);
  ASSERT_TRUE(seq.Truncate(10).ok());
  EXPECT_EQ(seq.num_tokens(), 10u);
  EXPECT_TRUE(seq.logits().empty());
  ASSERT_TRUE(seq.RecomputeLastLogits().ok());
  ASSERT_TRUE(seq.Extend(absl::MakeConstSpan(tokens).subspan(10)).ok());
  Sequence full(model, 64, DType::kFp16);
  ASSERT_TRUE(full.Extend(tokens).ok());
  EXPECT_EQ(seq.ToKvDump(DType::kFp16).k, full.ToKvDump(DType::kFp16).k);
  EXPECT_EQ(seq.ToKvDump(DType::kFp16).v, full.ToKvDump(DType::kFp16).v);
  EXPECT_EQ(seq.surprisal_bits(), full.surprisal_bits());
  EXPECT_NE(k_other, std::vector<float>(full.k(2, 1, 10), full.k(2, 1, 10) + 8));
  EXPECT_EQ(seq.Truncate(100).code(), absl::StatusCode::kOutOfRange);
}

TEST(Sequence, RejectsPrefixOfAnotherGeometry) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  KvDump bad;
  bad.num_layers = 4;
  bad.num_kv_heads = 4;
  bad.head_dim = 8;
  Sequence seq(model, 16);
  absl::Status s = seq.LoadPrefix(bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("num_layers"), absl::string_view::npos) << s;
}

// FP8 / uint8 caches (issue 32 row 3) are stored by kvtrie, but the reference worker computes
// with fp16 / bf16 / fp32 KV: such a prefix is refused naming its dtype, never read as floats.
TEST(Sequence, RefusesAnFp8Prefix) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  Sequence full(model, 32, DType::kFp16);
  ASSERT_TRUE(full.Extend({1, 2, 3, 4}).ok());
  KvDump prefix = full.ToKvDump(DType::kFp16, 4);
  prefix.dtype = DType::kFp8E4m3;  // the same bytes, called fp8 (half as many would be needed)
  Sequence seq(model, 16);
  absl::Status s = seq.LoadPrefix(prefix);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("prefix: dtype fp8_e4m3"), absl::string_view::npos) << s;
}

TEST(Sequence, ExtendPastCapacityIsOutOfRange) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  Sequence seq(model, 2);
  EXPECT_EQ(seq.Extend(std::vector<uint32_t>{1, 2, 3}).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(seq.Extend(std::vector<uint32_t>{100000}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtrie::worker
