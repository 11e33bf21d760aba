// kvtrie-server: the kvtrie.v1.KVCache gRPC service over an embedded RocksDB.
//
//   kvtrie-server --listen=127.0.0.1:50051 --data_dir=./kvtrie-data
//
// Serves grpc.health.v1.Health (status SERVING for "" and "kvtrie.v1.KVCache") and server
// reflection (v1alpha, what gRPC 1.51 ships), so grpcurl can list, describe and call it.
// If the store fails (a write to disk failed; it then refuses writes), health turns NOT_SERVING.
// SIGTERM or SIGINT: health turns NOT_SERVING, calls already sent are read for 200 ms more,
// then new calls are refused; running calls get --shutdown_grace_seconds (from the signal), less
// a reserve for the teardown, to finish and are then cancelled (streams whose clients stalled
// too), the store is flushed and closed, and the process exits 0 within the grace.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.pb.h"
#include "server/auth.h"
#include "server/byte_size.h"
#include "server/config.h"
#include "server/guarded_service.h"
#include "server/kvcache_service.h"
#include "server/metrics.h"
#include "server/ops_flags.h"
#include "server/parse_failure_interceptor.h"
#include "server/tls.h"
#include "trie/kv_store.h"
#include "trie/record_store.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "HOST:PORT to serve gRPC on; port 0 picks a free port (see --port_file)");
ABSL_FLAG(std::string, data_dir, "./kvtrie-data",
          "folder of the embedded RocksDB (created if missing)");
ABSL_FLAG(bool, sync, false,
          "fsync RocksDB's write-ahead log before acknowledging a Put (survives machine "
          "crashes, not only process crashes)");
ABSL_FLAG(std::string, default_encoding, "lossless",
          "encoding of Puts that name none: raw, lossless, residual, int8, kivi2 or turboquant");
ABSL_FLAG(double, default_target_rel_rms, 0.1,
          "relative RMS error target of residual Puts that name none");
ABSL_FLAG(uint32_t, max_tokens, 1u << 20, "most token ids one request may carry");
ABSL_FLAG(
    kvtrie::ByteSize, max_inflight_put_bytes, kvtrie::ByteSize{2ull << 30},
    "most dense KV bytes all unfinished Put streams together may buffer" KVTRIE_BYTE_UNITS_HELP);
ABSL_FLAG(
    kvtrie::ByteSize, max_put_bytes, kvtrie::ByteSize{256ull << 20},
    "most dense KV bytes one Put stream may buffer before it is committed" KVTRIE_BYTE_UNITS_HELP);
ABSL_FLAG(int, codec_threads, 0,
          "threads of the codec: they encode Put blocks as they arrive, while the stream goes on "
          "(RAW and the fast profile; compact-profile blocks are encoded at the commit), and "
          "decode the next blocks of a RECONSTRUCTED Get while the current ones are sent; 0 = one "
          "per core");
ABSL_FLAG(std::string, verify_encoded_puts, "sample",
          "how much of a block a client encoded itself (PutBlock.encoded) the server checks: "
          "structure (CRC, geometry, dtype, encoding, predictor version and fingerprint, every "
          "length and lane bound, without decoding), sample (and decode one block in 8, drawn per "
          "Put, checking its content checksum) or all (and decode every block)");
ABSL_FLAG(
    kvtrie::ByteSize, max_get_message_bytes, kvtrie::ByteSize{1u << 20},
    "Get splits a block by layer ranges so no message is larger than this (GetPredictor sends "
    "chunks of this size)" KVTRIE_BYTE_UNITS_HELP);
// Put streams (issue 12): server/put_limits.h.
ABSL_FLAG(double, put_idle_timeout_seconds, 60,
          "a Put stream whose server waits this long for its next message is cancelled and its "
          "buffered bytes released; time the server spends on a message (or waiting for a "
          "handler thread or memory) does not count (0 = never)");
ABSL_FLAG(double, put_wait_for_memory_seconds, 60,
          "a Put whose dense KV does not fit --max_inflight_put_bytes (or its namespace's share) "
          "now waits this long at its header for other Puts to finish, then is refused with "
          "RESOURCE_EXHAUSTED (0 = refuse at once)");
