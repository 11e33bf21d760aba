#include "trie/block_trie.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtrie {

size_t TrieNode::num_children() const {
  size_t n = 0;
  for (const auto& [hash, bucket] : children) n += bucket.size();
  return n;
}

uint64_t BlockTrie::DefaultTokenHash(absl::Span<const uint32_t> token_ids) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token hash assumes little-endian");
  return XXH3_64bits(token_ids.data(), token_ids.size() * sizeof(uint32_t));
}

namespace {

// min(n's children, 2) without counting them all (the root may have very many).
size_t ChildrenUpToTwo(const TrieNode& n) {
  if (n.children.size() >= 2) return 2;
  if (n.children.empty()) return 0;
  return std::min<size_t>(2, n.children.begin()->second.size());
}

}  // namespace

BlockTrie::BlockTrie(uint32_t block_tokens, TokenHash hash)
    : block_tokens_(block_tokens), hash_(std::move(hash)) {}

TrieNode* BlockTrie::FindChild(const TrieNode* parent, absl::Span<const uint32_t> block) const {
  if (parent->children.empty()) return nullptr;
  auto it = parent->children.find(hash_(block));
  if (it == parent->children.end()) return nullptr;
  for (TrieNode* child : it->second) {
    if (std::equal(block.begin(), block.end(), child->token_ids.begin(), child->token_ids.end())) {
      return child;
    }
  }
  return nullptr;  // same hash, other tokens: a collision, never a match
}

std::vector<TrieNode*> BlockTrie::Match(absl::Span<const uint32_t> token_ids,
                                        size_t max_blocks) const {
  std::vector<TrieNode*> path;
  path.reserve(token_ids.size() / block_tokens_);
  MatchVisit(token_ids, max_blocks, [&](TrieNode* n) {
    path.push_back(n);
    return true;
  });
  return path;
}

size_t BlockTrie::MatchIds(absl::Span<const uint32_t> token_ids, size_t max_blocks,
                           std::vector<uint64_t>* ids) const {
  return WalkChains(token_ids, max_blocks, [ids](const TrieChain& chain, size_t k) {
    if (chain.removing > 0) {  // rare: a delete or eviction is being written, or retained nodes
      for (size_t i = 0; i < k; ++i) {
        if (chain.nodes[i]->hidden()) {
          k = i;
          break;
        }
      }
    }
    ids->insert(ids->end(), chain.ids.begin(), chain.ids.begin() + k);
    return k;
  });
}

TrieChain* BlockTrie::NewChain() {
  auto chain = std::make_unique<TrieChain>();
  TrieChain* raw = chain.get();
  chains_[raw] = std::move(chain);
  return raw;
}

void BlockTrie::DeleteChain(TrieChain* chain) { chains_.erase(chain); }

void BlockTrie::Append(TrieChain* chain, TrieNode* node) {
  node->chain = chain;
  node->chain_pos = chain->base + static_cast<int64_t>(chain->size());
  chain->tokens.insert(chain->tokens.end(), node->token_ids.begin(), node->token_ids.end());
  chain->ids.push_back(node->id);
  chain->nodes.push_back(node);
  if (node->hidden()) ++chain->removing;
}

void BlockTrie::MoveSlots(TrieChain* src, size_t from, size_t to, TrieChain* dst) {
  for (size_t i = from; i < to; ++i) {
    TrieNode* n = src->nodes[i];
    n->chain = dst;
    n->chain_pos = dst->base + static_cast<int64_t>(dst->size() + (i - from));
    if (n->hidden()) {
      --src->removing;
      ++dst->removing;
    }
  }
  dst->tokens.insert(dst->tokens.end(), src->tokens.begin() + from * block_tokens_,
                     src->tokens.begin() + to * block_tokens_);
  dst->ids.insert(dst->ids.end(), src->ids.begin() + from, src->ids.begin() + to);
  dst->nodes.insert(dst->nodes.end(), src->nodes.begin() + from, src->nodes.begin() + to);
}

