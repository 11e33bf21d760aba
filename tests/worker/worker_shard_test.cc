// End to end: the reference worker over three real kvtrie-server shards (issue 21).
//
// RunWithCache through a ShardedClient: each prompt's blocks land on its owner shard and nowhere
// else, a second run of a prompt reuses them and computes exactly what an uncached run computes,
// and after its owner is killed (SIGKILL) the prompt is a miss: recomputed in full, the same
// text, no error; prompts on the surviving shards still hit. Also drives `kvtrie-worker run
// --shards=...` once. Skips without the model.
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/sharded_client.h"
#include "client/worker/cached_inference.h"
#include "client/worker/test_model.h"
#include "gtest/gtest.h"
#include "tests/server_process.h"

namespace kvtrie::worker {
namespace {

using kvtrie::testing::ServerProcess;

// Prompts with different first blocks (so different owners), each several blocks long.
const std::vector<std::string> kPrompts = {
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big red ball under a tree and ran to get it.",
    "Tom had a small dog called Max. Every morning they went for a walk by the river and looked at "
    "the ducks. Max liked to bark at the big white birds.",
    "The sun was hot and the sky was blue. A little bird sat on a branch and sang a happy song to "
    "all the animals in the green forest near the old house.",
    "Sara wanted to bake a cake for her mom. She got the flour, the eggs and the sugar, and mixed "
    "them in a big bowl while her brother watched and smiled.",
    "There was a big truck that could not start. The man who drove it was sad, so a kind boy came "
    "to help him push it up the hill to the shop.",
    "In a small town lived an old cat named Whiskers. He liked to sleep in the sun by the window "
    "and dream about fish and milk all day long.",
};

constexpr char kNs[] = "worker-shards";

class WorkerShards : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<std::unique_ptr<ServerProcess>> s =
          ServerProcess::Start(kvtrie::testing::FreshDir(absl::StrCat("worker_shard", i)));
      ASSERT_TRUE(s.ok()) << s.status();
      servers_.push_back(std::move(*s));
    }
  }
  std::string ShardList() const {
    std::vector<std::string> parts;
    for (size_t i = 0; i < servers_.size(); ++i) {
      parts.push_back(absl::StrCat("kvtrie-", i, "=", servers_[i]->target()));
    }
    return absl::StrJoin(parts, ",");
  }
  std::unique_ptr<ShardedClient> Sharded() const {
    ShardedClientOptions o;
    o.shards = ShardList();
    o.client.ns = kNs;
    o.client.timeout = absl::Seconds(10);
    o.client.retry.max_attempts = 1;  // a lost shard is a miss at once
    o.client.retry.initial_backoff = absl::Milliseconds(50);
    o.client.retry.max_backoff = absl::Milliseconds(200);
    o.down_initial_backoff = absl::Milliseconds(200);
    o.down_max_backoff = absl::Milliseconds(400);
    absl::StatusOr<std::unique_ptr<ShardedClient>> c = ShardedClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  // Matched tokens of `tokens` on shard i alone (a plain Client).
  uint32_t MatchedOn(size_t i, const std::string& model_id, const std::vector<uint32_t>& tokens) {
    ClientOptions co;
    co.target = servers_[i]->target();
    co.ns = kNs;
    co.retry.max_attempts = 1;
    absl::StatusOr<v1::LookupResponse> r = Client::Create(co)->Lookup(model_id, tokens);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->matched_tokens() : 0;
  }
  size_t IndexOf(const Shard& shard) const {
    for (size_t i = 0; i < servers_.size(); ++i) {
      if (shard.name == absl::StrCat("kvtrie-", i)) return i;
    }
    ADD_FAILURE() << "unknown shard " << shard.name;
    return 0;
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
};

TEST_F(WorkerShards, PromptsLandOnTheirOwnersReuseAcrossRunsAndADeadShardIsAMiss) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  std::unique_ptr<ShardedClient> client = Sharded();
  ASSERT_NE(client, nullptr);
  RunOptions options;
  options.steps = 8;
  options.put.encoding = v1::ENCODING_LOSSLESS;

  // First runs: nothing reused, every full block stored on the owner and only there.
  std::vector<size_t> owner(kPrompts.size());
  std::vector<std::string> uncached_text(kPrompts.size());
  std::set<size_t> owners;
  for (size_t p = 0; p < kPrompts.size(); ++p) {
    absl::StatusOr<RunResult> r = RunWithCache(*model, *client, kPrompts[p], options);
    ASSERT_TRUE(r.ok()) << r.status();
    const size_t full = r->prompt_tokens.size() / 16 * 16;
    ASSERT_GE(full, 32u) << "prompt " << p << " must be at least two blocks";
    EXPECT_EQ(r->reused_tokens, 0u) << p;
    EXPECT_EQ(r->stored_blocks, full / 16) << p;
    owner[p] = IndexOf(client->OwnerOf(model->model_id(), r->prompt_tokens));
    owners.insert(owner[p]);
    for (size_t i = 0; i < servers_.size(); ++i) {
      EXPECT_EQ(MatchedOn(i, model->model_id(), r->prompt_tokens), i == owner[p] ? full : 0u)
          << "prompt " << p << " on shard " << i << " (owner " << owner[p] << ")";
    }
    absl::StatusOr<RunResult> u = RunWithoutCache(*model, kPrompts[p], options);
    ASSERT_TRUE(u.ok()) << u.status();
    uncached_text[p] = u->text;
  }
  ASSERT_GE(owners.size(), 2u) << "the prompts must spread over at least two shards";

  // Second runs (a fresh client, as a new worker process): every full block reused, nothing
  // stored, the same text as without the cache.
  client = Sharded();
  for (size_t p = 0; p < kPrompts.size(); ++p) {
    absl::StatusOr<RunResult> r = RunWithCache(*model, *client, kPrompts[p], options);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->reused_tokens, r->prompt_tokens.size() / 16 * 16) << p;
    EXPECT_EQ(r->stored_blocks, 0u) << p;
    EXPECT_EQ(r->text, uncached_text[p]) << p;
  }
  EXPECT_EQ(client->counters().lost_calls, 0u);

  // Kill -9 the owner of prompt 0: its prompts are misses (recomputed, same text, no error, Put
  // skipped); the others still reuse everything.
  const size_t victim = owner[0];
  servers_[victim]->Kill();
  size_t missed = 0, hit = 0;
  for (size_t p = 0; p < kPrompts.size(); ++p) {
    absl::StatusOr<RunResult> r = RunWithCache(*model, *client, kPrompts[p], options);
    ASSERT_TRUE(r.ok()) << "prompt " << p << ": " << r.status();
    EXPECT_EQ(r->text, uncached_text[p]) << p;
    if (owner[p] == victim) {
      EXPECT_EQ(r->reused_tokens, 0u) << p;
      EXPECT_EQ(r->computed_tokens, r->prompt_tokens.size()) << p;
      EXPECT_EQ(r->stored_blocks, 0u) << p;
      ++missed;
    } else {
      EXPECT_EQ(r->reused_tokens, r->prompt_tokens.size() / 16 * 16) << p;
      ++hit;
    }
  }
  EXPECT_GE(missed, 1u);
  EXPECT_GE(hit, 1u);
  EXPECT_GE(client->counters().lost_calls, missed);
}

