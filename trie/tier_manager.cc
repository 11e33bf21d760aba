#include "trie/tier_manager.h"

#include <algorithm>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvtrie {

void TierManager::Counters::Add(const Counters& o) {
  hot_nodes += o.hot_nodes;
  hot_bytes += o.hot_bytes;
  nodes += o.nodes;
  disk_bytes += o.disk_bytes;
  pinned_nodes += o.pinned_nodes;
  demotions += o.demotions;
  demoted_bytes += o.demoted_bytes;
  promotions += o.promotions;
  cold_reads += o.cold_reads;
  cold_read_bytes += o.cold_read_bytes;
  pins_expired += o.pins_expired;
  puts_rejected_disk_full += o.puts_rejected_disk_full;
}

TierManager::TierManager(Options options) : options_(std::move(options)) {}

TierManager::~TierManager() { StopBackground(); }

uint64_t TierManager::Now() const {
  if (options_.now_seconds) return options_.now_seconds();
  return static_cast<uint64_t>(absl::ToUnixSeconds(absl::Now()));
}

void TierManager::StartBackground(std::function<void()> disk_pass) {
  background_ = std::make_unique<std::thread>([this, disk_pass = std::move(disk_pass)] {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(100));
      if (stop_) break;
      if (options_.memory_bytes != 0) Demote(0, options_.memory_bytes / 10 * 9);
      ExpirePins();
      if (disk_pass) {
        mu_.Unlock();
        disk_pass();
        mu_.Lock();
      }
    }
  });
}

void TierManager::StopBackground() {
  if (!background_) return;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  background_->join();
  background_.reset();
}

void TierManager::Maintain() {
  absl::MutexLock lock(&mu_);
  if (options_.memory_bytes != 0) Demote(0, options_.memory_bytes / 10 * 9);
  ExpirePins();
}

TierManager::Entry* TierManager::Find(NodeRef n) const {
  auto it = entries_.find(n);
  return it == entries_.end() ? nullptr : const_cast<Entry*>(&it->second);
}

void TierManager::Demote(uint64_t incoming, uint64_t target) {
  while (hot_bytes_ + incoming > target && !hot_queue_.empty()) {
    Entry* e = static_cast<Entry*>(hot_queue_.Pop());
    const uint64_t size = e->hot->size();
    hot_bytes_ -= size;
    e->counters->hot_nodes -= 1;
    e->counters->hot_bytes -= size;
    e->counters->demotions += 1;
    e->counters->demoted_bytes += size;
    e->hot.reset();  // written through at Put: nothing to write
    e->cold_reads = 0;
  }
}

void TierManager::MakeHot(Entry* e, std::shared_ptr<const std::string> payload) {
  const uint64_t budget = options_.memory_bytes;
  if (!payload || (budget != 0 && payload->size() > budget)) return;
  if (budget != 0) Demote(payload->size(), budget);
  hot_bytes_ += payload->size();
  e->counters->hot_nodes += 1;
  e->counters->hot_bytes += payload->size();
  e->hot = std::move(payload);
  hot_queue_.SetMember(&e->hot_slot, e->seq, e, true);
}

void TierManager::Add(NodeRef n, uint32_t depth, uint64_t bytes,
                      std::shared_ptr<const std::string> payload, bool evictable,
                      uint64_t pinned_until) {
  absl::MutexLock lock(&mu_);
  Entry& e = entries_[n];
  e.seq = next_seq_++;
  e.owner = n.first;
  e.ref = n;
  e.depth = depth;
  e.bytes = bytes;
  e.evictable = evictable;
  e.counters = &counters_[n.first];
  e.counters->nodes += 1;
  e.counters->disk_bytes += bytes;
  disk_bytes_ += bytes;
  if (pinned_until != 0 && (pinned_until == kPinForever || pinned_until > Now())) {
    e.pinned_until = pinned_until;
    pinned_[n] = &e;
    e.counters->pinned_nodes += 1;
  }
  hot_queue_.Access(&e.hot_slot, e.seq, &e, e.refs, e.depth, e.bytes, false);
  MakeHot(&e, std::move(payload));
  evict_queue_.Access(&e.disk_slot, e.seq, &e, e.refs, e.depth, e.bytes, CanEvict(e));
}

void TierManager::Remove(NodeRef n) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(n);
  if (e == nullptr) return;
  hot_queue_.SetMember(&e->hot_slot, e->seq, e, false);
  evict_queue_.SetMember(&e->disk_slot, e->seq, e, false);
  if (e->hot) {
    hot_bytes_ -= e->hot->size();
    e->counters->hot_nodes -= 1;
    e->counters->hot_bytes -= e->hot->size();
  }
  if (pinned_.erase(n)) e->counters->pinned_nodes -= 1;
  disk_bytes_ -= e->bytes;
  e->counters->disk_bytes -= e->bytes;
  e->counters->nodes -= 1;
  entries_.erase(n);
}

void TierManager::Touch(NodeRef n) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(n);
  if (e == nullptr) return;
  ++e->refs;
  hot_queue_.Access(&e->hot_slot, e->seq, e, e->refs, e->depth, e->bytes, e->hot_slot.member);
  evict_queue_.Access(&e->disk_slot, e->seq, e, e->refs, e->depth, e->bytes, e->disk_slot.member);
}

std::shared_ptr<const std::string> TierManager::HotCopy(NodeRef n, uint64_t* generation) const {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(n);
  if (generation != nullptr) *generation = e ? e->generation : 0;
  return e ? e->hot : nullptr;
}

