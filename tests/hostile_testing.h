// tests/hostile_testing.h
//
// Helpers of the hostile-input end-to-end tests (issue 12): raw Put streams of any message
// sequence, the blocks of a real dump as PutBlocks, and a snapshot of what a server stores that
// a test checks is unchanged (Stats totals and every dump read back bit-identical).
#ifndef KVTRIE_TESTS_HOSTILE_TESTING_H_
#define KVTRIE_TESTS_HOSTILE_TESTING_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "codec/block_geometry.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "gtest/gtest.h"

namespace kvtrie::testing {

inline KvDump LoadTestDump(const std::string& name) {
  absl::StatusOr<KvDump> d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *d : KvDump{};
}

inline BlockGeometry GeometryOf(const KvDump& d, uint32_t block_tokens = 16) {
  return {d.num_layers, d.num_kv_heads, block_tokens, d.head_dim, d.dtype};
}

// A PutHeader for the first `tokens` tokens of `d` (all when `tokens` is -1), with surprisal.
inline v1::PutHeader HeaderOf(const KvDump& d, const std::string& ns, long tokens = -1,
                              v1::Encoding encoding = v1::ENCODING_LOSSLESS) {
  const size_t n = tokens < 0 ? d.num_tokens() : static_cast<size_t>(tokens);
  v1::PutHeader h;
  h.set_namespace_(ns);
  h.mutable_model()->set_model_id(d.model_id);
  h.mutable_model()->set_num_layers(d.num_layers);
  h.mutable_model()->set_num_kv_heads(d.num_kv_heads);
  h.mutable_model()->set_head_dim(d.head_dim);
  h.mutable_model()->set_dtype(static_cast<v1::DType>(d.dtype));
  h.mutable_model()->set_block_tokens(16);
  h.mutable_token_ids()->Add(d.token_ids.begin(), d.token_ids.begin() + n);
  h.mutable_surprisal_bits()->Add(d.surprisal_bits.begin(), d.surprisal_bits.begin() + n);
  h.mutable_encoding()->set_encoding(encoding);
  return h;
}

// Block `b` of `d` (16 tokens) as one PutBlock of every layer.
inline v1::PutBlock BlockOf(const KvDump& d, uint32_t b) {
  const BlockGeometry g = GeometryOf(d);
  std::vector<uint8_t> block(g.num_bytes());
  GatherBlock(g, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
  v1::PutBlock pb;
  pb.set_block_index(b);
  pb.set_kv(block.data(), block.size());
  return pb;
}

inline v1::PutRequest Msg(const v1::PutHeader& h) {
  v1::PutRequest r;
  *r.mutable_header() = h;
  return r;
}
inline v1::PutRequest Msg(const v1::PutBlock& b) {
  v1::PutRequest r;
  *r.mutable_block() = b;
  return r;
}
inline v1::PutRequest Commit() {
  v1::PutRequest r;
  r.mutable_commit();
  return r;
}

// Sends `messages` on one Put stream, half-closes, returns the status.
inline grpc::Status RawPut(v1::KVCache::Stub* stub, const std::vector<v1::PutRequest>& messages,
                           v1::PutResponse* response = nullptr) {
  v1::PutResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto writer = stub->Put(&ctx, response ? response : &resp);
  for (const v1::PutRequest& m : messages) {
    if (!writer->Write(m)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

// What `client`'s namespace stores for each dump, read back at construction; Expect() checks
// that the server still returns exactly those bytes and the same Stats of that namespace.
class StoredSnapshot {
 public:
  StoredSnapshot(Client* client, std::vector<const KvDump*> dumps)
      : client_(client), dumps_(std::move(dumps)) {
    stats_ = *client_->Stats();
    for (const KvDump* d : dumps_) {
      absl::StatusOr<KvDump> got = client_->Get(d->model_id, d->token_ids);
      EXPECT_TRUE(got.ok()) << got.status();
      got_.push_back(got.ok() ? *got : KvDump{});
    }
  }
  void Expect(const std::string& after) const {
    SCOPED_TRACE("after " + after);
    absl::StatusOr<v1::StatsResponse> now = client_->Stats();
    ASSERT_TRUE(now.ok()) << now.status();
    EXPECT_EQ(now->nodes(), stats_.nodes());
    EXPECT_EQ(now->bytes_stored(), stats_.bytes_stored());
    EXPECT_EQ(now->pinned_nodes(), stats_.pinned_nodes());
    for (size_t i = 0; i < dumps_.size(); ++i) {
      absl::StatusOr<KvDump> got = client_->Get(dumps_[i]->model_id, dumps_[i]->token_ids);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->token_ids, got_[i].token_ids);
      EXPECT_TRUE(got->k == got_[i].k && got->v == got_[i].v) << "dump " << i << " changed";
    }
  }

 private:
  Client* const client_;
  const std::vector<const KvDump*> dumps_;
  v1::StatsResponse stats_;
  std::vector<KvDump> got_;
};

// Threads of process `pid` (/proc/PID/status), -1 if unknown.
inline int ThreadCount(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

// Waits (up to 30 s) until the server reports at least `streams` open Put streams (server-wide;
// pass 0 with a namespace) and its Put streams in `ns` ("" = all) hold at least `bytes` of
// reservation: a client's writes return before the server has read them, so a test that needs
// the server to hold a stalled stream waits for it here instead of sleeping. Returns whether it
// did.
inline bool AwaitPutStreams(Client* client, uint64_t streams, uint64_t bytes = 0,
                            const std::string& ns = "") {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    absl::StatusOr<v1::StatsResponse> s = client->Stats(ns);
    if (s.ok() && s->open_put_streams() >= streams && s->inflight_put_bytes() >= bytes) {
      return true;
    }
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// A Put stream that sent a header and `blocks` of `d`, then stalls until finished, cancelled
// or destroyed (destroying it cancels it).
struct StalledPut {
  StalledPut(v1::KVCache::Stub* stub, const KvDump& d, const std::string& ns, int blocks) {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    writer = stub->Put(&ctx, &resp);
    ok = writer->Write(Msg(HeaderOf(d, ns)));
    for (int b = 0; ok && b < blocks; ++b) ok = writer->Write(Msg(BlockOf(d, b)));
  }
  StalledPut(const StalledPut&) = delete;
  StalledPut& operator=(const StalledPut&) = delete;
  grpc::Status Finish() {
    finished = true;
    writer->WritesDone();
    return writer->Finish();
  }
  grpc::Status Cancel() {
    finished = true;
    ctx.TryCancel();
    return writer->Finish();
  }
  ~StalledPut() {
    ctx.TryCancel();
    if (!finished) writer->Finish();
  }
  bool finished = false;
  grpc::ClientContext ctx;
  v1::PutResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer;
  bool ok = false;
};

}  // namespace kvtrie::testing

#endif  // KVTRIE_TESTS_HOSTILE_TESTING_H_
