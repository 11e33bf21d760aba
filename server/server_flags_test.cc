// The server's flags bound to the options they fill (server/store_flags.h,
// server/service_flags.h, server/ops_flags.h): values parsed as on the command line, validation
// errors that name the flag, and defaults that are the fast safe path.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/ops_flags.h"
#include "server/service_flags.h"
#include "server/store_flags.h"
#include "trie/record_store.h"

namespace kvtrie {
namespace {

// Sets --name=value the way the command line and the config file do (the flag's own parser).
void Set(const std::string& name, const std::string& value) {
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  ASSERT_NE(flag, nullptr) << "--" << name << " is not a flag";
  std::string error;
  ASSERT_TRUE(flag->ParseFrom(value, &error)) << "--" << name << "=" << value << ": " << error;
}

class ServerFlagsTest : public ::testing::Test {
  absl::FlagSaver saver_;  // every test starts from the defaults and leaves them
};

TEST_F(ServerFlagsTest, DefaultsAreTheFastSafePath) {
  absl::StatusOr<StoreOptions> store = StoreOptionsFromFlags();
  ASSERT_TRUE(store.ok()) << store.status();
  // Client-encoded blocks: every structure checked and one block in 8 decoded (not every block,
  // not none); the codec on every core; near-duplicates and learned predictors on.
  EXPECT_EQ(store->verify_encoded_puts, VerifyEncoded::kSample);
  EXPECT_EQ(store->codec_threads,
            static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  EXPECT_FALSE(store->sync);
  EXPECT_TRUE(store->near_dup.enabled);
  EXPECT_TRUE(store->predictors.learn);
  EXPECT_EQ(store->cluster_pass_interval_ms, 1000u);
  EXPECT_EQ(store->memory_bytes, 1ull << 30);
  EXPECT_EQ(store->disk_bytes, 0u);
  // A Put's own bound is the store's; the bound on all Puts together is the service's only.
  EXPECT_EQ(store->max_put_bytes, 256ull << 20);
  EXPECT_EQ(store->max_inflight_put_bytes, std::numeric_limits<uint64_t>::max());

  absl::StatusOr<ServingOptions> serving = ServingOptionsFromFlags(*store);
  ASSERT_TRUE(serving.ok()) << serving.status();
  const ServiceOptions& s = serving->service;
  EXPECT_EQ(s.default_encoding.encoding, Encoding::kLossless);  // bit-exact unless asked
  EXPECT_EQ(s.codec_threads, store->codec_threads);
  EXPECT_EQ(s.max_tokens, 1u << 20);
  // Every Put stream is bounded: slots, a share per peer, bytes in flight, an idle deadline.
  const PutLimitOptions& put = s.put_limits;
  EXPECT_EQ(put.max_concurrent_streams, 256u);
  EXPECT_EQ(put.max_streams_per_peer, 128u);
  EXPECT_EQ(put.max_inflight_bytes, 2ull << 30);
  EXPECT_EQ(put.max_inflight_bytes_per_namespace, 1ull << 30);
  EXPECT_EQ(put.max_put_bytes, store->max_put_bytes);
  EXPECT_EQ(put.idle_timeout, absl::Seconds(60));
  EXPECT_EQ(put.admit_wait, absl::Seconds(60));
  // One request of --max_tokens packed ids fits a message; gRPC reads more, so kvtrie names it.
  EXPECT_EQ(s.max_message_bytes, 4ull * (1u << 20) + (64u << 10));
  EXPECT_EQ(serving->grpc_receive_cap, 64 << 20);  // at least 64 MiB and 4 x the limit
  const GuardedServiceOptions& g = serving->guarded;
  EXPECT_EQ(g.max_message_bytes, s.max_message_bytes);
  EXPECT_EQ(g.handler_threads, std::max(8, 2 * store->codec_threads));
  EXPECT_EQ(g.get_idle_timeout, absl::Seconds(60));
  EXPECT_EQ(g.get_max_snapshot_age, absl::Seconds(300));
  EXPECT_EQ(g.get_cut_folder_bytes, 0u);  // no --disk_bytes: no folder rule

  const OpsFlags ops = ReadOpsFlags();
  EXPECT_EQ(ops.listen, "127.0.0.1:50051");  // loopback unless told
  EXPECT_EQ(ops.max_threads, 512);
  EXPECT_EQ(ops.shutdown_grace_seconds, 10);
  EXPECT_EQ(ops.log_level, "info");
  EXPECT_EQ(ops.log_format, "text");
  EXPECT_TRUE(ops.tls.cert_file.empty());
  EXPECT_TRUE(ops.tokens_file.empty());
}

TEST_F(ServerFlagsTest, ValuesReachTheirOptions) {
  Set("data_dir", "/tmp/x");
  Set("max_put_bytes", "64MiB");
  Set("max_inflight_put_bytes", "3GiB");
  Set("max_inflight_put_bytes_per_namespace", "100MB");
  Set("codec_threads", "5");
  Set("disk_bytes", "1GB");
  Set("verify_encoded_puts", "all");
  Set("cluster_ngram_tokens", "7");
  Set("cluster_pass_blocks_per_round", "0");  // at least one
  Set("predictor_memory_bytes", "2KiB");
  Set("default_encoding", "residual");
  Set("default_target_rel_rms", "0.05");
  Set("max_tokens", "1000");
  Set("max_put_stream_share_per_peer", "1");
  Set("put_idle_timeout_seconds", "-3");  // negative: never
  Set("get_max_snapshot_seconds", "2.5");
  Set("listen", "0.0.0.0:0");
  Set("shutdown_grace_seconds", "3");

  absl::StatusOr<StoreOptions> store = StoreOptionsFromFlags();
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(store->data_dir, "/tmp/x");
  EXPECT_EQ(store->max_put_bytes, 64ull << 20);
  EXPECT_EQ(store->max_inflight_put_bytes, std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(store->codec_threads, 5);
  EXPECT_EQ(store->disk_bytes, 1000000000u);
  EXPECT_EQ(store->verify_encoded_puts, VerifyEncoded::kAll);
  EXPECT_EQ(store->near_dup.ngram_tokens, 7u);
  EXPECT_EQ(store->cluster_pass_blocks_per_round, 1u);
  EXPECT_EQ(store->predictors.memory_bytes, 2048u);

  absl::StatusOr<ServingOptions> serving = ServingOptionsFromFlags(*store);
  ASSERT_TRUE(serving.ok()) << serving.status();
  const ServiceOptions& s = serving->service;
  EXPECT_EQ(s.default_encoding.encoding, Encoding::kResidual);
  EXPECT_DOUBLE_EQ(s.default_encoding.target_rel_rms, 0.05);
  EXPECT_EQ(s.codec_threads, 5);
  EXPECT_EQ(s.put_limits.max_inflight_bytes, 3ull << 30);
  EXPECT_EQ(s.put_limits.max_inflight_bytes_per_namespace, 100000000u);
  EXPECT_EQ(s.put_limits.max_put_bytes, 64ull << 20);
  EXPECT_EQ(s.put_limits.max_streams_per_peer, 0u);  // share 1: no per-peer bound
  EXPECT_EQ(s.put_limits.idle_timeout, absl::ZeroDuration());
  EXPECT_EQ(s.max_message_bytes, 4u << 20);  // at least 4 MiB
  EXPECT_EQ(serving->grpc_receive_cap, 64 << 20);
  EXPECT_EQ(serving->guarded.handler_threads, 10);
  EXPECT_EQ(serving->guarded.get_max_snapshot_age, absl::Milliseconds(2500));
  EXPECT_GT(serving->guarded.folder_bound_bytes, 0u);
  EXPECT_EQ(serving->guarded.get_cut_folder_bytes, 2000000000u + RecordStore::kFolderSlackBytes);

  const OpsFlags ops = ReadOpsFlags();
  EXPECT_EQ(ops.listen, "0.0.0.0:0");
  EXPECT_EQ(ops.shutdown_grace_seconds, 3);
}

TEST_F(ServerFlagsTest, ByteSizesParseWithUnitsAndRefuseOthers) {
  Set("memory_bytes", "1.5GiB");
  absl::StatusOr<StoreOptions> store = StoreOptionsFromFlags();
  ASSERT_TRUE(store.ok());
  EXPECT_EQ(store->memory_bytes, 3ull << 29);
  std::string error;
  EXPECT_FALSE(absl::FindCommandLineFlag("memory_bytes")->ParseFrom("12 parsecs", &error));
  EXPECT_FALSE(error.empty());
}

// Each validation error is INVALID_ARGUMENT and names the flag to fix.
void ExpectStoreError(const std::string& flag, const std::string& value) {
  absl::FlagSaver saver;
  Set(flag, value);
  absl::StatusOr<StoreOptions> store = StoreOptionsFromFlags();
  ASSERT_FALSE(store.ok()) << "--" << flag << "=" << value;
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(store.status().message(), "--" + flag)) << store.status();
}

void ExpectServingError(const std::string& flag, const std::string& value) {
  absl::FlagSaver saver;
  Set(flag, value);
  absl::StatusOr<StoreOptions> store = StoreOptionsFromFlags();
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<ServingOptions> serving = ServingOptionsFromFlags(*store);
  ASSERT_FALSE(serving.ok()) << "--" << flag << "=" << value;
  EXPECT_EQ(serving.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(serving.status().message(), "--" + flag)) << serving.status();
}

TEST_F(ServerFlagsTest, ValidationErrorsNameTheFlag) {
  ExpectStoreError("verify_encoded_puts", "some");
  ExpectStoreError("cluster_ngram_tokens", "0");
  ExpectStoreError("cluster_ngram_stride", "0");
  ExpectServingError("default_encoding", "zip");
  ExpectServingError("max_put_stream_share_per_peer", "0");
  ExpectServingError("max_put_stream_share_per_peer", "1.5");
  ExpectServingError("max_put_stream_share_per_peer", "nan");
}

// --help and the logged effective configuration list the flags of these three files.
TEST_F(ServerFlagsTest, EachFlagIsDefinedBesideItsOptions) {
  for (const char* name : {"data_dir", "max_put_bytes", "memory_bytes", "learn_predictors"}) {
    EXPECT_TRUE(
        absl::StrContains(absl::FindCommandLineFlag(name)->Filename(), "server/store_flags.cc"))
        << name;
  }
  for (const char* name : {"max_inflight_put_bytes", "max_tokens", "handler_threads"}) {
    EXPECT_TRUE(
        absl::StrContains(absl::FindCommandLineFlag(name)->Filename(), "server/service_flags.cc"))
        << name;
  }
  for (const char* name : {"listen", "port_file", "log_level", "tokens_file"}) {
    EXPECT_TRUE(
        absl::StrContains(absl::FindCommandLineFlag(name)->Filename(), "server/ops_flags.cc"))
        << name;
  }
}

}  // namespace
}  // namespace kvtrie
