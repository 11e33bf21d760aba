// trie_bench: longest-prefix match latency of BlockTrie (trie/block_trie.h).
//
// DESIGN.md: "a 1M-token prefix must match in well under 1 ms". Builds tries whose stored paths
// are real-shaped token sequences (random ids over a 32k vocabulary; matching cost depends on the
// number of blocks, not the ids) and times Match() of the full prefix. Baselines run in the same
// process: hashing the same tokens once with XXH3 (the floor of any hash-per-block scheme) and
// one memcmp over them (the floor of any exact-compare scheme: every token of the request is
// read and compared with a stored copy, 2 x 4 bytes per token). "MatchIds" is the Lookup path
// (ModelShard::Match): the matched node ids copied out of the path-compressed chains.
//
//   build/bench/trie_bench
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "trie/block_trie.h"

namespace {

using Clock = std::chrono::steady_clock;

template <typename Fn>
double BestMicros(int reps, Fn fn) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    fn();
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    best = std::min(best, us);
  }
  return best;
}

}  // namespace

int main() {
  constexpr uint32_t kBlockTokens = 16;
  std::mt19937 rng(42);
  std::printf(
      "| prefix tokens | blocks | other paths | Match us | XXH3 us | memcmp us | Match/XXH3 | "
      "MatchIds us | MatchIds/memcmp |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (size_t tokens : {16'384u, 131'072u, 1'048'576u}) {
    for (size_t other_paths : {0u, 64u}) {
      kvtrie::BlockTrie trie(kBlockTokens);
      std::vector<uint32_t> seq(tokens);
      for (auto& t : seq) t = rng() % 32000;
      uint64_t id = 1;
      // Other sessions sharing the first quarter, then diverging: siblings along the path.
      auto insert = [&](const std::vector<uint32_t>& s) {
        kvtrie::TrieNode* at = trie.root();
        for (size_t b = 0; b < s.size() / kBlockTokens; ++b) {
          auto block = absl::MakeConstSpan(s).subspan(b * kBlockTokens, kBlockTokens);
          kvtrie::TrieNode* c = trie.FindChild(at, block);
          at = c ? c : trie.AddChild(at, id++, block, {});
        }
      };
      insert(seq);
      for (size_t p = 0; p < other_paths; ++p) {
        std::vector<uint32_t> other(seq.begin(), seq.begin() + tokens / 4);
        other.resize(tokens / 4 + 64 * kBlockTokens);
        for (size_t i = tokens / 4; i < other.size(); ++i) other[i] = rng() % 32000;
        insert(other);
      }
      size_t matched = 0;
      const double match_us = BestMicros(5, [&] { matched = trie.Match(seq).size(); });
      uint64_t sink = 0;
      const double hash_us = BestMicros(5, [&] {
        for (size_t b = 0; b < tokens / kBlockTokens; ++b) {
          sink += XXH3_64bits(seq.data() + b * kBlockTokens, kBlockTokens * 4);
        }
      });
      std::vector<uint64_t> ids;
      ids.reserve(tokens / kBlockTokens);
      const double ids_us = BestMicros(5, [&] {
        ids.clear();
        trie.MatchIds(seq, 0, &ids);
      });
      std::vector<uint32_t> copy = seq;
      int cmp = 0;
      const double memcmp_us =
          BestMicros(5, [&] { cmp += std::memcmp(seq.data(), copy.data(), tokens * 4); });
      if (matched != tokens / kBlockTokens || ids.size() != matched || (sink == 42 && cmp == 42)) {
        return 1;
      }
      std::printf("| %zu | %zu | %zu | %.0f | %.0f | %.0f | %.1fx | %.0f | %.2fx |\n", tokens,
                  tokens / kBlockTokens, other_paths, match_us, hash_us, memcmp_us,
                  match_us / hash_us, ids_us, ids_us / memcmp_us);
    }
  }
  return 0;
}