void BlockTrie::SplitAfter(TrieNode* node) {
  TrieChain* chain = node->chain;
  const size_t head = chain->SlotOf(node) + 1;  // slots [0, head) stay above the branch
  const size_t n = chain->size();
  if (head == n) return;  // already the last slot
  TrieChain* fresh = NewChain();
  if (n - head <= head) {
    // The part below the branch is the shorter one: it moves to the new chain.
    MoveSlots(chain, head, n, fresh);
    chain->tokens.resize(head * block_tokens_);
    chain->ids.resize(head);
    chain->nodes.resize(head);
  } else {
    // The part above moves; the rest shifts to the front of its arrays, its nodes untouched.
    MoveSlots(chain, 0, head, fresh);
    chain->tokens.erase(chain->tokens.begin(), chain->tokens.begin() + head * block_tokens_);
    chain->ids.erase(chain->ids.begin(), chain->ids.begin() + head);
    chain->nodes.erase(chain->nodes.begin(), chain->nodes.begin() + head);
    chain->base += static_cast<int64_t>(head);
  }
}

void BlockTrie::Merge(TrieNode* tail, TrieNode* head) {
  TrieChain* upper = tail->chain;
  TrieChain* lower = head->chain;
  if (lower->size() <= upper->size()) {
    MoveSlots(lower, 0, lower->size(), upper);
    DeleteChain(lower);
    return;
  }
  // The upper chain is the shorter: its slots go in front of the lower chain's.
  TrieChain moved;
  const size_t k = upper->size();
  lower->base -= static_cast<int64_t>(k);
  moved.base = lower->base;
  MoveSlots(upper, 0, k, &moved);
  for (TrieNode* n : moved.nodes) n->chain = lower;
  lower->removing += moved.removing;
  lower->tokens.insert(lower->tokens.begin(), moved.tokens.begin(), moved.tokens.end());
  lower->ids.insert(lower->ids.begin(), moved.ids.begin(), moved.ids.end());
  lower->nodes.insert(lower->nodes.begin(), moved.nodes.begin(), moved.nodes.end());
  DeleteChain(upper);
}

TrieNode* BlockTrie::AddChild(TrieNode* parent, uint64_t id, absl::Span<const uint32_t> block,
                              absl::Span<const float> surprisal_bits) {
  auto node = std::make_unique<TrieNode>();
  node->id = id;
  node->parent = parent;
  node->depth = parent->depth + 1;
  node->token_ids.assign(block.begin(), block.end());
  node->surprisal_bits.assign(surprisal_bits.begin(), surprisal_bits.end());
  double sum = 0;
  for (float s : surprisal_bits) sum += s;
  node->path_surprisal_bits = parent->path_surprisal_bits + sum;
  TrieNode* raw = node.get();
  const size_t siblings = ChildrenUpToTwo(*parent);
  parent->children[hash_(block)].push_back(raw);
  by_id_[id] = std::move(node);
  if (parent == &root_ || siblings >= 2) {
    Append(NewChain(), raw);  // a child of the root or of a branch heads a chain
  } else if (siblings == 0) {
    Append(parent->chain, raw);  // a leaf is the last slot of its chain: extend it
  } else {
    SplitAfter(parent);  // one child before, a branch now
    Append(NewChain(), raw);
  }
  return raw;
}

namespace {

// Sets *flag (one of node's) to `value`, keeping the chain's count of hidden nodes.
void SetHiddenFlag(TrieNode* node, bool* flag, bool value) {
  const bool was = node->hidden();
  *flag = value;
  if (node->hidden() && !was) ++node->chain->removing;
  if (!node->hidden() && was) --node->chain->removing;
}

}  // namespace

void BlockTrie::SetRemoving(TrieNode* node, bool removing) {
  SetHiddenFlag(node, &node->removing, removing);
}

void BlockTrie::SetRetained(TrieNode* node, bool retained) {
  SetHiddenFlag(node, &node->retained, retained);
}

