// End-to-end tests of erasing Deletes (issue 30 row 8) through a real kvtrie-server: the real
// near-duplicate dumps tests/data/neardup/n0 and n1 are stored lossy (n0's branch after their
// divergence is the centroid of n1's lossy blocks). A Delete of n0's branch with erase (C++
// client, `kvtrie delete --erase`, or any Delete with --delete_erases) retains nothing, answers
// what it cost, and afterwards no distinctive chunk of the deleted blocks' stored payloads (as a
// RESIDUAL Get sent them) is found in any file of the data folder; n1 reads back as before in
// both Get modes, also after a restart. Without erase the old behaviour stays (retained, on disk).
#include <grpcpp/grpcpp.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"
#include "kvtrie/v1/kvtrie.grpc.pb.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::ServerProcess;
constexpr uint32_t kBlockTokens = 16;

KvDump Load(const std::string& name) {
  absl::StatusOr<KvDump> d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
  EXPECT_TRUE(d.ok()) << d.status();
  return *d;
}

size_t DivergenceBlock(const KvDump& a, const KvDump& b) {
  size_t i = 0;
  while (i < a.num_tokens() && a.token_ids[i] == b.token_ids[i]) ++i;
  return i / kBlockTokens;
}

// How many of `chunks` occur in some regular file under `dir` (raw bytes).
size_t ChunksFound(const std::string& dir, const std::vector<std::string>& chunks) {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    files.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  size_t found = 0;
  for (const std::string& c : chunks) {
    for (const std::string& f : files) {
      if (f.find(c) != std::string::npos) {
        ++found;
        break;
      }
    }
  }
  return found;
}

// A distinctive 48-byte piece of `payload` (from its middle, at least 24 distinct byte values, so
// no other encoding shares it by chance), or empty if none.
std::string DistinctiveChunk(const std::string& payload) {
  constexpr size_t kLen = 48;
  for (size_t at = payload.size() / 2; at + kLen <= payload.size(); at += 7) {
    const std::string c = payload.substr(at, kLen);
    if (std::set<char>(c.begin(), c.end()).size() >= 24) return c;
  }
  return "";
}

class EraseEndToEnd : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    n0_ = Load("neardup/n0");
    n1_ = Load("neardup/n1");
    d1_ = DivergenceBlock(n0_, n1_);
  }
  void TearDown() override {
    server_.reset();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  // (Re)starts the server on the same data; the background cluster pass is off so the Put path's
  // clusters stay as they are.
  void Restart(std::vector<std::string> flags = {}) {
    server_.reset();
    flags.push_back("--cluster_pass_interval_ms=0");
    auto s = ServerProcess::Start(dir_ + "/data", flags);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    client_ = Client::Create({.target = server_->target(), .ns = kNs});
  }
  // Stores n0 and n1 lossy, keeps n1 as read, and the distinctive chunks of the stored payloads of
  // n0's blocks that a Delete of its branch removes (read raw through a RESIDUAL Get). Restarts
  // the server afterwards (no Get's snapshot is left; the payloads move to blob files).
  void PutAndCollect(const std::vector<std::string>& flags = {}) {
    ASSERT_NO_FATAL_FAILURE(Restart(flags));
    const PutOptions lossy{.encoding = v1::ENCODING_RESIDUAL,
                           .profile = v1::EncodingSpec::PROFILE_COMPACT};
    ASSERT_TRUE(client_->Put(n0_, lossy).ok());
    ASSERT_TRUE(client_->Put(n1_, lossy).ok());
    absl::StatusOr<KvDump> before = client_->Get(n1_.model_id, n1_.token_ids);
    ASSERT_TRUE(before.ok()) << before.status();
    n1_before_ = *std::move(before);
    {
      auto stub = v1::KVCache::NewStub(
          grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
      v1::GetRequest req;
      req.set_namespace_(kNs);
      req.set_model_id(n0_.model_id);
      req.mutable_token_ids()->Add(n0_.token_ids.begin(), n0_.token_ids.end());
      req.set_mode(v1::GET_MODE_RESIDUAL);
      grpc::ClientContext ctx;
      auto reader = stub->Get(&ctx, req);
      v1::GetResponse msg;
      while (reader->Read(&msg)) {
        if (!msg.has_block() || msg.block().block_index() < d1_) continue;
        if (std::string c = DistinctiveChunk(msg.block().encoded()); !c.empty()) {
          chunks_.push_back(c);
        }
      }
      ASSERT_TRUE(reader->Finish().ok());
    }
    ASSERT_GE(chunks_.size(), 20u);
    ASSERT_NO_FATAL_FAILURE(Restart(flags));
    // The control: the folder holds them now.
    ASSERT_GE(ChunksFound(dir_ + "/data", chunks_), chunks_.size() * 3 / 4);
  }
  std::vector<uint32_t> Branch() const {
    return {n0_.token_ids.begin(), n0_.token_ids.begin() + (d1_ + 1) * kBlockTokens};
  }
  // n1 reads back exactly as before in both Get modes.
  void ExpectN1AsBefore() {
    for (v1::GetMode mode : {v1::GET_MODE_RECONSTRUCTED, v1::GET_MODE_RESIDUAL}) {
      absl::StatusOr<KvDump> got = client_->Get(n1_.model_id, n1_.token_ids, {.mode = mode});
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->token_ids.size(), n1_.token_ids.size());
      EXPECT_TRUE(got->k == n1_before_.k) << v1::GetMode_Name(mode);
      EXPECT_TRUE(got->v == n1_before_.v) << v1::GetMode_Name(mode);
    }
  }
  void ExpectErased(const v1::DeleteResponse& del) {
    EXPECT_TRUE(del.erased());
    EXPECT_EQ(del.centroids_retained(), 0u);
    EXPECT_EQ(del.nodes_retained(), 0u);
    EXPECT_GT(del.centroids_reelected(), 20u);
    EXPECT_GT(del.erase_bytes_rewritten(), 0u);
    EXPECT_EQ(ChunksFound(dir_ + "/data", chunks_), 0u);
    absl::StatusOr<v1::StatsResponse> st = client_->Stats();
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->retained_nodes(), 0u);
    absl::StatusOr<v1::LookupResponse> lookup = client_->Lookup(n0_.model_id, n0_.token_ids);
    ASSERT_TRUE(lookup.ok());
    EXPECT_EQ(lookup->matched_tokens(), d1_ * kBlockTokens);
    ExpectN1AsBefore();
    ASSERT_NO_FATAL_FAILURE(Restart());
    EXPECT_EQ(ChunksFound(dir_ + "/data", chunks_), 0u);
    ExpectN1AsBefore();
  }

  static constexpr char kNs[] = "erase";
  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
  KvDump n0_, n1_, n1_before_;
  size_t d1_ = 0;
  std::vector<std::string> chunks_;  // of the payloads the Delete removes
};

