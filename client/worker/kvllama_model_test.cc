// The head_dim-64 model trained here (issue 29, tests/data/kvllama3M, tools/train): the worker
// loads its GGUF unchanged and reproduces PyTorch's per-token surprisal of a held-out text and the
// KV dumps vendored beside it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "client/worker/llama_model.h"
#include "client/worker/worker_ops.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"

namespace kvtrie::worker {
namespace {

const std::string& Dir() {
  static const std::string* dir = new std::string(std::string(KVTRIE_TESTDATA_DIR) + "/kvllama3M");
  return *dir;
}

const LlamaModel& Model() {
  static const LlamaModel* model = [] {
    absl::StatusOr<std::unique_ptr<LlamaModel>> m = LlamaModel::Load(Dir() + "/kvllama3M.gguf");
    if (!m.ok()) {
      std::fprintf(stderr, "loading kvllama3M: %s\n", m.status().ToString().c_str());
      std::abort();
    }
    return m->release();
  }();
  return *model;
}

TEST(KvLlama3M, ReadsTheLlamaGeometryFromGguf) {
  const LlamaConfig& c = Model().config();
  EXPECT_EQ(c.dim, 256u);
  EXPECT_EQ(c.num_layers, 4u);
  EXPECT_EQ(c.num_heads, 4u);
  EXPECT_EQ(c.num_kv_heads, 1u);
  EXPECT_EQ(c.head_dim(), 64u);
  EXPECT_EQ(c.hidden_dim, 512u);
  EXPECT_EQ(c.vocab_size, 4096u);
  EXPECT_EQ(c.context_length, 1024u);
  EXPECT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(Model().model_id(), "kvllama3M");
}

// tools/train/verify_worker.py wrote PyTorch's surprisal (model.py in float32 on the GGUF's
// weights); the worker sums in another order, so the two agree to ~1e-5 bits, not bit for bit.
TEST(KvLlama3M, ReproducesPyTorchSurprisalOfAHeldOutText) {
  absl::StatusOr<std::string> text = ReadTextFile(Dir() + "/zephaniah.txt");
  ASSERT_TRUE(text.ok()) << text.status();
  std::ifstream ref_file(Dir() + "/zephaniah_pytorch_surprisal.txt");
  std::vector<double> ref;
  for (double x; ref_file >> x;) ref.push_back(x);
  ASSERT_EQ(ref.size(), 512u);

  absl::StatusOr<KvDump> got = DumpText(Model(), *text, 512, 3000);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->surprisal_bits.size(), ref.size());
  double max_diff = 0, sum = 0;
  for (size_t i = 1; i < ref.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(got->surprisal_bits[i] - ref[i]));
    sum += got->surprisal_bits[i];
  }
  EXPECT_LT(max_diff, 1e-3) << "worst per-token difference from PyTorch, bits";
  // A trained model, not noise: far below the 12 bits of a uniform guess over 4096 tokens.
  EXPECT_LT(sum / static_cast<double>(ref.size() - 1), 9.5);
}

// The vendored dumps are this model's: same tokens, K and V within fp16 rounding, same surprisal.
TEST(KvLlama3M, DumpsReproduceTheVendoredDumps) {
  for (const auto& [name, text_path] : std::vector<std::pair<std::string, std::string>>{
           {"zephaniah", Dir() + "/zephaniah.txt"},
           {"genesis_1-3", std::string(KVTRIE_TESTDATA_DIR) + "/texts/genesis_1-3.txt"}}) {
    SCOPED_TRACE(name);
    absl::StatusOr<std::string> text = ReadTextFile(text_path);
    ASSERT_TRUE(text.ok()) << text.status();
    absl::StatusOr<KvDump> ref = ReadKvDump(Dir() + "/" + name);
    ASSERT_TRUE(ref.ok()) << ref.status();
    absl::StatusOr<KvDump> got = DumpText(Model(), *text, 512, 3000);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->token_ids, ref->token_ids);
    ASSERT_EQ(ref->head_dim, 64u);
    ASSERT_EQ(got->k.size(), ref->k.size());
    const size_t n = got->k.size() / 2;
    std::vector<float> gk(n), rk(n), gv(n), rv(n);
    ToFloat(DType::kFp16, got->k.data(), n, gk.data());
    ToFloat(DType::kFp16, ref->k.data(), n, rk.data());
    ToFloat(DType::kFp16, got->v.data(), n, gv.data());
    ToFloat(DType::kFp16, ref->v.data(), n, rv.data());
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      // The same program on the same machine type: equal up to one fp16 step.
      const float ulp_k = std::ldexp(1.0f, std::ilogb(std::max(std::fabs(rk[i]), 1e-4f)) - 10);
      const float ulp_v = std::ldexp(1.0f, std::ilogb(std::max(std::fabs(rv[i]), 1e-4f)) - 10);
      bad += std::fabs(gk[i] - rk[i]) > ulp_k || std::fabs(gv[i] - rv[i]) > ulp_v;
    }
    EXPECT_EQ(bad, 0u);
    for (size_t i = 1; i < ref->surprisal_bits.size(); ++i) {
      ASSERT_NEAR(got->surprisal_bits[i], ref->surprisal_bits[i], 1e-3) << "token " << i;
    }
  }
}

}  // namespace
}  // namespace kvtrie::worker
