// End-to-end tests of the server's limits on streams and messages (issue 18), each against a real
// kvtrie-server: a Put header past the message limit gets a named error, a server busy with
// another Put's commit does not cancel a streaming Put for idleness, Gets whose clients stop
// reading are cancelled and let the data folder return under its bound, a Get older than the
// snapshot cap ends ABORTED naming it, SIGTERM with 100 stalled streams exits within the grace,
// and one peer cannot hold every Put-stream slot.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"
#include "tests/hostile_testing.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::HeaderOf;
using testing::Msg;
using testing::ServerProcess;
using testing::StalledPut;

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Bytes of every file under `dir` (the server's data folder).
uint64_t FolderBytes(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code size_ec;
    if (it->is_regular_file(size_ec)) {
      const uint64_t n = it->file_size(size_ec);
      if (!size_ec) total += n;
    }
  }
  return total;
}

// A prefix of `blocks` blocks of `layers` layers, 8 heads, head_dim 128, fp16 (16 tokens a block:
// 64 KiB a layer), token ids from `first_token`. `finite`: small normal fp16 values (lossy
// encodings need finite ones); else random bits (RAW: plumbing only).
KvDump Prefix(int blocks, uint32_t first_token, uint32_t seed, uint32_t layers = 4,
              bool finite = false) {
  KvDump d;
  d.model_id = "big";
  d.num_layers = layers;
  d.num_kv_heads = 8;
  d.head_dim = 128;
  d.dtype = DType::kFp16;
  const size_t tokens = 16 * static_cast<size_t>(blocks);
  for (size_t t = 0; t < tokens; ++t) d.token_ids.push_back(first_token + static_cast<uint32_t>(t));
  d.surprisal_bits.assign(tokens, 1.0f);
  const size_t n = static_cast<size_t>(d.num_layers) * d.num_kv_heads * tokens * d.head_dim * 2;
  std::mt19937 rng(seed);
  d.k.resize(n);
  d.v.resize(n);
  for (std::vector<uint8_t>* plane : {&d.k, &d.v}) {
    for (size_t i = 0; i + 1 < n; i += 2) {
      const uint32_t r = rng();
      // Sign, exponent 10..15 (2^-5 .. 2^0), any mantissa: always finite.
      const uint16_t h =
          finite ? static_cast<uint16_t>((r & 0x8000) | ((10 + (r >> 16) % 6) << 10) | (r & 0x3ff))
                 : static_cast<uint16_t>(r);
      (*plane)[i] = static_cast<uint8_t>(h & 0xff);
      (*plane)[i + 1] = static_cast<uint8_t>(h >> 8);
    }
  }
  return d;
}

// A stub on a connection of its own whose receive windows stay at HTTP/2's 64 KiB (no BDP
// probing, which would grow them to buffer a whole Get): a client that stops reading stalls the
// server's writes after that much.
std::unique_ptr<v1::KVCache::Stub> SmallWindowStub(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  return v1::KVCache::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
}

// A Get on a connection of its own (SmallWindowStub) whose client reads the header and then
// nothing (until cancelled or destroyed).
struct StalledGet {
  StalledGet(const std::string& target, const KvDump& d, const std::string& ns,
             std::chrono::seconds deadline)
      : stub(SmallWindowStub(target)) {
    v1::GetRequest request;
    request.set_namespace_(ns);
    request.set_model_id(d.model_id);
    request.mutable_token_ids()->Add(d.token_ids.begin(), d.token_ids.end());
    ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    reader = stub->Get(&ctx, request);
    v1::GetResponse first;
    ok = reader->Read(&first) && first.header().matched_blocks() > 0;
  }
  StalledGet(const StalledGet&) = delete;
  StalledGet& operator=(const StalledGet&) = delete;
  ~StalledGet() {
    ctx.TryCancel();
    if (!finished) reader->Finish();
  }
  // Reads what is left (the messages the server had sent) and the final status.
  grpc::Status Drain() {
    v1::GetResponse m;
    while (reader->Read(&m)) {
    }
    finished = true;
    return reader->Finish();
  }
  std::unique_ptr<v1::KVCache::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::GetResponse>> reader;
  bool ok = false;
  bool finished = false;
};

// A PutRequest block of the 1-layer, 1-head, head_dim-8 fp16 model "tiny" (512 bytes).
v1::PutRequest TinyBlock(uint32_t i) {
  v1::PutRequest b;
  b.mutable_block()->set_block_index(i);
  std::string kv(512, '\0');
  for (size_t j = 0; j < kv.size(); j += 2) kv[j + 1] = static_cast<char>(0x30 + (i + j) % 9);
  b.mutable_block()->set_kv(kv);
  return b;
}