TEST_F(WorkerShards, CommandLineRoutesToTheOwnerAndADeadShardIsAMiss) {
  KVTRIE_LOAD_MODEL_OR_SKIP(model);
  auto run = [&](const std::string& prompt, std::string* out) {
    std::string err;
    return kvtrie::testing::RunCommand(
        {kvtrie::testing::BinaryPath("client/worker/kvtrie-worker"), "run",
         "--model=" + testing::TestModelPath(), "--shards=" + ShardList(),
         std::string("--ns=") + kNs, "--steps=4", "--retry_attempts=1", "--prompt=" + prompt},
        out, &err);
  };
  std::unique_ptr<ShardedClient> client = Sharded();
  ASSERT_NE(client, nullptr);
  const std::vector<uint32_t> tokens = model->tokenizer().Encode(kPrompts[1], true, false);
  const size_t full = tokens.size() / 16 * 16;
  const Shard owner = client->OwnerOf(model->model_id(), tokens);

  std::string first, second, third;
  ASSERT_EQ(run(kPrompts[1], &first), 0) << first;
  EXPECT_NE(first.find("reused 0 from kvtrie"), std::string::npos) << first;
  EXPECT_NE(first.find("shard: " + owner.name + " (0 calls lost"), std::string::npos) << first;
  EXPECT_EQ(MatchedOn(IndexOf(owner), model->model_id(), tokens), full);
  ASSERT_EQ(run(kPrompts[1], &second), 0) << second;
  EXPECT_NE(second.find("reused " + std::to_string(full) + " from kvtrie"), std::string::npos)
      << second;
  servers_[IndexOf(owner)]->Kill();
  ASSERT_EQ(run(kPrompts[1], &third), 0) << third;
  EXPECT_NE(third.find("reused 0 from kvtrie"), std::string::npos) << third;
  EXPECT_NE(third.find("1 puts skipped"), std::string::npos) << third;
}

}  // namespace
}  // namespace kvtrie::worker
