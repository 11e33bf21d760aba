// server/store_flags.h
//
// The storage flags of kvtrie-server and the StoreOptions (trie/store_types.h) they fill: the
// data folder and its durability (--data_dir, --sync, --verify_on_start), the tiers
// (--memory_bytes, --disk_bytes, --memtable_bytes), a Put's own bound (--max_put_bytes, enforced
// by the store's PutSession alone), the codec (--codec_threads, --verify_encoded_puts,
// --put_parent_cache_bytes), near-duplicate clusters and their background pass (--near_dup_*,
// --cluster_*, --delete_erases) and learned predictors (--learn_predictors, --predictor_*,
// --learn_queue_bytes). The flags are defined in store_flags.cc, beside the binding.
//
// The bound on all unfinished Puts together (--max_inflight_put_bytes) is the service's
// (server/service_flags.h: PutLimits admits and refuses against it, naming the flag), so the
// options returned here leave the store's own copy of that bound open
// (StoreOptions::max_inflight_put_bytes = UINT64_MAX): each byte limit is enforced in one layer.
#ifndef KVTRIE_SERVER_STORE_FLAGS_H_
#define KVTRIE_SERVER_STORE_FLAGS_H_

#include "absl/status/statusor.h"
#include "trie/store_types.h"

namespace kvtrie {

// The StoreOptions of the current flag values, codec_threads resolved (0 = one per core).
// Errors: INVALID_ARGUMENT naming the flag (--verify_encoded_puts not structure, sample or all;
// --cluster_ngram_tokens or --cluster_ngram_stride 0).
absl::StatusOr<StoreOptions> StoreOptionsFromFlags();

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_STORE_FLAGS_H_
