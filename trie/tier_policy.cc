#include "trie/tier_policy.h"

#include <algorithm>

#include "trie/block_trie.h"

namespace kvtrie {

double GdsfValue(const TrieNode& node) {
  const double kib = std::max<double>(1.0, static_cast<double>(node.bytes_stored) / 1024.0);
  return static_cast<double>(std::max<uint64_t>(1, node.tier.refs)) * (1.0 + node.depth) / kib;
}

void GdsfQueue::Access(TrieNode* node, void* owner, bool member) {
  SetMember(node, owner, false);
  (node->tier.*slot_).priority = clock_ + GdsfValue(*node);
  (node->tier.*slot_).protected_segment = node->tier.refs >= 2;
  SetMember(node, owner, member);
}

void GdsfQueue::SetMember(TrieNode* node, void* owner, bool member) {
  QueueSlot& s = node->tier.*slot_;
  if (s.member == member) return;
  if (member) {
    order_[Key{s.protected_segment, s.priority, node->id}] = {node, owner};
  } else {
    order_.erase(Key{s.protected_segment, s.priority, node->id});
  }
  s.member = member;
}

GdsfQueue::Entry GdsfQueue::Lowest() const {
  return order_.empty() ? Entry{} : order_.begin()->second;
}

GdsfQueue::Entry GdsfQueue::Pop() {
  if (order_.empty()) return {};
  auto it = order_.begin();
  Entry e = it->second;
  clock_ = std::max(clock_, std::get<1>(it->first));
  (e.node->tier.*slot_).member = false;
  order_.erase(it);
  return e;
}

}  // namespace kvtrie
