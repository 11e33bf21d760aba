// End-to-end tests of the callback API (issue 10: streams do not hold threads), each against a
// real kvtrie-server: many more open Put streams than gRPC sync threads, a Put cancelled
// mid-stream or while it waits for memory releases what it holds, and a Get whose client stops
// reading does not hold up other Gets. Thread counts are read from /proc/PID/status.
#include <grpcpp/grpcpp.h>

#include <chrono>
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

constexpr uint64_t kBlockBytes = 5 * 2 * 4 * 16 * 8 * 2;  // one fp16 block of stories260K

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

using testing::StalledPut;

class CallbackE2E : public ::testing::Test {
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
  void Start(const std::vector<std::string>& flags, const std::string& data = "data") {
    server_.reset();
    absl::StatusOr<std::unique_ptr<ServerProcess>> s =
        ServerProcess::Start(test_dir_ + "/" + data, flags);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }
  std::unique_ptr<Client> NewClient(const std::string& ns = "") {
    return Client::Create({.target = server_->target(), .ns = ns});
  }
  // `d` with token ids of its own (nothing deduplicated against another copy).
  KvDump Shifted(const KvDump& d, int k) {
    KvDump out = d;
    for (auto& t : out.token_ids) t += 100000 * k;
    return out;
  }

  std::string test_dir_;
  std::unique_ptr<ServerProcess> server_;
  KvDump s0_, s1_;
};

TEST_F(CallbackE2E, SixtyFourStalledPutStreamsHoldNoThreadsAndAnotherPutAndGetGoThrough) {
  // --max_threads=16: gRPC's sync server would run each stream on one of 16 threads and refuse
  // the 17th call with RESOURCE_EXHAUSTED; reactors hold no thread while their client stalls.
  Start({"--max_threads=16", "--put_idle_timeout_seconds=0", "--codec_threads=2"});
  auto client = NewClient();
  ASSERT_TRUE(client->Stats().ok());
  const int threads_before = testing::ThreadCount(server_->pid());
  std::vector<std::unique_ptr<StalledPut>> streams;
  for (int i = 0; i < 64; ++i) {
    streams.push_back(std::make_unique<StalledPut>(client->stub(), Shifted(s0_, i + 1), "", 1));
    ASSERT_TRUE(streams.back()->ok) << "stream " << i;
  }
  ASSERT_TRUE(testing::AwaitPutStreams(client.get(), 64));  // every header read
  const int threads_64 = testing::ThreadCount(server_->pid());
  std::cout << "server threads: " << threads_before << " idle, " << threads_64
            << " with 64 stalled Put streams\n";
  EXPECT_LE(threads_64, threads_before + 8);
  // A 65th client's Put and Get.
  const auto t0 = std::chrono::steady_clock::now();
  auto other = NewClient();
  absl::StatusOr<v1::PutResponse> put = other->Put(s1_);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->blocks_stored(), 32u);
  absl::StatusOr<KvDump> got = other->Get(s1_.model_id, s1_.token_ids);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->token_ids.size(), put->stored_tokens());
  EXPECT_LT(SecondsSince(t0), 5.0);
  // Each stalled stream was being served (not refused): ended without a commit, it is told so.
  int served = 0;
  for (auto& s : streams) {
    const grpc::Status st = s->Finish();
    served += st.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
              st.error_message().find("without a PutCommit") != std::string::npos;
  }
  EXPECT_EQ(served, 64);
  EXPECT_EQ(client->Stats()->nodes(), 32u);  // only the committed Put stored anything
}

