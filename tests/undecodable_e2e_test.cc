// End-to-end tests of issue 30 rows 1 and 3 against a real kvtrie-server on loopback with the
// --verify_encoded_puts=structure (the mode that stores a block unread): the mutant — a
// real fast LOSSLESS envelope of tests/data whose zstd frame was altered and its CRC-32C recomputed
// (codec/testing_mutants.h) — sent as an encoded Put is accepted (its structure is sound); a
// RECONSTRUCTED Get of it answers DATA_LOSS naming the node, the C++ client's Get of a longer
// prefix returns the blocks before it, and a correct dense Put of the same tokens is stored and
// readable, also across a restart. A hostile client-reported error is refused naming the field;
// Stats never read inf or nan.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "codec/block_codec.h"
#include "codec/kv_layout.h"
#include "codec/testing_mutants.h"
#include "gtest/gtest.h"
#include "tests/hostile_testing.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::Commit;
using testing::GeometryOf;
using testing::HeaderOf;
using testing::Msg;
using testing::RawPut;
using testing::ServerProcess;

constexpr uint32_t kBlocks = 5;  // the Put: the first 5 blocks of GPL-3
constexpr uint32_t kBad = 2;     // the mutant's block

// The first `tokens` tokens of `d` (sequence layout: [layers][heads][tokens][head_dim] per side).
KvDump FirstTokens(const KvDump& d, size_t tokens) {
  KvDump out = d;
  out.token_ids.resize(tokens);
  if (!out.surprisal_bits.empty()) out.surprisal_bits.resize(tokens);
  const size_t row = static_cast<size_t>(d.head_dim) * DTypeBytes(d.dtype);
  const size_t rows = static_cast<size_t>(d.num_layers) * d.num_kv_heads;
  out.k.assign(rows * tokens * row, 0);
  out.v.assign(out.k.size(), 0);
  for (size_t r = 0; r < rows; ++r) {
    const size_t from = r * d.num_tokens() * row, to = r * tokens * row;
    std::copy_n(d.k.begin() + from, tokens * row, out.k.begin() + to);
    std::copy_n(d.v.begin() + from, tokens * row, out.v.begin() + to);
  }
  return out;
}

class UndecodableEndToEnd : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    Start();
    gpl_ = testing::LoadTestDump("GPL-3");
    prefix_ = FirstTokens(gpl_, kBlocks * 16);
    const BlockGeometry g = GeometryOf(gpl_);
    for (uint32_t b = 0; b < kBlocks; ++b) {
      std::vector<uint8_t> block(g.num_bytes());
      GatherBlock(g, gpl_.num_tokens(), gpl_.k.data(), gpl_.v.data(), b, absl::MakeSpan(block));
      EncodeOptions o{.encoding = Encoding::kLossless};
      o.profile = Profile::kFast;
      absl::StatusOr<EncodedBlock> e = EncodeBlock(g, block, o, {});
      ASSERT_TRUE(e.ok()) << e.status();
      encoded_.push_back(e->bytes);
    }
    std::vector<std::string> mutants = UndecodableLosslessMutants(g, encoded_[kBad]);
    ASSERT_EQ(mutants.size(), 1u) << "no undecodable mutant of block " << kBad;
    mutant_ = mutants[0];
  }
  void TearDown() override {
    server_.reset();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  void Start() {
    auto s = ServerProcess::Start(dir_ + "/data", {"--verify_encoded_puts=structure"});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }
  void Restart() {
    ASSERT_EQ(server_->Stop(), 0);
    server_.reset();
    Start();
  }
  std::unique_ptr<Client> NewClient(const std::string& ns) {
    return Client::Create({.target = server_->target(), .ns = ns});
  }
  // The first kBlocks blocks of GPL-3 as an encoded Put (fast LOSSLESS), block kBad as `bad`,
  // each reporting `rel_rms_error_k`.
  grpc::Status PutEncoded(Client* client, const std::string& ns, const std::string& bad,
                          double rel_rms_error_k = 0) {
    v1::PutHeader h = HeaderOf(gpl_, ns, kBlocks * 16, v1::ENCODING_LOSSLESS);
    h.mutable_encoding()->set_profile(v1::EncodingSpec::PROFILE_FAST);
    std::vector<v1::PutRequest> messages = {Msg(h)};
    for (uint32_t b = 0; b < kBlocks; ++b) {
      v1::PutRequest r;
      r.mutable_block()->set_block_index(b);
      r.mutable_block()->set_encoded(b == kBad ? bad : encoded_[b]);
      r.mutable_block()->set_rel_rms_error_k(rel_rms_error_k);
      messages.push_back(std::move(r));
    }
    messages.push_back(Commit());
    return RawPut(client->stub(), messages);
  }
  // A raw RECONSTRUCTED Get of the Put's tokens: its status, and the blocks that came before it.
  grpc::Status RawGet(Client* client, const std::string& ns, size_t* blocks) {
    v1::GetRequest req;
    req.set_namespace_(ns);
    req.set_model_id(gpl_.model_id);
    req.mutable_token_ids()->Add(prefix_.token_ids.begin(), prefix_.token_ids.end());
    req.set_mode(v1::GET_MODE_RECONSTRUCTED);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = client->stub()->Get(&ctx, req);
    v1::GetResponse msg;
    *blocks = 0;
    while (reader->Read(&msg)) {
      if (msg.has_block() && msg.block().layer_end() == gpl_.num_layers) ++*blocks;
    }
    return reader->Finish();
  }
  // The client's Get of all of GPL-3: expects the first `blocks` blocks, bit-exact.
  void ExpectGet(Client* client, size_t blocks) {
    absl::StatusOr<KvDump> got = client->Get(gpl_.model_id, gpl_.token_ids);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->token_ids.size(), blocks * 16);
    const KvDump want = FirstTokens(gpl_, blocks * 16);
    EXPECT_TRUE(got->k == want.k && got->v == want.v);
  }
  void ExpectDensePutReplacesTheMutant(Client* client) {
    absl::StatusOr<v1::PutResponse> r =
        client->Put(prefix_, {.encoding = v1::ENCODING_LOSSLESS, .encode_on_client = false});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->blocks_size(), static_cast<int>(kBlocks));
    for (const v1::BlockResult& b : r->blocks()) {
      EXPECT_EQ(b.disposition() == v1::BLOCK_DEDUPLICATED, b.block_index() < kBad)
          << "block " << b.block_index() << " " << v1::BlockDisposition_Name(b.disposition());
    }
    ExpectGet(client, kBlocks);
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  KvDump gpl_, prefix_;
  std::vector<std::string> encoded_;
  std::string mutant_;
};

