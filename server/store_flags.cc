#include "server/store_flags.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/byte_size.h"

ABSL_FLAG(std::string, data_dir, "./kvtrie-data",
          "folder of the embedded RocksDB (created if missing)");
ABSL_FLAG(bool, sync, false,
          "fsync RocksDB's write-ahead log before acknowledging a Put (survives machine "
          "crashes, not only process crashes)");
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

absl::StatusOr<StoreOptions> StoreOptionsFromFlags() {
  StoreOptions o;
  if (const std::string v = absl::GetFlag(FLAGS_verify_encoded_puts); v == "structure") {
    o.verify_encoded_puts = VerifyEncoded::kStructure;
  } else if (v == "sample") {
    o.verify_encoded_puts = VerifyEncoded::kSample;
  } else if (v == "all") {
    o.verify_encoded_puts = VerifyEncoded::kAll;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--verify_encoded_puts: '", v, "'; use structure, sample or all"));
  }
  o.data_dir = absl::GetFlag(FLAGS_data_dir);
  o.sync = absl::GetFlag(FLAGS_sync);
  o.max_put_bytes = absl::GetFlag(FLAGS_max_put_bytes).bytes;
  // Enforced by the service alone (PutLimits, --max_inflight_put_bytes): see the header.
  o.max_inflight_put_bytes = std::numeric_limits<uint64_t>::max();
  o.codec_threads = absl::GetFlag(FLAGS_codec_threads) > 0
                        ? absl::GetFlag(FLAGS_codec_threads)
                        : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  o.memory_bytes = absl::GetFlag(FLAGS_memory_bytes).bytes;
  o.disk_bytes = absl::GetFlag(FLAGS_disk_bytes).bytes;
  o.memtable_bytes = absl::GetFlag(FLAGS_memtable_bytes).bytes;
  o.verify_payloads_on_open = absl::GetFlag(FLAGS_verify_on_start);
  o.put_parent_cache_bytes = absl::GetFlag(FLAGS_put_parent_cache_bytes).bytes;
  o.delete_erases = absl::GetFlag(FLAGS_delete_erases);

  NearDupOptions& nd = o.near_dup;
  nd.enabled = absl::GetFlag(FLAGS_near_dup_clusters);
  nd.max_distance_bits = absl::GetFlag(FLAGS_cluster_max_distance_bits);
  nd.position_shifted = absl::GetFlag(FLAGS_cluster_position_shifted);
  nd.ngram_index = absl::GetFlag(FLAGS_cluster_ngram_index);
  nd.retain_lossy_centroids = absl::GetFlag(FLAGS_cluster_retain_deleted_centroids);
  nd.ngram_tokens = absl::GetFlag(FLAGS_cluster_ngram_tokens);
  nd.ngram_stride = absl::GetFlag(FLAGS_cluster_ngram_stride);
  nd.ngram_max_per_hash = absl::GetFlag(FLAGS_cluster_ngram_max_per_hash);
  if (nd.ngram_tokens == 0 || nd.ngram_stride == 0) {
    return absl::InvalidArgumentError(absl::StrCat("--cluster_ngram_tokens (", nd.ngram_tokens,
                                                   ") and --cluster_ngram_stride (",
                                                   nd.ngram_stride, ") must be >= 1"));
  }
  o.cluster_pass_interval_ms = absl::GetFlag(FLAGS_cluster_pass_interval_ms);
  o.cluster_pass_blocks_per_round =
      std::max<uint32_t>(absl::GetFlag(FLAGS_cluster_pass_blocks_per_round), 1);

  PredictorOptions& p = o.predictors;
  p.learn = absl::GetFlag(FLAGS_learn_predictors);
  p.refit_every_tokens = absl::GetFlag(FLAGS_predictor_refit_tokens);
  p.memory_bytes = absl::GetFlag(FLAGS_predictor_memory_bytes).bytes;
  p.cross_layer = absl::GetFlag(FLAGS_predictor_cross_layer);
  p.queue_bytes = absl::GetFlag(FLAGS_learn_queue_bytes).bytes;
  return o;
}

}  // namespace kvtrie
