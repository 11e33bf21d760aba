#include "trie/ngram_index.h"

#include <algorithm>

#include "trie/block_trie.h"

namespace kvtrie {

NgramIndex::NgramIndex(const NgramIndexOptions& options) : options_(options) {
  options_.stride = std::max<uint32_t>(options_.stride, 1);
}

uint32_t NgramIndex::WindowFor(size_t block_tokens) const {
  const uint32_t half = static_cast<uint32_t>(std::max<size_t>(block_tokens / 2, 1));
  return std::max<uint32_t>(std::min(options_.window, half), 1);
}

uint32_t NgramIndex::StrideFor(size_t block_tokens) const {
  const uint32_t w = WindowFor(block_tokens);
  if (block_tokens < w) return 1;
  const uint32_t room = static_cast<uint32_t>(block_tokens) - w;  // the last offset
  for (uint32_t k = std::min(options_.stride, room + 1); k > 1; --k) {
    if (room / k * k + 1 >= w) return k;
  }
  return 1;
}

uint64_t NgramIndex::Hash(absl::Span<const uint32_t> window) {
  return BlockTrie::DefaultTokenHash(window);
}

void NgramIndex::Add(uint64_t node_id, absl::Span<const uint32_t> tokens) {
  const uint32_t w = WindowFor(tokens.size());
  if (tokens.size() < w) return;
  const uint32_t k = StrideFor(tokens.size());
  for (size_t o = 0; o + w <= tokens.size(); o += k) {
    std::vector<Hit>& hits = map_[Hash(tokens.subspan(o, w))];
    if (options_.max_per_hash != 0 && hits.size() >= options_.max_per_hash) continue;
    hits.push_back({node_id, static_cast<uint32_t>(o)});
    ++num_entries_;
  }
}

void NgramIndex::Remove(uint64_t node_id, absl::Span<const uint32_t> tokens) {
  const uint32_t w = WindowFor(tokens.size());
  if (tokens.size() < w) return;
  const uint32_t k = StrideFor(tokens.size());
  for (size_t o = 0; o + w <= tokens.size(); o += k) {
    auto it = map_.find(Hash(tokens.subspan(o, w)));
    if (it == map_.end()) continue;
    std::vector<Hit>& hits = it->second;
    const size_t before = hits.size();
    // A node may hold the same n-gram at two offsets: each call removes its own offset only.
    auto hit = std::find_if(hits.begin(), hits.end(),
                            [&](const Hit& h) { return h.node_id == node_id && h.offset == o; });
    if (hit != hits.end()) hits.erase(hit);
    num_entries_ -= before - hits.size();
    if (hits.empty()) map_.erase(it);
  }
}

absl::Span<const NgramIndex::Hit> NgramIndex::Lookup(absl::Span<const uint32_t> window) const {
  auto it = map_.find(Hash(window));
  if (it == map_.end()) return {};
  return it->second;
}

}  // namespace kvtrie