v1::PutRequest TinyHeader(uint32_t blocks) {
  v1::PutRequest req;
  v1::PutHeader* h = req.mutable_header();
  h->mutable_model()->set_model_id("tiny");
  h->mutable_model()->set_num_layers(1);
  h->mutable_model()->set_num_kv_heads(1);
  h->mutable_model()->set_head_dim(8);
  h->mutable_model()->set_dtype(v1::DTYPE_FP16);
  for (uint32_t t = 0; t < 16 * blocks; ++t) h->add_token_ids(7 + t);
  return req;
}

class Limits : public ::testing::Test {
 protected:
  void SetUp() override {
    test_dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    s0_ = testing::LoadTestDump("sessions/s0");
    s1_ = testing::LoadTestDump("sessions/s1");
  }
  void TearDown() override {
    server_.reset();
    if (!HasFailure()) std::filesystem::remove_all(test_dir_);
  }
  void Start(const std::vector<std::string>& flags) {
    server_.reset();
    absl::StatusOr<std::unique_ptr<ServerProcess>> s = ServerProcess::Start(data_dir(), flags);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }
  std::string data_dir() const { return test_dir_ + "/data"; }
  std::unique_ptr<Client> NewClient(const std::string& ns = "", const std::string& target = "") {
    return Client::Create({.target = target.empty() ? server_->target() : target, .ns = ns});
  }

  std::string test_dir_;
  std::unique_ptr<ServerProcess> server_;
  KvDump s0_, s1_;
};

