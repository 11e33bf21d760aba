#include "trie/tier_policy.h"

#include <algorithm>

namespace kvtrie {

double GdsfValue(uint64_t refs, uint32_t depth, uint64_t bytes_stored) {
  const double kib = std::max<double>(1.0, static_cast<double>(bytes_stored) / 1024.0);
  return static_cast<double>(std::max<uint64_t>(1, refs)) * (1.0 + depth) / kib;
}

void GdsfQueue::Access(QueueSlot* slot, uint64_t seq, void* item, uint64_t refs, uint32_t depth,
                       uint64_t bytes_stored, bool member) {
  SetMember(slot, seq, item, false);
  slot->priority = clock_ + GdsfValue(refs, depth, bytes_stored);
  slot->protected_segment = refs >= 2;
  SetMember(slot, seq, item, member);
}

void GdsfQueue::SetMember(QueueSlot* slot, uint64_t seq, void* item, bool member) {
  if (slot->member == member) return;
  if (member) {
    order_[Key{slot->protected_segment, slot->priority, seq}] = {slot, item};
  } else {
    order_.erase(Key{slot->protected_segment, slot->priority, seq});
  }
  slot->member = member;
}

void* GdsfQueue::Lowest() const { return order_.empty() ? nullptr : order_.begin()->second.second; }

void* GdsfQueue::Pop() {
  if (order_.empty()) return nullptr;
  auto it = order_.begin();
  auto [slot, item] = it->second;
  clock_ = std::max(clock_, std::get<1>(it->first));
  slot->member = false;
  order_.erase(it);
  return item;
}

}  // namespace kvtrie