TEST_F(UndecodableEndToEnd, TheMutantIsDataLossNamingItAndADensePutOfItsTokensIsReadable) {
  std::unique_ptr<Client> client = NewClient("a");
  ASSERT_TRUE(PutEncoded(client.get(), "a", mutant_).ok());  // structure only: accepted
  absl::StatusOr<v1::LookupResponse> looked = client->Lookup(gpl_.model_id, prefix_.token_ids);
  ASSERT_TRUE(looked.ok()) << looked.status();
  ASSERT_EQ(looked->node_ids_size(), static_cast<int>(kBlocks));
  size_t before = 0;
  grpc::Status s = RawGet(client.get(), "a", &before);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), absl::StrCat("node ", looked->node_ids(kBad))))
      << s.error_message();
  EXPECT_EQ(before, kBad);        // the blocks before it were streamed
  ExpectGet(client.get(), kBad);  // dropped: a Get of a longer prefix returns the blocks before it
  ExpectDensePutReplacesTheMutant(client.get());
}

TEST_F(UndecodableEndToEnd, TheClientsGetOfALongerPrefixReturnsTheBlocksBeforeTheMutant) {
  std::unique_ptr<Client> client = NewClient("b");
  ASSERT_TRUE(PutEncoded(client.get(), "b", mutant_).ok());
  ExpectGet(client.get(), kBad);  // the server answered DATA_LOSS; the client got again once
  ExpectDensePutReplacesTheMutant(client.get());
}

TEST_F(UndecodableEndToEnd, ADensePutReplacesTheMutantAcrossARestart) {
  std::unique_ptr<Client> client = NewClient("c");
  ASSERT_TRUE(PutEncoded(client.get(), "c", mutant_).ok());
  Restart();
  client = NewClient("c");
  ExpectDensePutReplacesTheMutant(client.get());  // never deduplicated onto the mutant
  Restart();
  client = NewClient("c");
  ExpectGet(client.get(), kBlocks);
}

TEST_F(UndecodableEndToEnd, AHostileErrorIsRefusedNamingTheFieldAndStatsStayFinite) {
  std::unique_ptr<Client> client = NewClient("d");
  ASSERT_TRUE(PutEncoded(client.get(), "d", encoded_[kBad], 0.01).ok());
  std::unique_ptr<Client> hostile = NewClient("e");
  grpc::Status s = PutEncoded(hostile.get(), "e", encoded_[kBad], 1e308);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StartsWith(s.error_message(), "rel_rms_error_k")) << s.error_message();
  s = PutEncoded(hostile.get(), "e", encoded_[kBad], 4.5);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  std::unique_ptr<Client> whole = NewClient("");  // Stats of "": the whole server
  for (Client* c : {whole.get(), client.get(), hostile.get()}) {
    const std::string ns = c->options().ns;
    absl::StatusOr<v1::StatsResponse> st = c->Stats();
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_TRUE(std::isfinite(st->mean_rel_rms_error_k())) << ns;
    EXPECT_TRUE(std::isfinite(st->max_rel_rms_error())) << ns;
    EXPECT_LE(st->max_rel_rms_error(), 0.01 + 1e-6) << ns;
  }
  absl::StatusOr<v1::StatsResponse> e = hostile->Stats();
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->nodes(), 0u);  // the hostile Put stored nothing
}

}  // namespace
}  // namespace kvtrie
