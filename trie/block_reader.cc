#include "trie/block_reader.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/decode_alone.h"
#include "codec/predictor_state.h"
#include "trie/model_shard.h"

namespace kvtrie {

BlockReader::BlockReader(ModelShard* shard, GetResult listing, std::vector<uint32_t> tokens,
                         size_t max_blocks, Mode mode, ThreadPool* pool, bool through_retained)
    : shard_(shard),
      got_(std::move(listing)),
      tokens_(std::move(tokens)),
      max_blocks_(max_blocks),
      through_retained_(through_retained),
      mode_(mode),
      pool_(pool),
      window_(pool == nullptr ? 1 : static_cast<size_t>(std::max(1, pool->threads()))) {
  if (mode_ == Mode::kReconstructed) {
    chain_ = std::make_unique<DecodeChain>(got_.model.geometry, nullptr);  // the store fetches
  }
}

BlockReader::~BlockReader() {
  if (decoding_.valid()) decoding_.wait();  // it writes into next_
}

absl::Status BlockReader::ReadSlot(size_t i, Slot* slot) {
  slot->index = i;
  slot->read = got_.blocks[i];
  slot->generation = generation_;
  slot->owner.reset();
  slot->dense = {};
  slot->independent = false;
  slot->learned.reset();
  absl::StatusOr<std::shared_ptr<const std::string>> payload = shard_->ReadPayload(slot->read);
  if (!payload.ok()) return payload.status();
  slot->payload = *std::move(payload);
  // The payload is verified (hot: when it was made; cold: just now), so no second CRC pass.
  const BlockGeometry& g = got_.model.geometry;
  absl::StatusOr<BlockHeader> h = ParseVerifiedBlock(*slot->payload);
  if (!h.ok() || !(h->geometry == g) || slot->read.reference_node_id != 0) {
    return absl::OkStatus();  // the chain decodes it, or names what is wrong
  }
  if (h->encoding == Encoding::kRaw && h->profile == Profile::kCompact &&
      h->payload.size() == g.num_bytes()) {
    slot->owner = slot->payload;
    slot->dense =
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(h->payload.data()), h->payload.size());
    return absl::OkStatus();
  }
  if (!DecodesAlone(*h)) return absl::OkStatus();  // the rule is the codec's (decode_alone.h)
  if (h->predictor_version == 0) {
    slot->independent = true;
    return absl::OkStatus();
  }
  // Coded against a learned state: it decodes alone with that state (held by its BlockRead), its
  // tokens, first position and previous token. Anything amiss is left to the chain to name.
  if (h->predictor_version != slot->read.predictor_version ||
      slot->read.tokens.size() != g.block_tokens) {
    return absl::OkStatus();
  }
  if (learned_ == nullptr || learned_->version() != h->predictor_version) {
    absl::StatusOr<std::shared_ptr<const PredictorState>> state =
        shard_->predictors()->Find(h->predictor_version);
    if (!state.ok()) return absl::OkStatus();
    learned_ = *std::move(state);
  }
  slot->learned = learned_;
  slot->independent = true;
  return absl::OkStatus();
}