TEST_F(Limits, PutHeaderPastTheMessageLimitIsRefusedNamingPutTokens) {
  Start({});
  auto client = NewClient();
  // 700,000 ids as varints and their surprisal in the header: about 4.9 MB, past the 4 MiB
  // (+ 64 KiB) message limit of the default --max_tokens.
  v1::PutHeader h = HeaderOf(s0_, "", 0);
  for (uint32_t i = 0; i < 700000; ++i) {
    h.add_token_ids(1000 + i % 30000);
    h.add_surprisal_bits(1.0f);
  }
  v1::PutResponse response;
  const grpc::Status s = testing::RawPut(client->stub(), {Msg(h)}, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("header: "), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("PutTokens"), std::string::npos) << s.error_message();
  EXPECT_EQ(s.error_message().find("Received message larger than max"), std::string::npos)
      << s.error_message();
  // A unary request past it names its size too.
  v1::LookupRequest lookup;
  lookup.set_model_id(s0_.model_id);
  for (uint32_t i = 0; i < 1500000; ++i) lookup.add_token_ids(1000000 + i);  // 4.5 MB
  grpc::ClientContext ctx;
  v1::LookupResponse found;
  const grpc::Status l = client->stub()->Lookup(&ctx, lookup, &found);
  EXPECT_EQ(l.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << l.error_message();
  EXPECT_NE(l.error_message().find("message limit"), std::string::npos) << l.error_message();
  EXPECT_EQ(client->Stats()->nodes(), 0u);
}

TEST_F(Limits, AServerBusyWithAnotherPutsCommitDoesNotCancelAStreamingPut) {
  // One handler thread and one codec thread: while a 64 MiB compact RESIDUAL Put commits (its
  // blocks encoded, seconds), no other call's step runs, so a second Put's next message is not
  // read. Its client sends every 20 ms; the server is the slow one, so it must not be cancelled
  // for --put_idle_timeout_seconds=0.5.
  Start({"--handler_threads=1", "--codec_threads=1", "--put_idle_timeout_seconds=0.5",
         "--learn_predictors=false", "--near_dup_clusters=false"});
  auto streaming = NewClient("b");
  constexpr uint32_t kTinyBlocks = 2000;
  v1::PutResponse response;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto writer = streaming->stub()->Put(&ctx, &response);
  ASSERT_TRUE(writer->Write(TinyHeader(kTinyBlocks)));
  std::atomic<bool> big_done{false};
  absl::Status big_status;
  double big_seconds = 0;
  std::thread big([&] {
    const KvDump d = Prefix(128, 1 << 20, 1, /*layers=*/8, /*finite=*/true);  // 64 MiB
    PutOptions compact;
    compact.encoding = v1::ENCODING_RESIDUAL;
    const auto t0 = std::chrono::steady_clock::now();
    big_status = NewClient("a")->Put(d, compact).status();
    big_seconds = SecondsSince(t0);
    big_done = true;
  });
  uint32_t sent = 0;
  bool ok = true;
  for (; ok && sent < kTinyBlocks && (!big_done || sent < 20); ++sent) {
    ok = writer->Write(TinyBlock(sent));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (; ok && sent < kTinyBlocks; ++sent) ok = writer->Write(TinyBlock(sent));
  v1::PutRequest commit;
  commit.mutable_commit();
  if (ok) ok = writer->Write(commit);
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  big.join();
  std::cout << "64 MiB compact Put took " << big_seconds << " s; the streaming Put sent " << sent
            << " blocks and ended " << s.error_code() << " " << s.error_message() << "\n";
  EXPECT_TRUE(big_status.ok()) << big_status;
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << server_->log();
  EXPECT_EQ(response.blocks_stored(), kTinyBlocks);
  EXPECT_EQ(server_->log().find("idle for"), std::string::npos) << server_->log();
}

TEST_F(Limits, StalledGetsAreCancelledAndTheFolderReturnsUnderItsBound) {
  // A 24 MiB disk budget (folder bound 3 x 24 MiB + 2 MiB = 74 MiB, trie/record_store.h), a 1 MiB
  // hot tier: every Get reads cold payloads in a RocksDB snapshot. Five 16 MiB prefixes, each
  // read by a Get that then stops reading, each Put evicting what the last left: the snapshots
  // keep every evicted payload on disk (the hostile run saw 124 MiB in a folder bounded at
  // 74 MiB). Past --get_idle_timeout_seconds the Gets are cancelled, their snapshots released,
  // and the folder comes back under its bound.
  constexpr uint64_t kBound = 3 * (24ull << 20) + (2ull << 20);
  Start({"--disk_bytes=24MiB", "--memory_bytes=1MiB", "--get_idle_timeout_seconds=3",
         "--learn_predictors=false", "--near_dup_clusters=false"});
  auto a = NewClient("a");
  auto b = NewClient("b");
  ASSERT_TRUE(b->Put(s0_).ok());
  ASSERT_TRUE(b->Pin(s0_.model_id, s0_.token_ids).ok());  // the budget cannot evict it
  PutOptions raw;
  raw.encoding = v1::ENCODING_RAW;
  std::vector<std::unique_ptr<StalledGet>> stalled;
  for (uint32_t k = 0; k < 5; ++k) {
    const KvDump p = Prefix(64, 1000 + k * 100000, k);  // 16 MiB
    absl::StatusOr<v1::PutResponse> put = a->Put(p, raw);
    ASSERT_TRUE(put.ok()) << put.status();
    stalled.push_back(
        std::make_unique<StalledGet>(server_->target(), p, "a", std::chrono::seconds(30)));
    ASSERT_TRUE(stalled.back()->ok) << k;
  }
  uint64_t peak = FolderBytes(data_dir());
  // Another namespace's Gets go on, bit-exact, while the others stall.
  for (int i = 0; i < 3; ++i) {
    const auto g0 = std::chrono::steady_clock::now();
    absl::StatusOr<KvDump> got = b->Get(s0_.model_id, s0_.token_ids);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->k == s0_.k && got->v == s0_.v);
    EXPECT_LT(SecondsSince(g0), 2.0);
    peak = std::max(peak, FolderBytes(data_dir()));
  }
  // The stalled clients read nothing more: within the idle timeout (and a garbage collection)
  // the folder must come back under its bound while they are still connected.
  const auto stalled_at = std::chrono::steady_clock::now();
  uint64_t folder = FolderBytes(data_dir());
  while (SecondsSince(stalled_at) < 15 && (folder > kBound || SecondsSince(stalled_at) < 4)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    folder = FolderBytes(data_dir());
    peak = std::max(peak, folder);
  }
  const double back_after = SecondsSince(stalled_at);
  std::cout << "data folder: peak " << peak << " bytes with the Gets stalled, " << folder
            << " bytes " << back_after << " s later; bound " << kBound << "\n";
  EXPECT_LE(folder, kBound);
  for (size_t i = 0; i < stalled.size(); ++i) {
    const grpc::Status s = stalled[i]->Drain();
    // CANCELLED by the idle cut, or ABORTED earlier by the folder rule (guarded_service.h).
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::CANCELLED ||
                s.error_code() == grpc::StatusCode::ABORTED)
        << i << " " << s.error_code() << " " << s.error_message();
  }
  absl::StatusOr<KvDump> got = b->Get(s0_.model_id, s0_.token_ids);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->k == s0_.k && got->v == s0_.v);
  EXPECT_TRUE(server_->log().find("--get_idle_timeout_seconds") != std::string::npos ||
              server_->log().find("ended ABORTED: the data folder") != std::string::npos);
}