ABSL_FLAG(uint32_t, max_concurrent_put_streams, 256,
          "most Put streams open at once; more are refused with RESOURCE_EXHAUSTED (0 = no "
          "bound); an open stream holds no thread, but its slot and buffered bytes");
ABSL_FLAG(double, max_put_stream_share_per_peer, 0.5,
          "most share of --max_concurrent_put_streams one peer may hold (a tenant with "
          "--tokens_file, else a client host), so one client cannot starve the rest; past it "
          "RESOURCE_EXHAUSTED (1 = no per-peer bound: behind a proxy every client is one host)");
// Get streams (issue 18): server/guarded_service.h.
ABSL_FLAG(double, get_idle_timeout_seconds, 60,
          "a Get (or GetPredictor) stream whose client reads nothing for this long is cancelled "
          "and its store snapshot released (0 = never)");
ABSL_FLAG(double, get_max_snapshot_seconds, 300,
          "a Get stream open longer than this ends ABORTED naming this flag: its store snapshot "
          "keeps every payload deleted or evicted since it began on disk, past --disk_bytes "
          "(0 = never)");
ABSL_FLAG(kvtrie::ByteSize, max_inflight_put_bytes_per_namespace, kvtrie::ByteSize{1ull << 30},
          "most dense KV bytes one namespace's unfinished Put streams together may buffer "
          "(0 = only --max_inflight_put_bytes)" KVTRIE_BYTE_UNITS_HELP);
ABSL_FLAG(int, max_threads, 512,
          "most threads gRPC's synchronous server may run calls on (only server reflection is "
          "served so; the KVCache calls use the callback API and --handler_threads); calls past "
          "it are refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(int, handler_threads, 0,
          "threads that run the KVCache calls' work (parsing, the store, a Put's commit, a Get's "
          "decoding on its chain); open streams waiting for their client hold none; 0 = twice "
          "the codec threads, at least 8");
ABSL_FLAG(int, shutdown_grace_seconds, 10,
          "on SIGTERM, how long until the process exits: running calls may take this long, less "
          "a reserve for the teardown (a third of it, at most 1 s), before they are cancelled");
ABSL_FLAG(std::string, port_file, "",
          "if set, write the bound port to this file once serving (for tests and scripts)");
ABSL_FLAG(kvtrie::ByteSize, memory_bytes, kvtrie::ByteSize{1ull << 30},
          "hot tier: most payload bytes kept in memory; colder ones are read from "
          "RocksDB" KVTRIE_BYTE_UNITS_HELP);
ABSL_FLAG(kvtrie::ByteSize, disk_bytes, kvtrie::ByteSize{0},
          "cold tier: most payload bytes kept in RocksDB; past it the least valuable "
          "leaves are evicted (0 = unbounded)" KVTRIE_BYTE_UNITS_HELP);
ABSL_FLAG(
    kvtrie::ByteSize, memtable_bytes, kvtrie::ByteSize{32ull << 20},
    "RocksDB write buffer for payloads (two may be in memory at once)" KVTRIE_BYTE_UNITS_HELP);
ABSL_FLAG(bool, verify_on_start, false,
          "read and checksum every payload at start (slow); otherwise each is checked when read");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off");
ABSL_FLAG(bool, near_dup_clusters, true,
          "store near-duplicate blocks (same tokens at the same depth, other history) as "
          "residuals of a centroid block when that is smaller");
ABSL_FLAG(double, cluster_max_distance_bits, kvtrie::NearDupOptions().max_distance_bits,
          "near-duplicate candidates farther than this trie distance (bits of the two histories "
          "not shared) are not tried");
ABSL_FLAG(uint32_t, cluster_pass_interval_ms, 1000,
          "every this many ms a background pass (nice 10) codes standalone near-duplicates "
          "(client-encoded Puts) against their group's most probable member and moves lossless "
          "clusters to it; 0 = off");
ABSL_FLAG(uint32_t, cluster_pass_blocks_per_round, 64,
          "blocks the background cluster pass encodes per round at most (all models together)");
ABSL_FLAG(bool, learn_predictors, true,
          "learn a predictor state per (namespace, model) from the stored blocks in the background "
          "and code new RESIDUAL blocks against its latest version (README \"Learned predictor "
          "states\"); a RESIDUAL Get then needs GetPredictor to decode.");
