#include "server/service_flags.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/byte_size.h"
#include "trie/record_store.h"

ABSL_FLAG(std::string, default_encoding, "lossless",
          "encoding of Puts that name none: raw, lossless, residual, int8, kivi2 or turboquant");
ABSL_FLAG(double, default_target_rel_rms, 0.1,
          "relative RMS error target of residual Puts that name none");
ABSL_FLAG(uint32_t, max_tokens, 1u << 20, "most token ids one request may carry");
ABSL_FLAG(
    kvtrie::ByteSize, max_inflight_put_bytes, kvtrie::ByteSize{2ull << 30},
    "most dense KV bytes all unfinished Put streams together may buffer" KVTRIE_BYTE_UNITS_HELP);
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
ABSL_FLAG(kvtrie::ByteSize, max_inflight_put_bytes_per_namespace, kvtrie::ByteSize{1ull << 30},
          "most dense KV bytes one namespace's unfinished Put streams together may buffer "
          "(0 = only --max_inflight_put_bytes)" KVTRIE_BYTE_UNITS_HELP);
// Get streams (issue 18): server/guarded_service.h.
ABSL_FLAG(double, get_idle_timeout_seconds, 60,
          "a Get (or GetPredictor) stream whose client reads nothing for this long is cancelled "
          "and its store snapshot released (0 = never)");
ABSL_FLAG(double, get_max_snapshot_seconds, 300,
          "a Get stream open longer than this ends ABORTED naming this flag: its store snapshot "
          "keeps every payload deleted or evicted since it began on disk, past --disk_bytes "
          "(0 = never)");
ABSL_FLAG(int, handler_threads, 0,
          "threads that run the KVCache calls' work (parsing, the store, a Put's commit, a Get's "
          "decoding on its chain); open streams waiting for their client hold none; 0 = twice "
          "the codec threads, at least 8");

namespace kvtrie {
namespace {

absl::StatusOr<Encoding> ParseEncoding(const std::string& name) {
  for (uint32_t v = 1; IsValidEncoding(v); ++v) {
    if (EncodingName(static_cast<Encoding>(v)) == name) return static_cast<Encoding>(v);
  }
  return absl::InvalidArgumentError(absl::StrCat("--default_encoding: unknown '", name, "'"));
}

absl::Duration Seconds(double s) { return absl::Seconds(std::max(0.0, s)); }

}  // namespace

absl::StatusOr<ServingOptions> ServingOptionsFromFlags(const StoreOptions& store) {
  ServingOptions out;
  ServiceOptions& s = out.service;
  absl::StatusOr<Encoding> encoding = ParseEncoding(absl::GetFlag(FLAGS_default_encoding));
  if (!encoding.ok()) return encoding.status();
  s.default_encoding.encoding = *encoding;
  s.default_encoding.target_rel_rms = absl::GetFlag(FLAGS_default_target_rel_rms);
  s.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  s.max_get_message_bytes = absl::GetFlag(FLAGS_max_get_message_bytes).bytes;
  s.codec_threads = store.codec_threads;

  PutLimitOptions& put = s.put_limits;
  put.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_put_streams);
  put.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_put_bytes).bytes;
  put.max_inflight_bytes_per_namespace =
      absl::GetFlag(FLAGS_max_inflight_put_bytes_per_namespace).bytes;
  put.max_put_bytes = store.max_put_bytes;  // a cap on reservations; the store enforces it
  put.idle_timeout = Seconds(absl::GetFlag(FLAGS_put_idle_timeout_seconds));
  put.admit_wait = Seconds(absl::GetFlag(FLAGS_put_wait_for_memory_seconds));
  if (const double share = absl::GetFlag(FLAGS_max_put_stream_share_per_peer);
      !(share > 0 && share <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_put_stream_share_per_peer: ", share, " is not in (0, 1]"));
  } else if (share < 1 && put.max_concurrent_streams > 0) {
    put.max_streams_per_peer =
        std::max<uint32_t>(1, static_cast<uint32_t>(share * put.max_concurrent_streams));
  }

  // kvtrie's message limit: a request of --max_tokens packed token ids (4 bytes each) fits in one
  // message. gRPC itself reads messages up to a larger cap, so that one between the two is
  // refused by kvtrie naming what it is and what to send instead (a Put header: its ids in
  // PutTokens) rather than by gRPC's "Received message larger than max". gRPC checks its cap only
  // once a message is whole in memory, so the larger cap costs no memory the limit saved.
  const uint64_t message_limit = std::min<uint64_t>(
      INT32_MAX, std::max<uint64_t>(4u << 20, 4ull * s.max_tokens + (64u << 10)));
  out.grpc_receive_cap = static_cast<int>(
      std::min<uint64_t>(INT32_MAX, std::max<uint64_t>(64u << 20, 4 * message_limit)));
  s.max_message_bytes = message_limit;

  GuardedServiceOptions& g = out.guarded;
  g.handler_threads = absl::GetFlag(FLAGS_handler_threads) > 0
                          ? absl::GetFlag(FLAGS_handler_threads)
                          : std::max(8, 2 * store.codec_threads);
  g.get_idle_timeout = Seconds(absl::GetFlag(FLAGS_get_idle_timeout_seconds));
  g.get_max_snapshot_age = Seconds(absl::GetFlag(FLAGS_get_max_snapshot_seconds));
  g.max_message_bytes = message_limit;
  if (store.disk_bytes > 0) {  // the folder rule (server/guarded_service.h)
    g.folder_bound_bytes = RecordStore::FolderBound(store.disk_bytes);
    g.get_cut_folder_bytes = 2 * store.disk_bytes + RecordStore::kFolderSlackBytes;
  }
  return out;
}

}  // namespace kvtrie