void TierManager::ColdRead(NodeRef n, const std::shared_ptr<const std::string>& payload,
                           uint64_t generation) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(n);
  if (e == nullptr) return;
  e->counters->cold_reads += 1;
  e->counters->cold_read_bytes += payload->size();
  // Promotion: only a node read again while cold comes back, so a one-off scan of cold prefixes
  // does not push hot ones out of memory. Never a payload the node no longer has: one read in a
  // snapshot listed before a re-encoding replaced it (hot, it would be served against the new
  // listing, whose centroid it does not name, until it left memory).
  if (!e->hot && e->generation == generation &&
      ++e->cold_reads >= options_.promote_after_cold_reads) {
    MakeHot(e, payload);
    if (e->hot) {
      e->cold_reads = 0;
      e->counters->promotions += 1;
    }
  }
}

void TierManager::Replace(NodeRef n, std::shared_ptr<const std::string> payload) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(n);
  if (e == nullptr) return;
  disk_bytes_ = disk_bytes_ - e->bytes + payload->size();
  e->counters->disk_bytes = e->counters->disk_bytes - e->bytes + payload->size();
  const bool was_hot = e->hot != nullptr;
  if (was_hot) {
    hot_queue_.SetMember(&e->hot_slot, e->seq, e, false);
    hot_bytes_ -= e->hot->size();
    e->counters->hot_nodes -= 1;
    e->counters->hot_bytes -= e->hot->size();
    e->hot.reset();
  }
  e->bytes = payload->size();
  ++e->generation;
  // Same room-making as a Put: the memory bound holds at once, not at the next background pass.
  if (was_hot) MakeHot(e, std::move(payload));
  evict_queue_.SetMember(&e->disk_slot, e->seq, e, false);
  evict_queue_.Access(&e->disk_slot, e->seq, e, e->refs, e->depth, e->bytes, CanEvict(*e));
}

void TierManager::SetEvictable(NodeRef n, bool evictable) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(n);
  if (e == nullptr) return;
  e->evictable = evictable;
  evict_queue_.SetMember(&e->disk_slot, e->seq, e, CanEvict(*e));
}

uint64_t TierManager::SetPin(NodeRef n, uint64_t until) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(n);
  if (e == nullptr) return 0;
  const uint64_t before = e->pinned_until;
  e->pinned_until = until;
  if (until != 0) {
    if (pinned_.emplace(n, e).second) e->counters->pinned_nodes += 1;
  } else if (pinned_.erase(n)) {
    e->counters->pinned_nodes -= 1;
  }
  evict_queue_.SetMember(&e->disk_slot, e->seq, e, CanEvict(*e));
  return before;
}

uint64_t TierManager::PinnedUntil(NodeRef n) const {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(n);
  return e ? e->pinned_until : 0;
}

void TierManager::ExpirePins() {
  const uint64_t now = Now();
  for (auto it = pinned_.begin(); it != pinned_.end();) {
    Entry* e = it->second;
    if (e->pinned_until != kPinForever && e->pinned_until <= now) {
      e->pinned_until = 0;
      e->counters->pinned_nodes -= 1;
      e->counters->pins_expired += 1;
      evict_queue_.SetMember(&e->disk_slot, e->seq, e, CanEvict(*e));
      pinned_.erase(it++);
    } else {
      ++it;
    }
  }
}

bool TierManager::Reserve(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  const uint64_t budget = options_.disk_bytes;
  if (budget != 0 && disk_bytes_ + side_bytes_ + reserved_ + bytes > budget) return false;
  reserved_ += bytes;
  return true;
}

void TierManager::Unreserve(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  reserved_ -= std::min(reserved_, bytes);
}

void TierManager::AddSideBytes(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  side_bytes_ += bytes;
}

void TierManager::RemoveSideBytes(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  side_bytes_ -= std::min(side_bytes_, bytes);
}

uint64_t TierManager::DiskExcess(uint64_t incoming) const {
  absl::MutexLock lock(&mu_);
  const uint64_t budget = options_.disk_bytes;
  const uint64_t want = disk_bytes_ + side_bytes_ + reserved_ + incoming;
  return budget == 0 || want <= budget ? 0 : want - budget;
}

std::vector<TierManager::NodeRef> TierManager::PopVictims(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  ExpirePins();
  std::vector<NodeRef> out;
  uint64_t covered = 0;
  bool segment = false;
  while (covered < bytes && !evict_queue_.empty()) {
    // A batch stays in one segment: evicting a probation leaf may make its parent the next
    // probation candidate, which must go before any protected node.
    const bool protected_segment =
        static_cast<Entry*>(evict_queue_.Lowest())->disk_slot.protected_segment;
    if (!out.empty() && protected_segment != segment) break;
    segment = protected_segment;
    Entry* e = static_cast<Entry*>(evict_queue_.Pop());
    covered += std::max<uint64_t>(1, e->bytes);
    out.push_back(e->ref);
  }
  return out;
}

void TierManager::CountRejected(Owner owner) {
  absl::MutexLock lock(&mu_);
  counters_[owner].puts_rejected_disk_full += 1;
}

TierManager::Counters TierManager::CountersOf(Owner owner) const {
  absl::MutexLock lock(&mu_);
  auto it = counters_.find(owner);
  return it == counters_.end() ? Counters{} : it->second;
}

uint64_t TierManager::stored_bytes() const {
  absl::MutexLock lock(&mu_);
  return disk_bytes_;
}

}  // namespace kvtrie