ABSL_FLAG(uint64_t, predictor_refit_tokens, kvtrie::PredictorOptions().refit_every_tokens,
          "fit and publish a new predictor state version after this many new tokens were learned "
          "from (per namespace and model).");
ABSL_FLAG(kvtrie::ByteSize, predictor_memory_bytes,
          kvtrie::ByteSize{kvtrie::PredictorOptions().memory_bytes},
          "memory budget of one (namespace, model)'s learner and the state it "
          "fits" KVTRIE_BYTE_UNITS_HELP);
ABSL_FLAG(bool, predictor_cross_layer, kvtrie::PredictorOptions().cross_layer,
          "also fit cross-layer ridge predictors and per-plane decorrelating transforms into the "
          "learned states: about 2 % fewer bits for RESIDUAL fast blocks, at a quarter of the "
          "encode speed (bench/learned.md)");
ABSL_FLAG(kvtrie::ByteSize, put_parent_cache_bytes,
          kvtrie::ByteSize{kvtrie::StoreOptions().put_parent_cache_bytes},
          "the whole server's bound on reconstructions of the last block of recent "
          "compact-profile Puts kept in memory (on top of --memory_bytes), so a Put that "
          "continues one predicts from it without decoding (and reading from disk) the stored "
          "prefix again; 0 = none" KVTRIE_BYTE_UNITS_HELP);
ABSL_FLAG(kvtrie::ByteSize, learn_queue_bytes,
          kvtrie::ByteSize{kvtrie::PredictorOptions().queue_bytes},
          "KV bytes waiting to be learned from, all models together (a block its client encoded "
          "counts at its dense size: the learner decodes it); each Put's new blocks are sampled "
          "across the whole Put, as many as fit, the rest not learned from (Stats "
          "predictor_observations_dropped)" KVTRIE_BYTE_UNITS_HELP);
ABSL_FLAG(bool, cluster_position_shifted, true,
          "store position-shifted near-duplicates (the same text at another position) "
          "as residuals of a centroid whose keys are turned by RoPE to the offset, when smaller");
ABSL_FLAG(bool, cluster_ngram_index, kvtrie::NearDupOptions().ngram_index,
          "find position-shifted near-duplicates at any shift (an inserted clause, sentence or "
          "block) through an index of token n-gram hashes per model; false: only shifts within "
          "half a block");
ABSL_FLAG(bool, cluster_retain_deleted_centroids, kvtrie::NearDupOptions().retain_lossy_centroids,
          "a Delete keeps a deleted centroid that near-duplicates are coded lossy against, unnamed "
          "(no lookup matches it), until its last member goes: the namespace's bytes stay as "
          "they were; false: its members elect a new centroid and are all stored again "
          "bit-exact (losslessly), so the deleted KV leaves at once but the bytes grow ~3x");
ABSL_FLAG(bool, delete_erases, false,
          "every Delete erases (as DeleteRequest.erase): no deleted centroid is retained (its "
          "lossy members are re-coded bit-exact against their own reconstructions) and the "
          "database is flushed and compacted, so nothing of the deleted blocks stays on disk");
ABSL_FLAG(uint32_t, cluster_ngram_tokens, kvtrie::NearDupOptions().ngram_tokens,
          "tokens per window of the n-gram index (at most half a block is used)");
ABSL_FLAG(uint32_t, cluster_ngram_stride, kvtrie::NearDupOptions().ngram_stride,
          "the n-gram index keeps a node's windows every this many offsets (fewer entries; "
          "lowered where a larger one could miss a block that repeats stored text)");
ABSL_FLAG(uint32_t, cluster_ngram_max_per_hash, kvtrie::NearDupOptions().ngram_max_per_hash,
          "entries kept per n-gram hash, the oldest (0 = no cap): bounds the index on "
          "repetitive text");

