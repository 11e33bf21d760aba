#include "trie/cluster_index.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "codec/reference_shift.h"

namespace kvtrie {

double HistogramUpperBits(int bucket) {
  if (bucket >= kHistogramBuckets - 1) return std::numeric_limits<double>::infinity();
  return std::ldexp(1.0, bucket);
}

int HistogramBucket(double bits) {
  if (!(bits >= 1)) return 0;
  const int b = static_cast<int>(std::floor(std::log2(bits))) + 1;
  return std::min(b, kHistogramBuckets - 1);
}

void ClusterStats::Merge(const ClusterStats& o) {
  centroids += o.centroids;
  residual_nodes += o.residual_nodes;
  near_dup_groups += o.near_dup_groups;
  candidates_tried += o.candidates_tried;
  gated_by_distance += o.gated_by_distance;
  residual_not_smaller += o.residual_not_smaller;
  position_shifted_coded += o.position_shifted_coded;
  position_shifted_skipped += o.position_shifted_skipped;
  ngram_entries += o.ngram_entries;
  for (int i = 0; i < kHistogramBuckets; ++i) {
    path_surprisal_histogram[i] += o.path_surprisal_histogram[i];
    branch_distance_histogram[i] += o.branch_distance_histogram[i];
  }
}

const TrieNode* LowestCommonAncestor(const TrieNode* a, const TrieNode* b) {
  while (a->depth > b->depth) a = a->parent;
  while (b->depth > a->depth) b = b->parent;
  while (a != b) {
    a = a->parent;
    b = b->parent;
  }
  return a;
}

double TrieDistanceBits(const TrieNode* a, const TrieNode* b) {
  const TrieNode* lca = LowestCommonAncestor(a, b);
  return a->path_surprisal_bits + b->path_surprisal_bits - 2 * lca->path_surprisal_bits;
}

uint64_t ClusterIndex::GroupKey(uint32_t depth, absl::Span<const uint32_t> block) {
  return BlockTrie::DefaultTokenHash(block) ^ (0x9e3779b97f4a7c15ull * (depth + 1));
}

namespace {

NgramIndexOptions WindowOptions(const NearDupOptions& o) {
  if (o.ngram_index) return {o.ngram_tokens, o.ngram_stride, o.ngram_max_per_hash};
  // Before the n-gram index: half-block windows at every offset, uncapped.
  return {std::numeric_limits<uint32_t>::max(), 1, 0};
}

}  // namespace

ClusterIndex::ClusterIndex(const NearDupOptions& options)
    : any_shift_(options.ngram_index), windows_(WindowOptions(options)) {}

void ClusterIndex::Add(const TrieNode& node) {
  const uint64_t group = GroupKey(node.depth, node.token_ids);
  std::vector<uint64_t>& members = groups_[group];
  members.push_back(node.id);
  if (members.size() == 2) multi_groups_.insert(group);
  if (members.size() >= 2) dirty_groups_.insert(group);
  ++path_surprisal_histogram_[HistogramBucket(node.path_surprisal_bits)];
  if (node.depth > 0) windows_.Add(node.id, node.token_ids);
  if (node.reference_node_id != 0) dependents_[node.reference_node_id].insert(node.id);
}

void ClusterIndex::Remove(const TrieNode& node) {
  auto erase_from = [&](auto& map, uint64_t key, auto pred) {
    auto it = map.find(key);
    if (it == map.end()) return;
    auto& v = it->second;
    v.erase(std::remove_if(v.begin(), v.end(), pred), v.end());
    if (v.empty()) map.erase(it);
  };
  const uint64_t group = GroupKey(node.depth, node.token_ids);
  erase_from(groups_, group, [&](uint64_t id) { return id == node.id; });
  if (auto it = groups_.find(group); it == groups_.end() || it->second.size() < 2) {
    multi_groups_.erase(group);
    dirty_groups_.erase(group);
  }
  --path_surprisal_histogram_[HistogramBucket(node.path_surprisal_bits)];
  if (node.depth > 0) windows_.Remove(node.id, node.token_ids);
  if (node.reference_node_id != 0) {
    auto it = dependents_.find(node.reference_node_id);
    if (it != dependents_.end()) {
      it->second.erase(node.id);
      if (it->second.empty()) dependents_.erase(it);
    }
  }
  // A centroid leaves only after its dependents were re-encoded (KvStore); drop stale edges anyway.
  dependents_.erase(node.id);
}

std::vector<ClusterIndex::Candidate> ClusterIndex::FindCandidates(
    BlockTrie* trie, const TrieNode* anchor, uint32_t depth, absl::Span<const uint32_t> block,
    double path_bits, double max_distance_bits, size_t max_candidates, uint64_t self) {
  std::vector<Candidate> out;
  auto distance_to = [&](const TrieNode* n) {
    return path_bits + n->path_surprisal_bits -
           2 * LowestCommonAncestor(anchor, n)->path_surprisal_bits;
  };
  if (auto it = groups_.find(GroupKey(depth, block)); it != groups_.end()) {
    for (uint64_t id : it->second) {
      const TrieNode* n = trie->Find(id);
      if (n == nullptr || id == self || n->reference_node_id != 0 || n->removing || n->retained ||
          n->depth != depth ||
          !std::equal(block.begin(), block.end(), n->token_ids.begin(), n->token_ids.end())) {
        continue;  // gone, the block itself, a residual, hidden, or a hash collision
      }
      const double d = distance_to(n);
      if (d > max_distance_bits) {
        ++counters_.gated_by_distance;
        continue;
      }
      out.push_back({id, d});
    }
  }
  std::sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    return a.distance_bits < b.distance_bits ||
           (a.distance_bits == b.distance_bits && a.node_id < b.node_id);
  });
  if (out.size() > max_candidates) out.resize(max_candidates);
  if (!out.empty()) return out;

  // No aligned candidate: is it a position-shifted near-duplicate? Block token j at position
  // p + j repeats the stored token at position start + j of a stored path (start = p - shift).
  const uint32_t bt = static_cast<uint32_t>(block.size());
  const uint32_t half = bt / 2;
  const int64_t p = static_cast<int64_t>(depth - 1) * bt;
  bool detected = false;
  absl::flat_hash_set<std::pair<uint64_t, uint32_t>> seen;  // (centroid, token_shift)
  // Beyond half a block only a whole-block repeat is a near-duplicate: a shorter one there is
  // mostly a phrase the text repeats (which would cost a centroid read per try and pin the
  // centroid), not a shifted copy of the stored text. Within half a block, as before.
  auto far = [&](int32_t rotation) { return static_cast<uint32_t>(std::abs(rotation)) > half; };
  // a may be null when s is 0 (the window is b).
  auto consider = [&](const TrieNode* a, const TrieNode* b, uint32_t s, int32_t rotation) {
    if (s > 0 && a->depth == 0) return;
    uint32_t matched = 0;
    for (uint32_t j = 0; j < bt; ++j) {
      matched += block[j] == (j < s ? a->token_ids[bt - s + j] : b->token_ids[j - s]);
    }
    if (far(rotation) && matched < bt) return;
    detected = true;
    if (b->reference_node_id != 0 || b->removing || b->retained) return;
    if (s > 0 && a->removing) return;
    if (!seen.insert({b->id, s}).second) return;
    const double d = distance_to(b);
    if (d > max_distance_bits) {
      ++counters_.gated_by_distance;
      return;
    }
    out.push_back({b->id, d, true, s, rotation, s > 0 ? a->id : 0, matched});
  };
  // A tail window: a's last s tokens, the rest of the block past the stored text (never a
  // whole-block repeat: within half a block only).
  auto consider_tail = [&](const TrieNode* a, uint32_t s, int32_t rotation) {
    if (far(rotation)) return;
    if (a->reference_node_id != 0 || a->removing || a->retained || a->depth == 0) return;
    if (!seen.insert({a->id, s | 0x80000000u}).second) return;
    const double d = distance_to(a);
    if (d > max_distance_bits) {
      ++counters_.gated_by_distance;
      return;
    }
    uint32_t matched = 0;
    for (uint32_t j = 0; j < s; ++j) matched += block[j] == a->token_ids[bt - s + j];
    out.push_back({a->id, d, true, s, rotation, 0, matched, true});
  };
  const uint32_t w = windows_.WindowFor(bt);
  absl::flat_hash_set<std::pair<uint64_t, int64_t>> windows_seen;  // (node, start) looked at
  for (uint32_t o = 0; w <= bt && o + w <= bt; ++o) {
    for (const NgramIndex::Hit& hit : windows_.Lookup(block.subspan(o, w))) {
      const TrieNode* n = trie->Find(hit.node_id);
      if (n == nullptr || n->depth == 0 || n->token_ids.size() != bt) continue;
      const int64_t q = n->token_offset();
      const int64_t start = q + hit.offset - o;
      const int64_t shift = p - start;
      if (shift == 0 || (!any_shift_ && std::llabs(shift) > half)) continue;
      if (shift > kMaxShiftRotation || shift < -kMaxShiftRotation) continue;
      if (!std::equal(block.begin() + o, block.begin() + o + w,
                      n->token_ids.begin() + hit.offset)) {
        continue;  // a hash collision
      }
      if (std::llabs(shift) <= half) detected = true;  // far: when the whole block repeats
      if (!windows_seen.insert({n->id, start}).second) continue;  // another window, same place
      const int32_t rotation = static_cast<int32_t>(shift);
      if (start < q) {  // the window ends in n: A = n's parent, B = n
        if (start >= 0 && n->parent != nullptr) {
          consider(n->parent, n, static_cast<uint32_t>(q - start), rotation);
        }
      } else if (start == q) {  // the window is n (a whole number of blocks away): B = n alone
        consider(nullptr, n, 0, rotation);
      } else {  // the window starts in n: A = n, B = a child of n that continues it
        const uint32_t s = static_cast<uint32_t>(bt - (start - q));
        bool continued = false;
        for (const auto& [h, bucket] : n->children) {
          for (const TrieNode* c : bucket) {
            if (std::equal(block.begin() + s, block.end(), c->token_ids.begin())) {
              continued = true;
              consider(n, c, s, rotation);
            }
          }
        }
        if (!continued) consider_tail(n, s, rotation);
      }
    }
  }
  std::sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    if (a.matched_tokens != b.matched_tokens) return a.matched_tokens > b.matched_tokens;
    if (a.distance_bits != b.distance_bits) return a.distance_bits < b.distance_bits;
    return a.node_id < b.node_id || (a.node_id == b.node_id && a.token_shift < b.token_shift);
  });
  if (out.size() > max_candidates) out.resize(max_candidates);
  if (detected && out.empty()) ++counters_.position_shifted_skipped;
  return out;
}