absl::Status BlockReader::Prepare(size_t begin, std::vector<Slot>* slots) {
  slots->clear();
  for (size_t i = begin; i < std::min(got_.blocks.size(), begin + window_); ++i) {
    if (auto s = ReadSlot(i, &slots->emplace_back()); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void BlockReader::DecodeAlone(Slot* slot) {
  // Reads only the slot (and the model's geometry): the caller may list blocks again meanwhile.
  const BlockGeometry& g = got_.model.geometry;
  std::shared_ptr<uint8_t[]> buffer(new uint8_t[g.num_bytes()]);
  const absl::Span<uint8_t> out(buffer.get(), g.num_bytes());
  PredictionContext context;
  if (slot->learned != nullptr) {
    context.learned = slot->learned.get();
    context.tokens = slot->read.tokens;
    context.first_position = slot->read.first_position;
    context.previous_token = slot->read.previous_token;
  }
  if (!DecodeVerifiedBlock(*slot->payload, out, context).ok()) return;  // the chain reports it
  slot->dense = out;
  slot->owner = std::move(buffer);
  decoded_alone_.fetch_add(1, std::memory_order_relaxed);
}

bool BlockReader::ListingMatches(const BlockRead& read, const std::string& payload) {
  absl::StatusOr<BlockHeader> h = ParseVerifiedBlock(payload);  // checked when read
  return !h.ok() || (h->reference_node_id == read.reference_node_id &&
                     h->predictor_version == read.predictor_version);
}

absl::Status BlockReader::ListAgainFrom(size_t i) {
  shard_->AwaitPublished();
  GetResult again = shard_->Get(tokens_, max_blocks_, through_retained_);
  if (again.blocks.size() <= i || again.blocks[i].node_id != got_.blocks[i].node_id) {
    return absl::AbortedError(absl::StrCat("token_ids: blocks [", i, ", ", got_.blocks.size(),
                                           ") were deleted while this Get streamed them; retry"));
  }
  for (size_t j = i; j < again.blocks.size() && j < got_.blocks.size() &&
                     again.blocks[j].node_id == got_.blocks[j].node_id;
       ++j) {
    got_.blocks[j] = std::move(again.blocks[j]);
  }
  ++generation_;
  return absl::OkStatus();
}

absl::Status BlockReader::DecodeOnChain(Slot* slot) {
  const size_t i = slot->index;
  if (slot->generation != generation_) {  // listed again since it was read: read it anew
    if (auto s = ReadSlot(i, slot); !s.ok()) return s;
  }
  const BlockGeometry& g = got_.model.geometry;
  std::shared_ptr<uint8_t[]> buffer(new uint8_t[g.num_bytes()]);
  const absl::Span<uint8_t> out(buffer.get(), g.num_bytes());
  chain_->SetOutputOwner(buffer);
  absl::Status s = shard_->DecodeReadBlock(slot->read, *slot->payload, chain_.get(), out);
  // ABORTED: the block changed since it was listed and its listed encoding can not be decoded
  // any more (the centroid it is a residual of was deleted while this Get ran, and could not be
  // kept for it: it listed while the Delete was under way). Delete first re-encodes its
  // dependents as bit-exact standalone copies under the same node ids, so list the rest of the
  // prefix again and read the same node anew (bounded). Everything else is read as listed.
  // A re-encoding by the cluster pass is the same case: written before it is published, so a cold
  // read listed in between has the old listing and the new bytes (ListAgainFrom waits for it).
  for (int retry = 0; absl::IsAborted(s) && retry < kRetries; ++retry) {
    if (auto r = ListAgainFrom(i); !r.ok()) return r;
    if (auto r = ReadSlot(i, slot); !r.ok()) return r;
    chain_->SetOutputOwner(buffer);
    s = shard_->DecodeReadBlock(slot->read, *slot->payload, chain_.get(), out);
  }
  if (!s.ok()) return s;
  slot->dense = out;
  slot->owner = std::move(buffer);
  return absl::OkStatus();
}

absl::Status BlockReader::Next(Block* out, bool* end) {
  *end = false;
  if (mode_ == Mode::kStored) {  // the stored payloads as they are, without a copy
    if (next_block_ >= got_.blocks.size()) {
      *end = true;
      return absl::OkStatus();
    }
    const size_t i = next_block_++;
    absl::StatusOr<std::shared_ptr<const std::string>> payload =
        shard_->ReadPayload(got_.blocks[i]);
    if (!payload.ok()) return payload.status();
    // The bytes must be what the listing says (the client decodes them against the centroid it
    // names): a cold block the cluster pass or a Delete re-encoded after this Get listed it
    // (written before it is published) is listed and read again.
    for (int retry = 0; !ListingMatches(got_.blocks[i], **payload); ++retry) {
      if (retry == kRetries) {
        return absl::AbortedError(absl::StrCat("token_ids: block ", i, " (node ",
                                               got_.blocks[i].node_id,
                                               ") was re-encoded while this Get read it; retry"));
      }
      if (auto s = ListAgainFrom(i); !s.ok()) return s;
      payload = shard_->ReadPayload(got_.blocks[i]);
      if (!payload.ok()) return payload.status();
    }
    out->index = i;
    out->encoded = true;
    out->bytes = **payload;
    out->owner = *std::move(payload);
    return absl::OkStatus();
  }
  // Reconstructed. While window k is taken (its chain blocks decoded in order, here), the pool
  // decodes the blocks of window k + 1 that decode alone. Raw blocks are their payloads.
  if (!started_) {
    started_ = true;
    if (auto s = Prepare(0, &current_); !s.ok()) return s;
    std::vector<Slot*> alone;
    for (Slot& slot : current_) {
      if (slot.independent && slot.owner == nullptr) alone.push_back(&slot);
    }
    if (pool_ != nullptr && alone.size() > 1) {
      pool_->ParallelFor(alone.size(), [&](size_t k) { DecodeAlone(alone[k]); });
    } else {
      for (Slot* slot : alone) DecodeAlone(slot);
    }
  }
  for (;;) {
    if (begin_ >= got_.blocks.size()) {
      *end = true;
      return absl::OkStatus();
    }
    if (!window_open_) {  // the next window: read, and its lone blocks decoded beside
      window_open_ = true;
      prepared_ = Prepare(begin_ + window_, &next_);
      todo_.clear();
      if (prepared_.ok()) {
        for (Slot& slot : next_) {
          if (slot.independent && slot.owner == nullptr) todo_.push_back(&slot);
        }
      }
      // (With one codec thread they are decoded after this window is taken.)
      if (pool_ != nullptr && pool_->threads() > 1 && !todo_.empty()) {
        decoding_ = std::async(std::launch::async, [this] {
          pool_->ParallelFor(todo_.size(), [this](size_t k) { DecodeAlone(todo_[k]); });
        });
      }
    }
    if (pos_ < current_.size()) {
      Slot& slot = current_[pos_];
      if (slot.owner == nullptr) {
        if (auto s = DecodeOnChain(&slot); !s.ok()) return s;
      } else {
        chain_->NextDenseShared(slot.owner, slot.dense, slot.read.tokens);
      }
      out->index = slot.index;
      out->encoded = false;
      out->bytes =
          absl::string_view(reinterpret_cast<const char*>(slot.dense.data()), slot.dense.size());
      out->owner = std::move(slot.owner);
      slot = Slot();  // release the reader's hold on the buffers
      ++pos_;
      return absl::OkStatus();
    }
    // Window taken: the next one is current.
    if (decoding_.valid()) {
      decoding_.get();
    } else {
      for (Slot* slot : todo_) DecodeAlone(slot);
    }
    todo_.clear();
    if (!prepared_.ok()) return prepared_;
    std::swap(current_, next_);
    pos_ = 0;
    begin_ += window_;
    window_open_ = false;
  }
}

}  // namespace kvtrie