TEST_F(EraseEndToEnd, AnErasingDeleteLeavesNoByteOfTheDeletedPayloadsInTheDataFolder) {
  ASSERT_NO_FATAL_FAILURE(PutAndCollect());
  absl::StatusOr<v1::DeleteResponse> del = client_->Delete(n0_.model_id, Branch(), true);
  ASSERT_TRUE(del.ok()) << del.status();
  ExpectErased(*del);
}

TEST_F(EraseEndToEnd, TheCliDeleteEraseErases) {
  ASSERT_NO_FATAL_FAILURE(PutAndCollect());
  std::string out, err;
  const int rc = testing::RunCommand(
      {testing::BinaryPath("client/kvtrie"), "--target=" + server_->target(),
       absl::StrCat("--namespace=", kNs), "--erase", "delete",
       std::string(KVTRIE_TESTDATA_DIR) + "/neardup/n0", std::to_string(Branch().size())},
      &out, &err);
  ASSERT_EQ(rc, 0) << err;
  EXPECT_NE(out.find("\"erased\": true"), std::string::npos) << out;
  EXPECT_NE(out.find("erase_bytes_rewritten"), std::string::npos) << out;
  EXPECT_EQ(ChunksFound(dir_ + "/data", chunks_), 0u);
  ExpectN1AsBefore();
}

TEST_F(EraseEndToEnd, WithDeleteErasesEveryDeleteErases) {
  ASSERT_NO_FATAL_FAILURE(PutAndCollect({"--delete_erases"}));
  absl::StatusOr<v1::DeleteResponse> del = client_->Delete(n0_.model_id, Branch());
  ASSERT_TRUE(del.ok()) << del.status();
  ExpectErased(*del);
}

TEST_F(EraseEndToEnd, WithoutEraseTheDeletedCentroidsAreRetainedAndStayOnDisk) {
  ASSERT_NO_FATAL_FAILURE(PutAndCollect());
  absl::StatusOr<v1::DeleteResponse> del = client_->Delete(n0_.model_id, Branch());
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_FALSE(del->erased());
  EXPECT_GT(del->centroids_retained(), 20u);
  EXPECT_EQ(del->erase_bytes_rewritten(), 0u);
  EXPECT_GE(ChunksFound(dir_ + "/data", chunks_), chunks_.size() * 3 / 4);
  ExpectN1AsBefore();
}

}  // namespace
}  // namespace kvtrie
