// End to end: kvtrie-worker's `run` against a real kvtrie-server process (issue 6).
//
// Starts kvtrie-server on a free loopback port with a temporary --data_dir, runs two prompts
// that share a prefix through RunWithCache, and checks that the second reuses the stored prefix
// (counts asserted) and produces exactly what running without the cache produces when the
// encoding is lossless. Also drives the kvtrie-worker binary once. Skips without the model.
#include <string>
#include <vector>

#include "client/client.h"
#include "client/worker/cached_inference.h"
#include "client/worker/test_model.h"
#include "gtest/gtest.h"
#include "tests/server_process.h"

namespace kvtrie::worker {
namespace {

constexpr char kShared[] =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big red ball under a tree.";
const std::string kPromptA = std::string(kShared) + " She ran to get it and laughed.";
const std::string kPromptB =
    std::string(kShared) + " Her mom said it was time to go home, so they walked back together.";

size_t CommonPrefix(const std::vector<uint32_t>& a, const std::vector<uint32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

TEST(WorkerRun, SecondPromptReusesSharedPrefixAndMatchesUncachedRun) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  absl::StatusOr<std::unique_ptr<kvtrie::testing::ServerProcess>> server =
      kvtrie::testing::ServerProcess::Start(kvtrie::testing::FreshDir("worker_run"));
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions co;
  co.target = (*server)->target();
  co.ns = "worker-run-test";
  std::unique_ptr<Client> client = Client::Create(co);
  RunOptions options;
  options.steps = 24;
  options.put.encoding = v1::ENCODING_LOSSLESS;

  absl::StatusOr<RunResult> a = RunWithCache(*model, *client, kPromptA, options);
  ASSERT_TRUE(a.ok()) << a.status();
  const size_t na = a->prompt_tokens.size();
  EXPECT_EQ(a->reused_tokens, 0u);
  EXPECT_EQ(a->computed_tokens, na);
  EXPECT_EQ(a->logits_only_passes, 0u);
  EXPECT_EQ(a->stored_blocks, na / 16);

  absl::StatusOr<RunResult> b = RunWithCache(*model, *client, kPromptB, options);
  ASSERT_TRUE(b.ok()) << b.status();
  const size_t nb = b->prompt_tokens.size();
  const size_t shared = CommonPrefix(a->prompt_tokens, b->prompt_tokens);
  const size_t expect_reused = std::min(shared / 16, na / 16) * 16;
  ASSERT_GE(expect_reused, 32u) << "test prompts must share at least two blocks";
  EXPECT_EQ(b->reused_tokens, expect_reused);
  EXPECT_EQ(b->computed_tokens, nb - expect_reused);
  EXPECT_EQ(b->logits_only_passes, 1u);
  EXPECT_EQ(b->stored_blocks, nb / 16 - expect_reused / 16);

  absl::StatusOr<RunResult> uncached = RunWithoutCache(*model, kPromptB, options);
  ASSERT_TRUE(uncached.ok()) << uncached.status();
  EXPECT_EQ(b->generated, uncached->generated);
  EXPECT_EQ(b->text, uncached->text);
  ASSERT_EQ(b->prompt_surprisal_bits.size(), nb);
  for (size_t i = expect_reused; i < nb; ++i) {
    EXPECT_EQ(b->prompt_surprisal_bits[i], uncached->prompt_surprisal_bits[i]) << "token " << i;
  }

  // A third run of B reuses everything stored (all full blocks) and stores nothing new.
  absl::StatusOr<RunResult> again = RunWithCache(*model, *client, kPromptB, options);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->reused_tokens, nb / 16 * 16);
  EXPECT_EQ(again->stored_blocks, 0u);
  EXPECT_EQ(again->text, uncached->text);
}

TEST(WorkerRun, CommandLinePrintsReusedTokens) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  absl::StatusOr<std::unique_ptr<kvtrie::testing::ServerProcess>> server =
      kvtrie::testing::ServerProcess::Start(kvtrie::testing::FreshDir("worker_cli"));
  ASSERT_TRUE(server.ok()) << server.status();
  auto run = [&](const std::string& prompt) {
    std::string out, err;
    const int rc = kvtrie::testing::RunCommand(
        {kvtrie::testing::BinaryPath("client/worker/kvtrie-worker"), "run",
         "--model=" + testing::TestModelPath(), "--target=" + (*server)->target(), "--steps=8",
         "--prompt=" + prompt},
        &out, &err);
    EXPECT_EQ(rc, 0) << out << err;
    return out;
  };
  const std::string first = run(kPromptA);
  EXPECT_NE(first.find("reused 0 from kvtrie"), std::string::npos) << first;
  const std::vector<uint32_t> ta = model->tokenizer().Encode(kPromptA, true, false);
  const std::vector<uint32_t> tb = model->tokenizer().Encode(kPromptB, true, false);
  const size_t reused = std::min(CommonPrefix(ta, tb) / 16, ta.size() / 16) * 16;
  const std::string second = run(kPromptB);
  EXPECT_NE(second.find("reused " + std::to_string(reused) + " from kvtrie"), std::string::npos)
      << second;
}

}  // namespace
}  // namespace kvtrie::worker
