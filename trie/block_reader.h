// trie/block_reader.h
//
// BlockReader: the one read path of a Get, owned by the store (KvStore::NewReader), as LevelDB's
// DB::NewIterator is the one read path of a DB. It is made on one listing of a prefix (the path
// snapshot: KvStore::Get's BlockReads, each holding its hot copy or the RocksDB snapshot, the
// learned state it names and the retired centroids, trie/kv_store.h "Snapshot reads") and yields
// the prefix's blocks in order, root first:
//   kStored        each block's stored payload (the codec envelope, codec/block_codec.h), as it
//                  is: what GET_MODE_RESIDUAL puts on the wire;
//   kReconstructed each block's dense bytes ([num_layers][2][num_kv_heads][block_tokens][head_dim]
//                  in the model's dtype, geometry.num_bytes() bytes): a raw block's payload
//                  without a copy, every other block decoded.
// Each payload is read exactly once (from its hot copy, or from RocksDB once, which counts one
// cold read and so never promotes a block read once: trie/tier_manager.h), then framed or
// decoded from those bytes.
//
// Decoding (kReconstructed) runs in windows of `pool`'s threads() blocks: while the caller takes
// the blocks of window k, the next window's payloads are read and the blocks that decode alone
// are decoded on `pool` beside it. A block decodes alone when it is in the fast profile with no
// centroid: its decoder reads no parent, only, when it names a learned predictor state, that
// state (held by its BlockRead), its tokens, its first position and the token before it
// (codec/fast_residual_decode.cc). The others (compact profile, centroid-coded) are decoded in
// order on the caller's thread through the path's DecodeChain, fetching their centroids inside
// the store. A block that failed to decode alone is decoded on the chain, which names the error.
// The pool is the caller's (the service's Get pool of --codec_threads, shared by every Get; the
// store's own TaskPool encodes Puts); null decodes everything on the caller's thread.
//
// Errors of Next (the block's index is named): ModelShard::ReadPayload's and ReadAndDecodeBlock's
// (DATA_LOSS and a dropped subtree only for bytes that fail their own checksum; ABORTED or
// INTERNAL, nothing dropped, for an inconsistency). A chain block that is ABORTED because a Delete
// or the cluster pass re-encoded it after the listing (or, kStored, a block whose bytes name
// another centroid than its listing) is listed again once that write is published (the rest of
// the prefix, at most kRetries times) and read anew; ABORTED "deleted while this Get streamed
// them" when the block itself went.
//
// Not thread-safe: one caller. The store must outlive the reader; the destructor waits for a
// window being decoded.
#ifndef KVTRIE_TRIE_BLOCK_READER_H_
#define KVTRIE_TRIE_BLOCK_READER_H_

#include <atomic>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/decode_chain.h"
#include "codec/thread_pool.h"
#include "trie/store_types.h"

namespace kvtrie {

class ModelShard;
class PredictorState;  // codec/predictor_state.h

class BlockReader {
 public:
  enum class Mode { kStored, kReconstructed };
  // Times a chain block whose centroid a Delete removed is listed and read again.
  static constexpr int kRetries = 3;

  // One block: `bytes` is the envelope (encoded) or the dense block; `owner` keeps it alive and
  // unchanged for as long as the caller holds it (zero copy).
  struct Block {
    size_t index = 0;  // in listing().blocks
    bool encoded = false;
    absl::string_view bytes;
    std::shared_ptr<const void> owner;
  };

  // Made by KvStore::NewReader. `shard` null: a miss (no blocks). `tokens`, `max_blocks` and
  // `through_retained` are the listing's, for listing again.
  BlockReader(ModelShard* shard, GetResult listing, std::vector<uint32_t> tokens, size_t max_blocks,
              Mode mode, ThreadPool* pool, bool through_retained = false);
  ~BlockReader();
  BlockReader(const BlockReader&) = delete;
  BlockReader& operator=(const BlockReader&) = delete;

  // The listing: the model and the blocks' metadata (a block listed again after a retry shows
  // its new encoding once Next returned it).
  const GetResult& listing() const { return got_; }
  // The next block into `out`, or `end` (OK) after the last. On an error the reader is done.
  absl::Status Next(Block* out, bool* end);
  // Blocks decoded alone so far (on the pool, off the chain): for tests and measurements.
  size_t decoded_alone() const { return decoded_alone_.load(std::memory_order_relaxed); }

 private:
  // One block of a window: its payload, read once, and its dense bytes once decoded.
  struct Slot {
    size_t index = 0;
    std::shared_ptr<const std::string> payload;
    BlockRead read;                     // as listed when its payload was read (a copy: see Next)
    uint64_t generation = 0;            // generation_ when its payload was read
    std::shared_ptr<const void> owner;  // set when ready: the payload (raw) or a decoded buffer
    absl::Span<const uint8_t> dense;
    bool independent = false;  // decodes without the parent or a reference (fast profile)
    std::shared_ptr<const PredictorState> learned;  // for an independent block naming a state
  };

  absl::Status ReadSlot(size_t i, Slot* slot);
  // Whether `payload` is coded as `read` lists it (against the same centroid and learned state).
  static bool ListingMatches(const BlockRead& read, const std::string& payload);
  // Lists the rest of the prefix from block i again, once the write under way is published
  // (ModelShard::AwaitPublished), and bumps generation_. ABORTED when block i itself went (a
  // Delete of its prefix: what this Get promised is gone).
  absl::Status ListAgainFrom(size_t i);
  absl::Status Prepare(size_t begin, std::vector<Slot>* slots);
  void DecodeAlone(Slot* slot);
  absl::Status DecodeOnChain(Slot* slot);

  ModelShard* const shard_;
  GetResult got_;
  const std::vector<uint32_t> tokens_;
  const size_t max_blocks_;
  const bool through_retained_;
  const Mode mode_;
  ThreadPool* const pool_;
  const size_t window_;
  uint64_t generation_ = 0;  // bumped when the rest of the prefix is listed again
  std::unique_ptr<DecodeChain> chain_;
  size_t next_block_ = 0;  // kStored: the next block
  // kReconstructed: the window being taken (from block begin_, slot pos_ next) and the next one,
  // being decoded by decoding_.
  bool started_ = false;
  bool window_open_ = false;  // the next window is read and being decoded
  size_t begin_ = 0, pos_ = 0;
  std::vector<Slot> current_, next_;
  absl::Status prepared_;
  // The learned state the last block read names (most blocks of a prefix name the same).
  std::shared_ptr<const PredictorState> learned_;
  std::atomic<size_t> decoded_alone_{0};
  std::vector<Slot*> todo_;     // of next_, decoded by decoding_
  std::future<void> decoding_;  // last: destroyed (and waited for) first
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_BLOCK_READER_H_
