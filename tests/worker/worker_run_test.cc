// End to end: kvtrie-worker's `run` against a real kvtrie-server process (issue 6).
//
// Starts kvtrie-server on a free loopback port with a temporary --data_dir, runs two prompts
// that share a prefix through RunWithCache, and checks that the second reuses the stored prefix
// (counts asserted) and produces exactly what running without the cache produces when the
// encoding is lossless. Also drives the kvtrie-worker binary once. Skips without the model.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/worker/cached_inference.h"
#include "client/worker/test_model.h"
#include "gtest/gtest.h"

namespace kvtrie::worker {
namespace {

// A kvtrie-server child process on 127.0.0.1:<free port> with a fresh data dir.
class ServerProcess {
 public:
  ServerProcess() {
    char tmpl[] = "/tmp/kvtrie-worker-test-XXXXXX";
    dir_ = mkdtemp(tmpl);
    const std::string port_file = dir_ + "/port";
    pid_ = fork();
    if (pid_ == 0) {
      const std::string data = "--data_dir=" + dir_ + "/data";
      const std::string pf = "--port_file=" + port_file;
      execl(KVTRIE_SERVER_BIN, KVTRIE_SERVER_BIN, "--listen=127.0.0.1:0", data.c_str(), pf.c_str(),
            "--log_level=warn", static_cast<char*>(nullptr));
      _exit(127);
    }
    for (int i = 0; i < 200 && port_ == 0; ++i) {
      std::ifstream in(port_file);
      if (!(in >> port_)) port_ = 0;
      if (port_ == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  bool ok() const { return port_ != 0; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  std::string dir_;
  pid_t pid_ = -1;
  int port_ = 0;
};

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
  ServerProcess server;
  ASSERT_TRUE(server.ok()) << "kvtrie-server did not report a port";
  ClientOptions co;
  co.target = server.target();
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
  ServerProcess server;
  ASSERT_TRUE(server.ok()) << "kvtrie-server did not report a port";
  auto run = [&](const std::string& prompt) {
    const std::string cmd =
        std::string(KVTRIE_WORKER_BIN) + " run --model=" + testing::TestModelPath() +
        " --target=" + server.target() + " --steps=8 --prompt='" + prompt + "' 2>&1";
    std::string out;
    FILE* p = popen(cmd.c_str(), "r");
    char buf[512];
    while (p != nullptr && fgets(buf, sizeof(buf), p) != nullptr) out += buf;
    EXPECT_EQ(p != nullptr ? pclose(p) : -1, 0) << out;
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