TrieNode* BlockTrie::Find(uint64_t id) {
  if (id == 0) return &root_;
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

void BlockTrie::RemoveSubtree(TrieNode* node, std::vector<uint64_t>* removed) {
  // Iterative post-order so a deep prefix (a long document) cannot overflow the stack.
  std::vector<TrieNode*> order = {node};
  for (size_t i = 0; i < order.size(); ++i) {
    for (const auto& [hash, bucket] : order[i]->children) {
      order.insert(order.end(), bucket.begin(), bucket.end());
    }
  }
  TrieNode* parent = node->parent;
  auto bucket = parent->children.find(hash_(node->token_ids));
  auto& vec = bucket->second;
  vec.erase(std::find(vec.begin(), vec.end(), node));
  if (vec.empty()) parent->children.erase(bucket);
  // Chains: the one holding `node` loses its slots from node's on (all in the subtree); every
  // other chain with a node in the subtree has its head there and goes whole.
  TrieChain* chain = node->chain;
  const size_t slot = chain->SlotOf(node);
  std::vector<TrieChain*> whole;
  for (TrieNode* n : order) {
    if (n->chain != chain && n->chain->SlotOf(n) == 0) whole.push_back(n->chain);
  }
  for (TrieChain* c : whole) DeleteChain(c);
  if (slot == 0) {
    DeleteChain(chain);
  } else {
    for (size_t i = slot; i < chain->size(); ++i) {
      if (chain->nodes[i]->hidden()) --chain->removing;
    }
    chain->tokens.resize(slot * block_tokens_);
    chain->ids.resize(slot);
    chain->nodes.resize(slot);
  }
  // A branch left with one child continues into it.
  if (parent != &root_ && slot == 0 && ChildrenUpToTwo(*parent) == 1) {
    Merge(parent, parent->children.begin()->second.front());
  }
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    removed->push_back((*it)->id);
    by_id_.erase((*it)->id);
  }
}

void BlockTrie::ForEach(const std::function<void(const TrieNode&)>& fn) const {
  std::vector<const TrieNode*> stack = {&root_};
  while (!stack.empty()) {
    const TrieNode* n = stack.back();
    stack.pop_back();
    if (n != &root_) fn(*n);
    for (const auto& [hash, bucket] : n->children)
      stack.insert(stack.end(), bucket.begin(), bucket.end());
  }
}

absl::Status BlockTrie::CheckChains() const {
  size_t slots = 0;
  for (const auto& [key, chain] : chains_) {
    const TrieChain& c = *chain;
    if (c.size() == 0) return absl::InternalError("an empty chain");
    if (c.ids.size() != c.size() || c.tokens.size() != c.size() * block_tokens_) {
      return absl::InternalError(absl::StrCat("chain of ", c.size(), " nodes has ", c.ids.size(),
                                              " ids and ", c.tokens.size(), " tokens"));
    }
    size_t removing = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      const TrieNode* n = c.nodes[i];
      if (n->chain != &c || c.SlotOf(n) != i) {
        return absl::InternalError(absl::StrCat("node ", n->id, " is not at its slot ", i));
      }
      if (c.ids[i] != n->id || !std::equal(n->token_ids.begin(), n->token_ids.end(),
                                           c.tokens.begin() + i * block_tokens_)) {
        return absl::InternalError(absl::StrCat("slot ", i, " differs from node ", n->id));
      }
      if (i + 1 < c.size() && (n->num_children() != 1 || c.nodes[i + 1]->parent != n)) {
        return absl::InternalError(
            absl::StrCat("node ", n->id, " inside a chain has ", n->num_children(), " children"));
      }
      removing += n->hidden() ? 1 : 0;
    }
    if (c.nodes.back()->num_children() == 1) {
      return absl::InternalError(
          absl::StrCat("chain ends at node ", c.nodes.back()->id, " with one child"));
    }
    const TrieNode* up = c.nodes.front()->parent;
    if (up != &root_ && up->num_children() < 2) {
      return absl::InternalError(
          absl::StrCat("chain head ", c.nodes.front()->id, " is the only child of node ", up->id));
    }
    if (removing != c.removing) {
      return absl::InternalError(
          absl::StrCat("chain counts ", c.removing, " hidden nodes, has ", removing));
    }
    slots += c.size();
  }
  if (slots != by_id_.size()) {
    return absl::InternalError(absl::StrCat(slots, " chain slots for ", by_id_.size(), " nodes"));
  }
  return absl::OkStatus();
}

}  // namespace kvtrie
