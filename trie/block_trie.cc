#include "trie/block_trie.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

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

BlockTrie::BlockTrie(uint32_t block_tokens, TokenHash hash)
    : block_tokens_(block_tokens), hash_(std::move(hash)) {}

TrieNode* BlockTrie::FindChild(const TrieNode* parent, absl::Span<const uint32_t> block) const {
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

TrieNode* BlockTrie::AddChild(TrieNode* parent, uint64_t id, absl::Span<const uint32_t> block,
                              absl::Span<const float> surprisal_bits) {
  auto node = std::make_unique<TrieNode>();
  node->id = id;
  node->parent = parent;
  node->depth = parent->depth + 1;
  node->token_ids.assign(block.begin(), block.end());
  if (block.size() <= TrieNode::kInlineTokens) {
    std::copy(block.begin(), block.end(), node->inline_tokens);
  }
  node->surprisal_bits.assign(surprisal_bits.begin(), surprisal_bits.end());
  double sum = 0;
  for (float s : surprisal_bits) sum += s;
  node->path_surprisal_bits = parent->path_surprisal_bits + sum;
  TrieNode* raw = node.get();
  parent->children[hash_(block)].push_back(raw);
  parent->only_child = parent->num_children() == 1 ? raw : nullptr;
  by_id_[id] = std::move(node);
  return raw;
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
  parent->only_child = nullptr;
  if (parent->children.size() == 1 && parent->children.begin()->second.size() == 1) {
    parent->only_child = parent->children.begin()->second.front();
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

}  // namespace kvtrie
