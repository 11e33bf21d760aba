// Tiered storage (issue 5): spill and reload throughput, recovery time vs number of nodes.
//   build/bench/tier_bench [--max_nodes=1000000] [--dir=/tmp/tier_bench]
// Spill/reload use real KV blocks (tests/data, stories260K, 10 KiB dense). Recovery reads only
// node records (payloads are checked when read), so its nodes carry real KV of a reduced
// geometry (1 layer, 1 KV head: 512-byte blocks) to keep the disk small; time does not depend on
// payload size. The crash loop: bench/tier_crash.sh.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "trie/kv_store.h"

namespace kvtrie {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int Main(int argc, char** argv) {
  uint64_t max_nodes = 1000000;
  std::string dir = "/tmp/tier_bench";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--max_nodes=", 0) == 0) max_nodes = std::stoull(a.substr(12));
    if (a.rfind("--dir=", 0) == 0) dir = a.substr(6);
  }
  auto d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/sessions/s0");
  if (!d.ok()) return 1;
  const ModelInfo model{d->model_id, {d->num_layers, d->num_kv_heads, 16, d->head_dim, d->dtype}};
  const BlockGeometry& g = model.geometry;
  std::vector<std::vector<uint8_t>> blocks(d->num_tokens() / 16,
                                           std::vector<uint8_t>(g.num_bytes()));
  for (size_t b = 0; b < blocks.size(); ++b)
    GatherBlock(g, d->num_tokens(), d->k.data(), d->v.data(), b, absl::MakeSpan(blocks[b]));

  // 1. Spill: Puts of 64 MiB of raw blocks under a 4 MiB hot tier; reload: cold Gets after a
  // restart (every payload read from RocksDB).
  std::filesystem::remove_all(dir);
  std::printf("| phase | blocks | MiB | seconds | MiB/s |\n|---|---|---|---|---|\n");
  const int puts = 64 * 1024 * 1024 / (32 * g.num_bytes());
  {
    auto store = KvStore::Open({.data_dir = dir + "/spill", .memory_bytes = 4 << 20});
    auto t0 = std::chrono::steady_clock::now();
    for (int p = 0; p < puts; ++p) {
      auto s = (*store)->BeginPut("n" + std::to_string(p), model, d->token_ids, d->surprisal_bits,
                                  {.encoding = Encoding::kRaw});
      for (size_t b = 0; b < blocks.size(); ++b) (void)(*s)->AddLayers(b, 0, 0, blocks[b]);
      if (!(*s)->Finish().ok()) return 1;
    }
    const double t = Seconds(t0);
    const StoreStats st = (*store)->Stats("");
    std::printf("| put + spill (4 MiB hot) | %d | %.1f | %.2f | %.1f |\n", puts * 32,
                st.disk_bytes / 1048576.0, t, st.disk_bytes / 1048576.0 / t);
    std::printf("| (demoted) | %llu | %.1f | | |\n", (unsigned long long)st.demotions,
                st.demoted_bytes / 1048576.0);
  }
  {
    auto store = KvStore::Open({.data_dir = dir + "/spill", .memory_bytes = 4 << 20});
    auto t0 = std::chrono::steady_clock::now();
    uint64_t bytes = 0, n = 0;
    std::vector<uint8_t> out(g.num_bytes()), parent;
    for (int p = 0; p < puts; ++p) {
      const std::string ns = "n" + std::to_string(p);
      auto got = (*store)->Get(ns, model.model_id, d->token_ids, 0);
      parent.clear();
      for (const BlockRead& b : got->blocks) {
        auto payload = (*store)->ReadPayload(ns, model.model_id, b);
        if (!payload.ok()) return 1;
        bytes += (*payload)->size();
        ++n;
      }
    }
    const double t = Seconds(t0);
    std::printf("| reload (cold Get, CRC-checked) | %llu | %.1f | %.2f | %.1f |\n",
                (unsigned long long)n, bytes / 1048576.0, t, bytes / 1048576.0 / t);
  }

  // 2. Recovery time vs nodes: chains of 1024 blocks, reduced geometry.
  const ModelInfo small{"small", {1, 1, 16, 16, DType::kFp16}};
  std::vector<uint8_t> sb(small.geometry.num_bytes());
  std::copy(blocks[0].begin(), blocks[0].begin() + sb.size(), sb.begin());
  std::printf(
      "\n| nodes | recovery seconds | nodes/s | RSS after open (MiB) |\n|---|---|---|---|\n");
  uint64_t have = 0;
  uint32_t seq = 0;
  for (uint64_t target = 10000; target <= max_nodes; target *= 10) {
    {
      auto store = KvStore::Open({.data_dir = dir + "/recovery", .background = false});
      while (have < target) {
        std::vector<uint32_t> tokens(1024 * 16);
        for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (i % 16 == 0) ? ++seq : i % 512;
        auto s = (*store)->BeginPut("r", small, tokens, {}, {.encoding = Encoding::kRaw});
        for (uint32_t b = 0; b < 1024; ++b) (void)(*s)->AddLayers(b, 0, 0, sb);
        if (!(*s)->Finish().ok()) return 1;
        have += 1024;
      }
    }
    auto t0 = std::chrono::steady_clock::now();
    auto store = KvStore::Open({.data_dir = dir + "/recovery", .background = false});
    const double t = Seconds(t0);
    FILE* f = std::fopen("/proc/self/statm", "r");
    unsigned long size = 0, rss = 0;
    if (f && std::fscanf(f, "%lu %lu", &size, &rss) != 2) rss = 0;
    if (f) std::fclose(f);
    std::printf("| %llu | %.2f | %.0f | %.0f |\n", (unsigned long long)(*store)->recovery().nodes,
                t, (*store)->recovery().nodes / t, rss * 4096.0 / 1048576.0);
    std::fflush(stdout);
  }
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) { return kvtrie::Main(argc, argv); }