std::vector<uint64_t> ClusterIndex::Dependents(uint64_t node_id) const {
  std::vector<uint64_t> out;
  if (auto it = dependents_.find(node_id); it != dependents_.end()) {
    out.assign(it->second.begin(), it->second.end());
    std::sort(out.begin(), out.end());
  }
  return out;
}

size_t ClusterIndex::GroupSize(const TrieNode& node) const {
  auto it = groups_.find(GroupKey(node.depth, node.token_ids));
  return it == groups_.end() ? 0 : it->second.size();
}

size_t ClusterIndex::NumDependents(uint64_t node_id) const {
  auto it = dependents_.find(node_id);
  return it == dependents_.end() ? 0 : it->second.size();
}

std::vector<std::pair<uint64_t, std::vector<uint64_t>>> ClusterIndex::DirtyGroups(
    size_t max) const {
  std::vector<std::pair<uint64_t, std::vector<uint64_t>>> out;
  for (uint64_t key : dirty_groups_) {
    if (out.size() >= max) break;
    auto it = groups_.find(key);
    if (it != groups_.end()) out.emplace_back(key, it->second);
  }
  return out;
}

void ClusterIndex::SettleGroup(uint64_t key, std::vector<uint64_t> ids) {
  auto it = groups_.find(key);
  if (it == groups_.end()) {
    dirty_groups_.erase(key);
    return;
  }
  std::vector<uint64_t> now = it->second;
  std::sort(now.begin(), now.end());
  std::sort(ids.begin(), ids.end());
  if (now == ids) dirty_groups_.erase(key);
}

void ClusterIndex::AddStats(BlockTrie* trie, ClusterStats* out) const {
  ClusterStats s = counters_;
  s.ngram_entries = windows_.num_entries();
  s.centroids = dependents_.size();
  for (const auto& [c, members] : dependents_) s.residual_nodes += members.size();
  for (int i = 0; i < kHistogramBuckets; ++i) {
    s.path_surprisal_histogram[i] = path_surprisal_histogram_[i];
  }
  for (uint64_t key : multi_groups_) {  // only groups of near-duplicates: no walk of the trie
    const std::vector<uint64_t>& ids = groups_.at(key);
    const TrieNode* first = trie->Find(*std::min_element(ids.begin(), ids.end()));
    if (first == nullptr) continue;
    ++s.near_dup_groups;
    for (uint64_t id : ids) {
      const TrieNode* n = trie->Find(id);
      if (n == nullptr || n == first || n->depth != first->depth ||
          n->token_ids != first->token_ids) {
        continue;
      }
      ++s.branch_distance_histogram[HistogramBucket(TrieDistanceBits(n, first))];
    }
  }
  out->Merge(s);
}

}  // namespace kvtrie
