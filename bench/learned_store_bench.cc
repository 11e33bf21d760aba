// learned_store_bench: what the store's own learning saves, through KvStore (real RocksDB), on the
// real dumps of bench/make_learned_dumps.sh (split by text). For each mode — learning off (the
// baseline) and on — a fresh store takes every training dump as a RESIDUAL Put (at
// --target_rel_rms), waits until it was learned from (the refit after --refit_tokens publishes
// versions), then takes every held-out test dump; the table gives the bits/component of the test
// blocks as stored (their encoded bytes, envelope included, over their components), the share of
// them coded against a learned state, the states kept and their bytes, and the wall time of the
// test Puts (median of --repeats runs; learning runs in the background, off the Put's path).
//   deploy/build.sh learned_store_bench && bench/make_learned_dumps.sh build &&
//   build/bench/learned_store_bench --dumps=build/learned_dumps
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/bench_flags.h"
#include "bench/learned_data.h"
#include "trie/kv_store.h"
#include "trie/kv_store_testing.h"

namespace kvtrie {
namespace {

using bench::Flag;

struct Result {
  double bits = 0;        // bits/component of the stored test blocks
  double on_learned = 0;  // share of them coded against a learned state
  uint64_t versions = 0;  // states kept
  uint64_t state_bytes = 0;
  double put_seconds = 0;  // the test Puts
  uint64_t blocks = 0;
};

bool PutAll(KvStore* store, const std::vector<Text>& texts, const BlockGeometry& g, double target,
            uint64_t* bytes, uint64_t* blocks) {
  const ModelInfo model{"stories260K", g};
  for (const Text& t : texts) {
    auto session = store->BeginPut("bench", model, t.dump.token_ids, t.dump.surprisal_bits,
                                   {.encoding = Encoding::kResidual, .target_rel_rms = target});
    if (!session.ok()) return false;
    for (size_t b = 0; b < t.blocks.size(); ++b) {
      if (!(*session)->AddLayers(b, 0, 0, t.blocks[b].kv).ok()) return false;
    }
    absl::StatusOr<PutSummary> s = (*session)->Finish();
    if (!s.ok()) {
      std::fprintf(stderr, "%s: %s\n", t.name.c_str(), s.status().ToString().c_str());
      return false;
    }
    for (const BlockReport& r : s->blocks) {
      if (r.outcome == BlockOutcome::kDeduplicated) continue;
      *bytes += r.bytes_stored;
      ++*blocks;
    }
  }
  return true;
}

bool Run(bool learn, const std::vector<Text>& train, const std::vector<Text>& test,
         const BlockGeometry& g, double target, uint64_t refit, Result* out) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("learned_store_bench_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  StoreOptions o;
  o.data_dir = dir.string();
  o.background = false;
  o.predictors.learn = learn;
  o.predictors.refit_every_tokens = refit;
  {
    absl::StatusOr<std::unique_ptr<KvStore>> store = KvStore::Open(o);
    if (!store.ok()) return false;
    uint64_t bytes = 0, blocks = 0;
    if (!PutAll(store->get(), train, g, target, &bytes, &blocks)) return false;
    KvStoreTestPeer::DrainLearning(store->get());
    const uint64_t before = (*store)->Stats("bench").blocks_on_learned;
    bytes = blocks = 0;
    const auto start = std::chrono::steady_clock::now();
    if (!PutAll(store->get(), test, g, target, &bytes, &blocks)) return false;
    out->put_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const StoreStats s = (*store)->Stats("bench");
    out->blocks = blocks;
    out->bits = blocks ? 8.0 * bytes / (double(blocks) * g.num_elements()) : 0;
    out->on_learned = blocks ? double(s.blocks_on_learned - before) / blocks : 0;
    out->versions = s.predictor_versions;
    out->state_bytes = s.predictor_state_bytes;
  }
  std::filesystem::remove_all(dir);
  return true;
}

int Main(int argc, char** argv) {
  const std::string dir = Flag(argc, argv, "dumps", "build/learned_dumps");
  const double target = std::stod(Flag(argc, argv, "target_rel_rms", "0.05"));
  const uint64_t refit = std::stoull(Flag(argc, argv, "refit_tokens", "16384"));
  const int repeats = std::stoi(Flag(argc, argv, "repeats", "3"));
  BlockGeometry g;
  const std::vector<Text> train = LoadDir(dir + "/train", 16, &g);
  const std::vector<Text> test = LoadDir(dir + "/test", 16, &g);
  if (train.empty() || test.empty()) {
    std::fprintf(stderr, "no dumps under %s (run bench/make_learned_dumps.sh)\n", dir.c_str());
    return 1;
  }
  uint64_t train_tokens = 0, test_tokens = 0;
  for (const Text& t : train) train_tokens += t.blocks.size() * 16;
  for (const Text& t : test) test_tokens += t.blocks.size() * 16;
  std::printf(
      "# learned_store_bench: %s; train %zu dumps (%lu tokens), test %zu dumps (%lu tokens)"
      "; RESIDUAL at rel RMS %.3g; refit every %lu tokens; %d repeats (medians)\n",
      dir.c_str(), train.size(), static_cast<unsigned long>(train_tokens), test.size(),
      static_cast<unsigned long>(test_tokens), target, static_cast<unsigned long>(refit), repeats);
  std::printf(
      "| store | test blocks stored | bits/component | coded against a learned state | "
      "states kept | state bytes | test Put seconds |\n|---|---|---|---|---|---|---|\n");
  for (const bool learn : {false, true}) {
    std::vector<Result> runs(repeats);
    for (Result& r : runs) {
      if (!Run(learn, train, test, g, target, refit, &r)) {
        std::fprintf(stderr, "run failed\n");
        return 1;
      }
    }
    std::sort(runs.begin(), runs.end(),
              [](const Result& a, const Result& b) { return a.put_seconds < b.put_seconds; });
    const Result& m = runs[runs.size() / 2];
    std::printf("| %s | %lu | %.3f | %.1f %% | %lu | %lu | %.3f |\n",
                learn ? "learning on" : "learning off (baseline)",
                static_cast<unsigned long>(m.blocks), m.bits, 100 * m.on_learned,
                static_cast<unsigned long>(m.versions), static_cast<unsigned long>(m.state_bytes),
                m.put_seconds);
  }
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) { return kvtrie::Main(argc, argv); }
