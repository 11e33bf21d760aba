// The bad-input matrix (issue 12): each malformed request against a real kvtrie-server, with the
// status code and the field its message must start with; after every case, everything stored
// before reads back bit-identical and Stats of those namespaces is unchanged. Requests that look
// odd but are valid (blocks out of order) must succeed and store exactly what was sent.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/hostile_testing.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::BlockOf;
using testing::Commit;
using testing::HeaderOf;
using testing::Msg;
using testing::ServerProcess;

struct Case {
  std::string name;
  std::function<grpc::Status()> call;
  grpc::StatusCode code;
  std::string prefix;  // the message starts with this (the field), "" = any
};

class BadInputMatrix : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir("bad_input_matrix");
    absl::StatusOr<std::unique_ptr<ServerProcess>> s =
        ServerProcess::Start(dir_ + "/data", {"--max_tokens=4096"});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    s0_ = testing::LoadTestDump("sessions/s0");
    n0_ = testing::LoadTestDump("neardup/n0");
    n1_ = testing::LoadTestDump("neardup/n1");
    a_ = Client::Create({.target = server_->target(), .ns = "a"});
    b_ = Client::Create({.target = server_->target(), .ns = "b"});
    ASSERT_TRUE(a_->Put(s0_).ok());
    // Near-duplicates (compact profile): a centroid and its residual.
    ASSERT_TRUE(b_->Put(n0_, {.profile = v1::EncodingSpec::PROFILE_COMPACT}).ok());
    ASSERT_TRUE(b_->Put(n1_, {.profile = v1::EncodingSpec::PROFILE_COMPACT}).ok());
  }
  void TearDown() override {
    server_.reset();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  grpc::Status Put(const std::vector<v1::PutRequest>& m) { return testing::RawPut(a_->stub(), m); }
  // A Put of tokens [0, 64) of s0 in a fresh namespace (4 blocks), as a base to break.
  v1::PutHeader Fresh(const std::string& ns = "fresh") { return HeaderOf(s0_, ns, 64); }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  KvDump s0_, n0_, n1_;
  std::unique_ptr<Client> a_, b_;
};