TEST_F(Limits, AGetOlderThanTheSnapshotCapEndsAbortedNamingIt) {
  Start({"--get_max_snapshot_seconds=1", "--memory_bytes=1MiB"});
  auto client = NewClient();
  const KvDump p = Prefix(64, 1000, 3);
  PutOptions raw;
  raw.encoding = v1::ENCODING_RAW;
  ASSERT_TRUE(client->Put(p, raw).ok());
  // A client that reads one message every 100 ms: 65 messages would take 6.5 s.
  StalledGet slow(server_->target(), p, "", std::chrono::seconds(30));
  ASSERT_TRUE(slow.ok);
  const auto t0 = std::chrono::steady_clock::now();
  v1::GetResponse m;
  int read = 0;
  while (slow.reader->Read(&m)) {
    ++read;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  slow.finished = true;
  const grpc::Status s = slow.reader->Finish();
  std::cout << "the slow Get read " << read << " blocks in " << SecondsSince(t0) << " s, then "
            << s.error_code() << " " << s.error_message() << "\n";
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_NE(s.error_message().find("--get_max_snapshot_seconds"), std::string::npos)
      << s.error_message();
  EXPECT_LT(read, 64);
  // A prompt reader is not affected.
  absl::StatusOr<KvDump> got = client->Get(p.model_id, p.token_ids);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->k == p.k && got->v == p.v);
}

TEST_F(Limits, SigtermWithAHundredStalledStreamsExitsWithinTheGrace) {
  // 50 Gets that stopped reading and 50 Puts that stopped sending; a 3 s grace. Before issue 18
  // gRPC's Shutdown waited for them until the deadline and then tore down: the server exited
  // after 3.13-3.18 s here (4.7-5.2 s on a loaded machine). Now they are cancelled when the grace
  // is spent but for a third of it (the teardown's reserve): the exit comes within the grace.
  Start({"--shutdown_grace_seconds=3"});
  auto client = NewClient();
  const KvDump p = Prefix(64, 1000, 5);
  PutOptions raw;
  raw.encoding = v1::ENCODING_RAW;
  ASSERT_TRUE(client->Put(p, raw).ok());
  // Each stream from a client of its own (its own connection), as 100 stalled workers would be.
  std::vector<std::unique_ptr<v1::KVCache::Stub>> put_stubs;
  std::vector<std::unique_ptr<StalledGet>> gets;
  std::vector<std::unique_ptr<StalledPut>> puts;
  for (int i = 0; i < 50; ++i) {
    gets.push_back(
        std::make_unique<StalledGet>(server_->target(), p, "", std::chrono::seconds(60)));
    ASSERT_TRUE(gets.back()->ok) << i;
    put_stubs.push_back(SmallWindowStub(server_->target()));
    puts.push_back(std::make_unique<StalledPut>(put_stubs.back().get(), s0_, "", 1));
    ASSERT_TRUE(puts.back()->ok) << i;
  }
  ASSERT_TRUE(testing::AwaitPutStreams(client.get(), 50));
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = server_->Stop();
  const double seconds = SecondsSince(t0);
  std::cout << "SIGTERM with 100 stalled streams: exit " << rc << " after " << seconds
            << " s (grace 3 s)\n";
  EXPECT_EQ(rc, 0) << server_->log();
  EXPECT_LT(seconds, 3.0) << server_->log();
}

TEST_F(Limits, OnePeerCannotHoldEveryPutStreamSlot) {
  // 4 slots, so one peer may hold 2 (--max_put_stream_share_per_peer=0.5, the default). The
  // server listens on [::]: a client of 127.0.0.1 and one of [::1] are two hosts.
  Start({"--listen=[::]:0", "--max_concurrent_put_streams=4"});
  auto greedy = NewClient();
  std::vector<std::unique_ptr<StalledPut>> held;
  for (int i = 0; i < 2; ++i) {
    held.push_back(std::make_unique<StalledPut>(greedy->stub(), s0_, "", 1));
    ASSERT_TRUE(held.back()->ok) << i;
  }
  ASSERT_TRUE(testing::AwaitPutStreams(greedy.get(), 2));
  {
    StalledPut third(greedy->stub(), s0_, "", 0);
    const grpc::Status s = third.Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("--max_put_stream_share_per_peer"), std::string::npos)
        << s.error_message();
  }
  // Another host still gets a slot.
  auto other = NewClient("", "[::1]:" + std::to_string(server_->port()));
  absl::StatusOr<v1::PutResponse> put = other->Put(s1_);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_GT(put->blocks_stored(), 0u);
  // A slot the first host gives back is its own again.
  EXPECT_EQ(held.back()->Cancel().error_code(), grpc::StatusCode::CANCELLED);
  held.pop_back();
  absl::StatusOr<v1::PutResponse> again = greedy->Put(s0_);
  for (int i = 0; i < 40 && absl::IsResourceExhausted(again.status()); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the cancel is asynchronous
    again = greedy->Put(s0_);
  }
  EXPECT_TRUE(again.ok()) << again.status();
}

}  // namespace
}  // namespace kvtrie