TEST_F(CallbackE2E, APutCancelledMidStreamOrWhileWaitingForMemoryReleasesWhatItHolds) {
  // 40 blocks of in-flight budget; s0 and s1 reserve their 32 blocks at their header.
  Start({"--put_idle_timeout_seconds=0", "--put_wait_for_memory_seconds=30",
         "--max_inflight_put_bytes=" + std::to_string(40 * kBlockBytes)});
  auto client = NewClient();
  auto holder = std::make_unique<StalledPut>(client->stub(), s0_, "", 5);  // mid-stream
  ASSERT_TRUE(holder->ok);
  ASSERT_TRUE(testing::AwaitPutStreams(client.get(), 1, 32 * kBlockBytes));
  // s1 waits at its header for memory (no thread waits); its client gives up.
  StalledPut waiter(client->stub(), Shifted(s1_, 1), "", 0);
  ASSERT_TRUE(waiter.ok);
  ASSERT_TRUE(testing::AwaitPutStreams(client.get(), 2, 32 * kBlockBytes));  // it waits
  auto t0 = std::chrono::steady_clock::now();
  grpc::Status w = waiter.Cancel();
  EXPECT_EQ(w.error_code(), grpc::StatusCode::CANCELLED) << w.error_message();
  EXPECT_LT(SecondsSince(t0), 5.0);
  // The holder's client cancels mid-Put: its 32 blocks are released, so another Put of 32 fits now.
  t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(holder->Cancel().error_code(), grpc::StatusCode::CANCELLED);
  absl::StatusOr<v1::PutResponse> r = NewClient()->Put(s1_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->blocks_stored(), 32u);
  EXPECT_LT(SecondsSince(t0), 5.0);  // it did not wait out another's reservation
  EXPECT_EQ(client->Stats()->nodes(), 32u);
  // Nothing is left reserved: two Puts of 32 blocks in turn, in a budget of 40, with no wait.
  holder.reset();
  Start({"--put_idle_timeout_seconds=0", "--put_wait_for_memory_seconds=0",
         "--max_inflight_put_bytes=" + std::to_string(40 * kBlockBytes)},
        "data2");
  auto c2 = NewClient();
  {
    StalledPut cancelled(c2->stub(), s0_, "", 3);
    ASSERT_TRUE(cancelled.ok);
    ASSERT_TRUE(testing::AwaitPutStreams(c2.get(), 1, 32 * kBlockBytes));
    EXPECT_EQ(cancelled.Cancel().error_code(), grpc::StatusCode::CANCELLED);
  }
  absl::StatusOr<v1::PutResponse> again = c2->Put(s0_);
  for (int i = 0; i < 40 && absl::IsResourceExhausted(again.status()); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the cancel is asynchronous
    again = c2->Put(s0_);
  }
  ASSERT_TRUE(again.ok()) << again.status();
}

// A RAW prefix of `blocks` blocks of 256 KiB (4 layers, 8 heads, head_dim 128) of random fp16
// bits (plumbing only: nothing is compressed).
KvDump BigRawPrefix(int blocks) {
  KvDump d;
  d.model_id = "big";
  d.num_layers = 4;
  d.num_kv_heads = 8;
  d.head_dim = 128;
  d.dtype = DType::kFp16;
  const size_t tokens = 16 * static_cast<size_t>(blocks);
  for (size_t t = 0; t < tokens; ++t) d.token_ids.push_back(static_cast<uint32_t>(t + 7));
  d.surprisal_bits.assign(tokens, 1.0f);
  const size_t n = static_cast<size_t>(d.num_layers) * d.num_kv_heads * tokens * d.head_dim * 2;
  std::mt19937 rng(7);
  d.k.resize(n);
  d.v.resize(n);
  for (auto& b : d.k) b = static_cast<uint8_t>(rng());
  for (auto& b : d.v) b = static_cast<uint8_t>(rng());
  return d;
}

TEST_F(CallbackE2E, AGetWhoseClientStopsReadingDoesNotHoldUpOtherGets) {
  Start({"--max_threads=16", "--codec_threads=2"});
  const KvDump big = BigRawPrefix(64);  // 16 MiB: more than the flow-control windows
  auto client = NewClient();
  PutOptions raw;
  raw.encoding = v1::ENCODING_RAW;
  ASSERT_TRUE(client->Put(big, raw).ok());
  const int threads_before = testing::ThreadCount(server_->pid());
  // 64 Gets whose clients read the header and then stop.
  v1::GetRequest request;
  request.set_model_id(big.model_id);
  request.mutable_token_ids()->Add(big.token_ids.begin(), big.token_ids.end());
  struct Stalled {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::GetResponse>> reader;
  };
  std::vector<std::unique_ptr<Stalled>> stalled;
  for (int i = 0; i < 64; ++i) {
    auto s = std::make_unique<Stalled>();
    s->reader = client->stub()->Get(&s->ctx, request);
    v1::GetResponse first;
    ASSERT_TRUE(s->reader->Read(&first)) << i;
    ASSERT_EQ(first.header().matched_blocks(), 64u);
    stalled.push_back(std::move(s));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int threads_64 = testing::ThreadCount(server_->pid());
  std::cout << "server threads: " << threads_before << " idle, " << threads_64
            << " with 64 Gets not read\n";
  EXPECT_LE(threads_64, threads_before + 8);
  // Other clients' Gets of the same prefix complete, bit-exact.
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<KvDump> got = NewClient()->Get(big.model_id, big.token_ids);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->k == big.k && got->v == big.v);
  }
  EXPECT_LT(SecondsSince(t0), 10.0);
  // The stalled ones, cancelled, end; the server stays up.
  for (auto& s : stalled) {
    s->ctx.TryCancel();
    EXPECT_EQ(s->reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  stalled.clear();
  EXPECT_TRUE(client->Stats().ok());
}

}  // namespace
}  // namespace kvtrie