TEST_F(BadInputMatrix, EveryCaseGetsItsStatusAndChangesNothing) {
  testing::StoredSnapshot snap_a(a_.get(), {&s0_});
  testing::StoredSnapshot snap_b(b_.get(), {&n0_, &n1_});
  auto* stub = a_->stub();
  const auto block = [&](uint32_t b, uint32_t lb = 0, uint32_t le = 0) {
    v1::PutBlock pb = BlockOf(s0_, b);
    if (lb != 0 || le != 0) {
      const BlockGeometry g = testing::GeometryOf(s0_);
      const uint32_t end = le ? le : g.num_layers;
      pb.set_layer_begin(lb);
      pb.set_layer_end(le);
      pb.set_kv(pb.kv().substr(g.layer_range_bytes(0, lb), g.layer_range_bytes(lb, end)));
    }
    return Msg(pb);
  };
  const auto pin = [&](const std::vector<uint32_t>& tokens, uint64_t ttl) {
    return [=]() {
      v1::PinRequest req;
      req.set_namespace_("a");
      req.set_model_id(s0_.model_id);
      req.mutable_token_ids()->Add(tokens.begin(), tokens.end());
      req.set_ttl_seconds(ttl);
      v1::PinResponse resp;
      grpc::ClientContext ctx;
      return stub->Pin(&ctx, req, &resp);
    };
  };
  const auto del = [&](const std::vector<uint32_t>& tokens) {
    return [=]() {
      v1::DeleteRequest req;
      req.set_namespace_("a");
      req.set_model_id(s0_.model_id);
      req.mutable_token_ids()->Add(tokens.begin(), tokens.end());
      v1::DeleteResponse resp;
      grpc::ClientContext ctx;
      return stub->Delete(&ctx, req, &resp);
    };
  };
  const auto get = [&](v1::GetRequest req) {
    return [=]() {
      grpc::ClientContext ctx;
      auto reader = stub->Get(&ctx, req);
      v1::GetResponse msg;
      while (reader->Read(&msg)) {
      }
      return reader->Finish();
    };
  };
  const std::vector<uint32_t> first16(s0_.token_ids.begin(), s0_.token_ids.begin() + 16);
  const std::vector<uint32_t> other16(16, 7);  // never stored
  v1::PutHeader nan_header = Fresh();
  nan_header.mutable_encoding()->set_encoding(v1::ENCODING_RESIDUAL);
  v1::PutRequest nan_block = block(0);
  {
    std::string kv = nan_block.block().kv();
    kv[2 * 37] = 0x00;
    kv[2 * 37 + 1] = 0x7e;  // element 37: layer 0, K, head 0, token 4, channel 5
    nan_block.mutable_block()->set_kv(kv);
  }
  v1::PutHeader mismatch = Fresh("a");
  mismatch.mutable_model()->set_head_dim(16);
  v1::PutHeader no_dtype = Fresh();
  no_dtype.mutable_model()->set_dtype(v1::DTYPE_UNSPECIFIED);
  v1::PutHeader bad_encoding = Fresh();
  bad_encoding.mutable_encoding()->set_encoding(static_cast<v1::Encoding>(99));
  v1::PutHeader nan_target = Fresh();
  nan_target.mutable_encoding()->set_target_rel_rms(std::numeric_limits<double>::quiet_NaN());
  v1::PutHeader short_surprisal = Fresh();
  short_surprisal.mutable_surprisal_bits()->RemoveLast();
  v1::PutHeader too_many = HeaderOf(s0_, "fresh", 0);
  for (int i = 0; i < 5000; ++i) too_many.add_token_ids(i % 512);
  v1::PutHeader bad_utf8 = Fresh("caf\xc3");
  v1::PutHeader no_tokens = Fresh();
  no_tokens.clear_token_ids();
  no_tokens.clear_surprisal_bits();
  v1::PutRequest tokens_msg;
  tokens_msg.mutable_tokens()->add_token_ids(1);
  v1::PutRequest oversized = block(0);
  oversized.mutable_block()->set_kv(std::string(5 << 20, '\0'));  // 5 MiB: past gRPC's 4 MiB
  v1::GetRequest absent_model;
  absent_model.set_namespace_("a");
  absent_model.set_model_id("no-such-model");
  absent_model.mutable_token_ids()->Add(first16.begin(), first16.end());
  v1::GetRequest bad_mode = absent_model;
  bad_mode.set_model_id(s0_.model_id);
  bad_mode.set_mode(static_cast<v1::GetMode>(9));
  v1::GetRequest absent_node = bad_mode;
  absent_node.set_mode(v1::GET_MODE_RECONSTRUCTED);
  absent_node.set_node_id(987654321);

  using C = grpc::StatusCode;
  const std::vector<Case> cases = {
      {"empty stream", [&] { return Put({}); }, C::INVALID_ARGUMENT, "header:"},
      {"block first",
       [&] {
         return Put({block(0), Commit()});
       },
       C::INVALID_ARGUMENT, "header:"},
      {"header twice",
       [&] {
         return Put({Msg(Fresh()), Msg(Fresh()), Commit()});
       },
       C::INVALID_ARGUMENT, "header:"},
      {"no commit",
       [&] {
         return Put({Msg(Fresh()), block(0), block(1), block(2), block(3)});
       },
       C::INVALID_ARGUMENT, "commit:"},
      {"message after commit",
       [&] {
         return Put({Msg(Fresh()), block(0), block(1), block(2), block(3), Commit(), block(0)});
       },
       C::INVALID_ARGUMENT, "commit:"},
      {"block duplicated",
       [&] {
         return Put({Msg(Fresh()), block(0), block(1), block(1), block(2), block(3), Commit()});
       },
       C::INVALID_ARGUMENT, "layer_begin:"},
      {"layers duplicated",
       [&] {
         return Put({Msg(Fresh()), block(0), block(1, 0, 3), block(1, 2, 0), Commit()});
       },
       C::INVALID_ARGUMENT, "layer_begin:"},
      {"block missing",
       [&] {
         return Put({Msg(Fresh()), block(0), block(2), block(3), Commit()});
       },
       C::INVALID_ARGUMENT, "kv: blocks [1, 2)"},
      {"layers missing",
       [&] {
         return Put({Msg(Fresh()), block(0), block(1, 0, 2), block(2), block(3), Commit()});
       },
       C::INVALID_ARGUMENT, "kv: block 1 is missing layers"},
      {"block past the tokens",
       [&] {
         return Put({Msg(Fresh()), block(4), Commit()});
       },
       C::INVALID_ARGUMENT, "block_index:"},
      {"empty layer range",
       [&] {
         return Put({Msg(Fresh()), block(0, 3, 3), Commit()});
       },
       C::INVALID_ARGUMENT, "layer_end:"},
      {"kv of the wrong size",
       [&] {
         v1::PutRequest r = block(0);
         r.mutable_block()->mutable_kv()->pop_back();
         return Put({Msg(Fresh()), r, Commit()});
       },
       C::INVALID_ARGUMENT, "kv: block 0"},
      {"NaN in a residual Put",
       [&] {
         return Put({Msg(nan_header), nan_block, Commit()});
       },
       C::INVALID_ARGUMENT, "kv: block 0 layer 0 K head 0 token 4 channel 5 is NaN"},
      {"model spec differs from the stored one",
       [&] {
         return Put({Msg(mismatch), Commit()});
       },
       C::INVALID_ARGUMENT, "model.head_dim:"},
      {"dtype unspecified",
       [&] {
         return Put({Msg(no_dtype), Commit()});
       },
       C::INVALID_ARGUMENT, "model.dtype:"},
      {"unknown encoding",
       [&] {
         return Put({Msg(bad_encoding), Commit()});
       },
       C::INVALID_ARGUMENT, "encoding.encoding:"},
      {"NaN error target",
       [&] {
         return Put({Msg(nan_target), Commit()});
       },
       C::INVALID_ARGUMENT, "encoding.target_rel_rms:"},
      {"surprisal of the wrong length",
       [&] {
         return Put({Msg(short_surprisal), Commit()});
       },
       C::INVALID_ARGUMENT, "surprisal_bits:"},
      {"more tokens than --max_tokens",
       [&] {
         return Put({Msg(too_many), Commit()});
       },
       C::RESOURCE_EXHAUSTED, "token_ids:"},
      {"no token ids, with a block",
       [&] {
         return Put({Msg(no_tokens), block(0), Commit()});
       },
       C::INVALID_ARGUMENT, "block_index:"},
      {"PutTokens after a block",
       [&] {
         return Put({Msg(Fresh()), block(0), tokens_msg, Commit()});
       },
       C::INVALID_ARGUMENT, "tokens:"},
      {"invalid UTF-8 namespace",
       [&] {
         return Put({Msg(bad_utf8), block(0), Commit()});
       },
       C::INVALID_ARGUMENT, "header:"},
      {"oversized message",
       [&] {
         return Put({Msg(Fresh()), oversized, Commit()});
       },
       C::RESOURCE_EXHAUSTED, ""},
      {"pin TTL past the range", pin(first16, std::numeric_limits<uint64_t>::max()),
       C::INVALID_ARGUMENT, "ttl_seconds:"},
      {"pin of an absent prefix", pin(other16, 10), C::NOT_FOUND, "token_ids:"},
      {"delete of an absent prefix", del(other16), C::NOT_FOUND, "token_ids:"},
      {"delete not block-aligned", del({first16.begin(), first16.begin() + 5}), C::INVALID_ARGUMENT,
       "token_ids:"},
      {"get with an unknown mode", get(bad_mode), C::INVALID_ARGUMENT, "mode:"},
      {"get of an absent node", get(absent_node), C::NOT_FOUND, "node_id:"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const grpc::Status s = c.call();
    EXPECT_EQ(s.error_code(), c.code) << c.name << ": " << s.error_message();
    if (!c.prefix.empty()) {
      EXPECT_EQ(s.error_message().rfind(c.prefix, 0), 0u)
          << c.name << ": message should start with '" << c.prefix << "': " << s.error_message();
    }
    snap_a.Expect(c.name);
    snap_b.Expect(c.name);
  }
  // Nothing reached the fresh namespace either.
  EXPECT_EQ(a_->Stats("fresh")->nodes(), 0u);

  // A Get of an absent model is a miss, not an error: a header with no blocks.
  {
    grpc::ClientContext ctx;
    auto reader = stub->Get(&ctx, absent_model);
    v1::GetResponse msg;
    ASSERT_TRUE(reader->Read(&msg));
    ASSERT_TRUE(msg.has_header());
    EXPECT_EQ(msg.header().matched_tokens(), 0u);
    EXPECT_FALSE(reader->Read(&msg));
    EXPECT_TRUE(reader->Finish().ok());
  }

  // Blocks out of order are valid: stored exactly as sent.
  auto fresh = Client::Create({.target = server_->target(), .ns = "ooo"});
  ASSERT_TRUE(testing::RawPut(stub, {Msg(Fresh("ooo")), block(3), block(1), block(0),
                                     block(2, 3, 0), block(2, 0, 3), Commit()})
                  .ok());
  absl::StatusOr<KvDump> got = fresh->Get(s0_.model_id, s0_.token_ids);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->num_tokens(), 64u);
  const BlockGeometry g = testing::GeometryOf(s0_);
  for (uint32_t b = 0; b < 4; ++b) {
    std::vector<uint8_t> want(g.num_bytes()), have(g.num_bytes());
    GatherBlock(g, s0_.num_tokens(), s0_.k.data(), s0_.v.data(), b, absl::MakeSpan(want));
    GatherBlock(g, 64, got->k.data(), got->v.data(), b, absl::MakeSpan(have));
    EXPECT_EQ(want, have) << "block " << b;
  }
  snap_a.Expect("the out-of-order Put");
  snap_b.Expect("the out-of-order Put");
}

}  // namespace
}  // namespace kvtrie