namespace kvtrie {
namespace {

constexpr char kServiceName[] = "kvtrie.v1.KVCache";

absl::StatusOr<Encoding> ParseEncoding(const std::string& name) {
  for (uint32_t v = 1; IsValidEncoding(v); ++v) {
    if (EncodingName(static_cast<Encoding>(v)) == name) return static_cast<Encoding>(v);
  }
  return absl::InvalidArgumentError(absl::StrCat("--default_encoding: unknown '", name, "'"));
}

// Flags of kvtrie-server itself (for --help and the effective configuration).
bool IsServerFlagFile(absl::string_view file) {
  return absl::StrContains(file, "server/main.cc") ||
         absl::StrContains(file, "server/ops_flags.cc");
}

void WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << port << "\n";
  std::rename(tmp.c_str(), path.c_str());  // appears whole or not at all
}

int Run() {
  const OpsFlags ops = ReadOpsFlags();
  // Logs go to stderr (stdout stays free), as text or JSON lines.
  if (absl::Status s = SetUpLogging(ops.log_format, absl::GetFlag(FLAGS_log_level)); !s.ok()) {
    std::fprintf(stderr, "kvtrie-server: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  spdlog::info("effective configuration: {}", EffectiveConfig(IsServerFlagFile));
  // Link the health protocol's descriptors so reflection can describe grpc.health.v1.Health
  // (gRPC 1.51's built-in health service does not register them).
  grpc::health::v1::HealthCheckRequest::descriptor();

  // Handle SIGTERM/SIGINT on one thread: block them before gRPC starts its threads.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);  // reloads the tokens file
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<Encoding> encoding = ParseEncoding(absl::GetFlag(FLAGS_default_encoding));
  if (!encoding.ok()) {
    spdlog::critical("{}", std::string(encoding.status().message()));
    return 2;
  }
  StoreOptions store_options;
  if (const std::string v = absl::GetFlag(FLAGS_verify_encoded_puts); v == "structure") {
    store_options.verify_encoded_puts = VerifyEncoded::kStructure;
  } else if (v == "sample") {
    store_options.verify_encoded_puts = VerifyEncoded::kSample;
  } else if (v == "all") {
    store_options.verify_encoded_puts = VerifyEncoded::kAll;
  } else {
    spdlog::critical("--verify_encoded_puts: '{}'; use structure, sample or all", v);
    return 2;
  }
  store_options.data_dir = absl::GetFlag(FLAGS_data_dir);
  store_options.sync = absl::GetFlag(FLAGS_sync);
  store_options.max_put_bytes = absl::GetFlag(FLAGS_max_put_bytes).bytes;
  store_options.max_inflight_put_bytes = absl::GetFlag(FLAGS_max_inflight_put_bytes).bytes;
  const int codec_threads =
      absl::GetFlag(FLAGS_codec_threads) > 0
          ? absl::GetFlag(FLAGS_codec_threads)
          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  store_options.codec_threads = codec_threads;
  store_options.memory_bytes = absl::GetFlag(FLAGS_memory_bytes).bytes;
  store_options.disk_bytes = absl::GetFlag(FLAGS_disk_bytes).bytes;
  store_options.memtable_bytes = absl::GetFlag(FLAGS_memtable_bytes).bytes;
  store_options.verify_payloads_on_open = absl::GetFlag(FLAGS_verify_on_start);
  store_options.near_dup.enabled = absl::GetFlag(FLAGS_near_dup_clusters);
  store_options.near_dup.max_distance_bits = absl::GetFlag(FLAGS_cluster_max_distance_bits);
  store_options.predictors.learn = absl::GetFlag(FLAGS_learn_predictors);
  store_options.predictors.refit_every_tokens = absl::GetFlag(FLAGS_predictor_refit_tokens);
  store_options.predictors.memory_bytes = absl::GetFlag(FLAGS_predictor_memory_bytes).bytes;
  store_options.predictors.cross_layer = absl::GetFlag(FLAGS_predictor_cross_layer);
  store_options.predictors.queue_bytes = absl::GetFlag(FLAGS_learn_queue_bytes).bytes;
  store_options.put_parent_cache_bytes = absl::GetFlag(FLAGS_put_parent_cache_bytes).bytes;
  store_options.near_dup.position_shifted = absl::GetFlag(FLAGS_cluster_position_shifted);
  store_options.near_dup.ngram_index = absl::GetFlag(FLAGS_cluster_ngram_index);
  store_options.near_dup.retain_lossy_centroids =
      absl::GetFlag(FLAGS_cluster_retain_deleted_centroids);
  store_options.delete_erases = absl::GetFlag(FLAGS_delete_erases);
  store_options.near_dup.ngram_tokens = absl::GetFlag(FLAGS_cluster_ngram_tokens);
  store_options.near_dup.ngram_stride = absl::GetFlag(FLAGS_cluster_ngram_stride);
  store_options.near_dup.ngram_max_per_hash = absl::GetFlag(FLAGS_cluster_ngram_max_per_hash);
  if (store_options.near_dup.ngram_tokens == 0 || store_options.near_dup.ngram_stride == 0) {
    spdlog::critical("--cluster_ngram_tokens ({}) and --cluster_ngram_stride ({}) must be >= 1",
                     store_options.near_dup.ngram_tokens, store_options.near_dup.ngram_stride);
    return 2;
  }
  store_options.cluster_pass_interval_ms = absl::GetFlag(FLAGS_cluster_pass_interval_ms);
  store_options.cluster_pass_blocks_per_round =
      std::max<uint32_t>(absl::GetFlag(FLAGS_cluster_pass_blocks_per_round), 1);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<KvStore>> store = KvStore::Open(store_options);
  if (!store.ok()) {
    spdlog::critical("cannot open the store: {}", std::string(store.status().message()));
    return 1;
  }
  const RecoveryStats& rec = (*store)->recovery();
  spdlog::info(
      "store {}: {} models, {} nodes recovered in {} ms ({} dropped: {} missing parent, "
      "{} bad payload)",
      store_options.data_dir, rec.models, rec.nodes,
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                            start)
          .count(),
      rec.dropped_missing_parent + rec.dropped_bad_payload, rec.dropped_missing_parent,
      rec.dropped_bad_payload);

  ServiceOptions service_options;
  service_options.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  service_options.max_get_message_bytes = absl::GetFlag(FLAGS_max_get_message_bytes).bytes;
  service_options.codec_threads = codec_threads;
  service_options.default_encoding.encoding = *encoding;
  service_options.default_encoding.target_rel_rms = absl::GetFlag(FLAGS_default_target_rel_rms);
  service_options.put_limits.max_concurrent_streams =
      absl::GetFlag(FLAGS_max_concurrent_put_streams);
  service_options.put_limits.max_inflight_bytes_per_namespace =
      absl::GetFlag(FLAGS_max_inflight_put_bytes_per_namespace).bytes;
  service_options.put_limits.idle_timeout =
      absl::Seconds(std::max(0.0, absl::GetFlag(FLAGS_put_idle_timeout_seconds)));
  service_options.put_limits.max_inflight_bytes = store_options.max_inflight_put_bytes;
  service_options.put_limits.max_put_bytes = store_options.max_put_bytes;
  service_options.put_limits.admit_wait =
      absl::Seconds(std::max(0.0, absl::GetFlag(FLAGS_put_wait_for_memory_seconds)));
  if (const double share = absl::GetFlag(FLAGS_max_put_stream_share_per_peer);
      !(share > 0 && share <= 1)) {
    spdlog::critical("--max_put_stream_share_per_peer: {} is not in (0, 1]", share);
    return 2;
  } else if (share < 1 && service_options.put_limits.max_concurrent_streams > 0) {
    service_options.put_limits.max_streams_per_peer = std::max<uint32_t>(
        1, static_cast<uint32_t>(share * service_options.put_limits.max_concurrent_streams));
  }
  // kvtrie's message limit: a request of --max_tokens packed token ids (4 bytes each) fits in one
  // message. gRPC itself reads messages up to a larger cap, so that one between the two is
  // refused by kvtrie naming what it is and what to send instead (a Put header: its ids in
  // PutTokens) rather than by gRPC's "Received message larger than max". gRPC checks its cap only
  // once a message is whole in memory, so the larger cap costs no memory the limit saved.
  const uint64_t message_limit = std::min<uint64_t>(
      INT32_MAX, std::max<uint64_t>(4u << 20, 4ull * service_options.max_tokens + (64u << 10)));
  const int grpc_receive_cap = static_cast<int>(
      std::min<uint64_t>(INT32_MAX, std::max<uint64_t>(64u << 20, 4 * message_limit)));
  service_options.max_message_bytes = message_limit;
  KvCacheService service(store->get(), service_options);

  // Operating: tenants and quotas, metrics, TLS (server/guarded_service.h is what is served).
  absl::StatusOr<std::unique_ptr<Authenticator>> auth = Authenticator::Create(ops.tokens_file);
  if (!auth.ok()) {
    spdlog::critical("{}", std::string(auth.status().message()));
    return 2;
  }
  std::unique_ptr<Metrics> metrics;
  if (!ops.metrics_listen.empty()) {
    metrics = std::make_unique<Metrics>(store->get(), ops.metrics_max_namespaces);
    metrics->SetShardName(ops.shard_name);
    if ((*auth)->table() != nullptr) metrics->NameNamespaces((*auth)->table()->namespaces());
    absl::StatusOr<int> metrics_port = metrics->Listen(ops.metrics_listen);
    if (!metrics_port.ok()) {
      spdlog::critical("{}", std::string(metrics_port.status().message()));
      return 1;
    }
    spdlog::info("metrics on http://{}/metrics (bound port {})", ops.metrics_listen, *metrics_port);
    if (!ops.metrics_port_file.empty()) WritePortFile(ops.metrics_port_file, *metrics_port);
  }
  const int handler_threads = absl::GetFlag(FLAGS_handler_threads) > 0
                                  ? absl::GetFlag(FLAGS_handler_threads)
                                  : std::max(8, 2 * codec_threads);
  GuardedServiceOptions guarded_options;
  guarded_options.handler_threads = handler_threads;
  guarded_options.get_idle_timeout =
      absl::Seconds(std::max(0.0, absl::GetFlag(FLAGS_get_idle_timeout_seconds)));
  guarded_options.get_max_snapshot_age =
      absl::Seconds(std::max(0.0, absl::GetFlag(FLAGS_get_max_snapshot_seconds)));
  guarded_options.max_message_bytes = message_limit;
  if (store_options.disk_bytes > 0) {  // the folder rule (server/guarded_service.h)
    guarded_options.folder_bound_bytes = RecordStore::FolderBound(store_options.disk_bytes);
    guarded_options.get_cut_folder_bytes =
        2 * store_options.disk_bytes + RecordStore::kFolderSlackBytes;
  }
  GuardedService guarded(&service, auth->get(), store->get(), metrics.get(), guarded_options);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(ops.tls);
  if (!credentials.ok()) {
    spdlog::critical("{}", std::string(credentials.status().message()));
    return 2;
  }
  if ((*auth)->enabled()) {
    spdlog::info("auth on: {} tenants from {}", (*auth)->table()->num_tenants(), ops.tokens_file);
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // One server per port: without this gRPC sets SO_REUSEPORT and a second server on the same
  // port would serve (and split the calls) beside the first.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Bounded threads: past --max_threads gRPC's sync server (reflection) answers new calls
  // RESOURCE_EXHAUSTED. The KVCache calls are callback reactors (server/guarded_service.h).
  grpc::ResourceQuota quota("kvtrie-server");
  quota.SetMaxThreads(absl::GetFlag(FLAGS_max_threads));
  builder.SetResourceQuota(quota);
  builder.SetMaxReceiveMessageSize(grpc_receive_cap);  // kvtrie checks message_limit (above)
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), *credentials, &port);
  builder.RegisterService(&guarded);
  // A request that does not parse (invalid UTF-8 in a string field) gets INVALID_ARGUMENT saying
  // so, not gRPC's INTERNAL with an empty message.
  builder.experimental().SetInterceptorCreators(MakeParseFailureInterceptors());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    spdlog::critical(
        "cannot listen on {}: the address is in use (another kvtrie-server?) or not available",
        absl::GetFlag(FLAGS_listen));
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus(kServiceName, true);
  server->GetHealthCheckService()->SetServingStatus(true);
  // A plaintext port with only the health service, for probes that cannot speak TLS.
  std::unique_ptr<grpc::Server> health_server;
  if (!ops.health_listen.empty()) {
    grpc::ServerBuilder health_builder;
    int health_port = 0;
    health_builder.AddListeningPort(ops.health_listen, grpc::InsecureServerCredentials(),
                                    &health_port);
    health_server = health_builder.BuildAndStart();
    if (!health_server || health_port == 0) {
      spdlog::critical("--health_listen: cannot listen on {}", ops.health_listen);
      return 1;
    }
    health_server->GetHealthCheckService()->SetServingStatus(kServiceName, true);
    health_server->GetHealthCheckService()->SetServingStatus(true);
    spdlog::info("health on {} (bound port {}, plaintext)", ops.health_listen, health_port);
    if (!ops.health_port_file.empty()) WritePortFile(ops.health_port_file, health_port);
  }
  spdlog::info("kvtrie-server serving {} on {} (bound port {}, {})", kServiceName,
               absl::GetFlag(FLAGS_listen), port,
               ops.tls.cert_file.empty()     ? "plaintext"
               : ops.tls.require_client_cert ? "mutual TLS"
                                             : "TLS");
  if (const std::string path = absl::GetFlag(FLAGS_port_file); !path.empty()) {
    WritePortFile(path, port);
  }

  // A failed store write makes the store refuse writes until restart (trie/record_store.h):
  // health turns NOT_SERVING so the orchestrator restarts or drains this instance.
  absl::Notification stopping;
  std::thread health_watch([&] {
    while (!stopping.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
      if (absl::Status h = (*store)->health(); !h.ok()) {
        spdlog::critical("{}; health is NOT_SERVING", std::string(h.message()));
        server->GetHealthCheckService()->SetServingStatus(kServiceName, false);
        server->GetHealthCheckService()->SetServingStatus(false);
        return;
      }
    }
  });
  std::thread waiter([&] {
    int sig = 0;
    while (sigwait(&signals, &sig) == 0 && sig == SIGHUP) {
      if (absl::Status s = (*auth)->Reload(); !s.ok()) {
        spdlog::error("SIGHUP: tokens file not reloaded (the old one stays): {}",
                      std::string(s.message()));
      } else if ((*auth)->enabled()) {
        spdlog::info("SIGHUP: reloaded {} tenants from {}", (*auth)->table()->num_tenants(),
                     ops.tokens_file);
      }
    }
    spdlog::info("signal {}: draining (grace {} s)", sig,
                 absl::GetFlag(FLAGS_shutdown_grace_seconds));
    const auto signalled = std::chrono::system_clock::now();
    const auto deadline =
        signalled + std::chrono::seconds(absl::GetFlag(FLAGS_shutdown_grace_seconds));
    server->GetHealthCheckService()->Shutdown();  // NOT_SERVING for every service
    if (health_server) health_server->GetHealthCheckService()->Shutdown();
    // Calls a client sent just before the signal may not be read off their connection yet;
    // gRPC's Shutdown refuses what it has not matched, so give them a moment (within the grace).
    std::this_thread::sleep_until(
        std::min(deadline, std::chrono::system_clock::now() + std::chrono::milliseconds(200)));
    // Streams whose clients stalled never finish by themselves: gRPC's Shutdown waits for them
    // (and for their connections) until its deadline, then cancels every call and closes the
    // connections, and only then can the teardown start. So its deadline is the grace less a
    // reserve for the teardown (a third of it, at most 1 s): the process exits within the grace.
    const auto reserve = std::min<std::chrono::system_clock::duration>(std::chrono::seconds(1),
                                                                       (deadline - signalled) / 3);
    server->Shutdown(deadline - reserve);
  });
  server->Wait();
  guarded.StopHandlers();  // the last steps of finished calls, before the store closes
  waiter.join();
  stopping.Notify();
  health_watch.join();
  if (health_server) health_server->Shutdown(std::chrono::system_clock::now());
  metrics.reset();  // stops /metrics, which reads the store
  store->reset();   // flushes and closes RocksDB
  spdlog::info("kvtrie-server stopped");
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "stores the KV caches of LLM inference workers (gRPC kvtrie.v1.KVCache).\n"
      "  kvtrie-server --listen=127.0.0.1:50051 --data_dir=./kvtrie-data");
  absl::FlagsUsageConfig usage;
  // --help lists this file's flags (absl's default expects the file to be named after the binary).
  usage.contains_help_flags = kvtrie::IsServerFlagFile;
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  // --config=FILE: its settings go before the command line's flags, which override them.
  absl::StatusOr<std::vector<std::string>> args = kvtrie::ExpandConfigFile(argc, argv);
  if (!args.ok()) {
    std::fprintf(stderr, "kvtrie-server: %s\n", std::string(args.status().message()).c_str());
    return 2;
  }
  std::vector<char*> expanded;
  for (std::string& a : *args) expanded.push_back(a.data());
  absl::ParseCommandLine(static_cast<int>(expanded.size()), expanded.data());
  return kvtrie::Run();
}
