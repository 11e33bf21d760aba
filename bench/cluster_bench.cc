// bench/cluster_bench.cc — near-duplicate clusters (issue 4): stored bytes of the real neardup/
// and sessions/ dumps (tests/data) under each storage scheme, and each near-duplicate branch's size
// after its divergence as % of its standalone encoding at the same error target.
//
// Schemes, all in one in-process KvStore per row (block_tokens 16):
//   (a) every session alone, dense fp16 (what a per-request cache without sharing holds);
//   (b) exact-prefix dedup only (vLLM / SGLang prefix caching): dense bytes of the trie's nodes;
//   (c) kvtrie without centroids (--near_dup_clusters=false): lossless / residual at the target;
//   (d) kvtrie with centroids: lossless / residual at the target; (d0) the same with
//       position-shifted branches stored standalone (--cluster_position_shifted=false: before
//       they were coded against a centroid at the offset, codec/reference_shift.h).
// Puts go in order n0, n1, n2, n3, s0, s1, s2, s3 into one namespace.
// Then the insertion rows (issue 20, any offset): Genesis 1-3 and the same text after an insertion
// of 4..64 tokens (made by the reference worker's model, tests/insertion_dumps.h), each pair in its
// own store, with the n-gram index off (before) and on.
// Then the centroid Delete (issue 20): n0..n3 alone, n0's own blocks deleted, bytes before/after.
// Run: build/bench/cluster_bench [--target=0.1] > bench/cluster_bench.md
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "client/worker/test_model.h"
#include "codec/block_codec.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "tests/insertion_dumps.h"
#include "trie/kv_store.h"
#include "trie/kv_store_testing.h"

namespace kvtrie {
namespace {

constexpr uint32_t kBlockTokens = 16;
const char* const kNames[] = {"neardup/n0",  "neardup/n1",  "neardup/n2",  "neardup/n3",
                              "sessions/s0", "sessions/s1", "sessions/s2", "sessions/s3"};

// Puts every full block of `d` into namespace "bench" (the store encodes it with `enc`); exits
// naming `what` if it fails.
PutSummary PutOrExit(KvStore* store, const KvDump& d, const EncodeOptions& enc, const char* what) {
  ModelInfo m{d.model_id, {d.num_layers, d.num_kv_heads, kBlockTokens, d.head_dim, d.dtype}};
  auto session = store->BeginPut("bench", m, d.token_ids, d.surprisal_bits, enc);
  std::vector<uint8_t> block(m.geometry.num_bytes());
  for (size_t b = 0; session.ok() && b < d.num_tokens() / kBlockTokens; ++b) {
    GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
    if (!(*session)->AddLayers(b, 0, 0, block).ok()) std::exit(1);
  }
  absl::StatusOr<PutSummary> s =
      session.ok() ? (*session)->Finish() : absl::StatusOr<PutSummary>(session.status());
  if (!s.ok()) {
    std::fprintf(stderr, "put %s: %s\n", what, std::string(s.status().message()).c_str());
    std::exit(1);
  }
  return *std::move(s);
}

struct Run {
  uint64_t trie_logical = 0;  // dense bytes of the trie's nodes
  uint64_t stored = 0;        // encoded bytes of the trie's nodes
  std::map<std::string, PutSummary> puts;
  ClusterStats cluster;
};

Run Store(const std::vector<KvDump>& dumps, const EncodeOptions& enc, bool clusters,
          bool shifted = true) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvtrie_cluster_bench_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  StoreOptions o;
  o.data_dir = dir.string();
  o.near_dup.enabled = clusters;
  o.near_dup.position_shifted = shifted;
  auto store = KvStore::Open(o);
  if (!store.ok()) {
    std::fprintf(stderr, "open: %s\n", std::string(store.status().message()).c_str());
    std::exit(1);
  }
  Run run;
  for (size_t i = 0; i < dumps.size(); ++i) {
    run.puts[kNames[i]] = PutOrExit(store->get(), dumps[i], enc, kNames[i]);
  }
  const StoreStats st = (*store)->Stats("bench");
  run.trie_logical = st.bytes_logical;
  run.stored = st.bytes_stored;
  run.cluster = st.cluster;
  store->reset();
  std::filesystem::remove_all(dir);
  return run;
}

// Encoded Puts (issue 20): dumps [begin, end) with every block encoded as a worker does (fast
// profile, no context) and put as it came (AddEncodedBlock: stored standalone); the namespace's
// stored bytes then, and after the background cluster pass ran until a round encodes nothing.
// Puts `d` with every block encoded as a worker does (fast profile, no context), as it came
// (AddEncodedBlock: stored standalone).
void PutEncodedOrExit(KvStore* store, const KvDump& d, const EncodeOptions& enc) {
  ModelInfo m{d.model_id, {d.num_layers, d.num_kv_heads, kBlockTokens, d.head_dim, d.dtype}};
  auto session = store->BeginPut("bench", m, d.token_ids, d.surprisal_bits, enc);
  if (!session.ok()) std::exit(1);
  std::vector<uint8_t> block(m.geometry.num_bytes());
  for (size_t b = 0; b < d.num_tokens() / kBlockTokens; ++b) {
    GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
    absl::StatusOr<EncodedBlock> e = EncodeBlock(m.geometry, block, enc, PredictionContext{});
    if (!e.ok()) std::exit(1);
    PutSession::ClientError err{e->rel_rms_error_k, e->rel_rms_error_v, e->max_abs_error};
    if (!(*session)->AddEncodedBlock(static_cast<uint32_t>(b), std::move(e->bytes), err).ok()) {
      std::exit(1);
    }
  }
  if (!(*session)->Finish().ok()) std::exit(1);
}

std::pair<uint64_t, uint64_t> StoreEncoded(const std::vector<KvDump>& dumps, size_t begin,
                                           size_t end, const EncodeOptions& enc) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvtrie_cluster_bench_enc_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  StoreOptions o;
  o.data_dir = dir.string();
  auto store = KvStore::Open(o);
  if (!store.ok()) std::exit(1);
  for (size_t i = begin; i < end; ++i) PutEncodedOrExit(store->get(), dumps[i], enc);
  const uint64_t before = (*store)->Stats("bench").bytes_stored;
  while (KvStoreTestPeer::RunClusterPass(store->get()).encodings > 0) {
  }
  const uint64_t after = (*store)->Stats("bench").bytes_stored;
  store->reset();
  std::filesystem::remove_all(dir);
  return {before, after};
}

// The centroid Delete (issue 20): n0..n3 stored with `enc`, then n0's own blocks from 8 on deleted
// (the centroids of n1..n3's blocks after their divergences): the namespace's stored bytes before
// and after, and what the Delete re-elected and re-encoded. `encoded` (issue 33, the default
// path): each block encoded by the client and stored standalone, then the background cluster
// pass run until a round encodes nothing (it codes the members against n0's blocks), then the
// Delete.
struct DeleteRun {
  uint64_t before = 0, after = 0;
  DeleteSummary deleted;
};
constexpr size_t kFirstDeleted = 8;

DeleteRun StoreAndDeleteCentroids(const std::vector<KvDump>& dumps, const EncodeOptions& enc,
                                  bool retain, bool encoded = false) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvtrie_cluster_bench_delete_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  StoreOptions o;
  o.data_dir = dir.string();
  o.near_dup.retain_lossy_centroids = retain;
  auto store = KvStore::Open(o);
  if (!store.ok()) std::exit(1);
  for (size_t i = 0; i < 4; ++i) {
    if (encoded) {
      PutEncodedOrExit(store->get(), dumps[i], enc);
    } else {
      PutOrExit(store->get(), dumps[i], enc, kNames[i]);
    }
  }
  while (encoded && KvStoreTestPeer::RunClusterPass(store->get()).encodings > 0) {
  }
  DeleteRun run;
  run.before = (*store)->Stats("bench").bytes_stored;
  const KvDump& n0 = dumps[0];
  std::vector<uint32_t> prefix(n0.token_ids.begin(),
                               n0.token_ids.begin() + (kFirstDeleted + 1) * kBlockTokens);
  auto del = (*store)->Delete("bench", n0.model_id, prefix);
  if (!del.ok()) {
    std::fprintf(stderr, "delete: %s\n", std::string(del.status().message()).c_str());
    std::exit(1);
  }
  run.deleted = *del;
  run.after = (*store)->Stats("bench").bytes_stored;
  store->reset();
  std::filesystem::remove_all(dir);
  return run;
}

// Every arrival order of n0..n3 (issue 20): the namespace's stored bytes after the Puts and after
// the background cluster pass ran until a round encodes nothing, and the centroids' achieved
// error as a share of the target (lossy: how much room a re-encoding of one would have).
struct OrderRun {
  std::string order;
  uint64_t put = 0, pass = 0;
  std::vector<double> centroid_error_share;  // max(K, V) achieved / target, per centroid
};

// `encoded`: the default path (each block encoded by the client, fast profile, stored standalone).
OrderRun PutInOrder(const std::vector<KvDump>& dumps, const std::vector<int>& order,
                    const EncodeOptions& enc, bool encoded = false) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvtrie_cluster_bench_order_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  StoreOptions o;
  o.data_dir = dir.string();
  o.background = false;
  o.cluster_pass_interval_ms = 0;  // run below, once every Put is in
  auto store = KvStore::Open(o);
  if (!store.ok()) std::exit(1);
  OrderRun r;
  for (int i : order) {
    if (encoded) {
      PutEncodedOrExit(store->get(), dumps[i], enc);
    } else {
      PutOrExit(store->get(), dumps[i], enc, kNames[i]);
    }
    r.order += std::string(kNames[i]).substr(std::strlen("neardup/"));
  }
  r.put = (*store)->Stats("bench").bytes_stored;
  while (KvStoreTestPeer::RunClusterPass(store->get()).encodings > 0) {
  }
  r.pass = (*store)->Stats("bench").bytes_stored;
  if (enc.target_rel_rms > 0) {
    absl::flat_hash_set<uint64_t> seen;
    for (int i = 0; i < 4; ++i) {
      for (uint64_t id :
           (*store)->Lookup("bench", dumps[i].model_id, dumps[i].token_ids).node_ids) {
        auto in = (*store)->Inspect("bench", dumps[i].model_id, id);
        if (!in.ok() || !seen.insert(id).second || in->node.dependents == 0) continue;
        r.centroid_error_share.push_back(
            std::max(in->node.rel_rms_error_k, in->node.rel_rms_error_v) / enc.target_rel_rms);
      }
    }
  }
  store->reset();
  std::filesystem::remove_all(dir);
  return r;
}

void PrintArrivalOrders(const std::vector<KvDump>& dumps, const EncodeOptions& lossless,
                        const EncodeOptions& lossy, const EncodeOptions& fast_lossless,
                        const EncodeOptions& fast_lossy) {
  std::printf(
      "\nArrival orders (issues 20, 33): n0..n3 Put in each of the 24 orders, server-encoded "
      "(compact profile) and client-encoded (the default path: fast profile, stored standalone), "
      "then the background cluster pass run until a round encodes nothing. Target: every order "
      "within 0.5%% (lossless) or 5%% (lossy) of the best order's bytes after the pass.\n\n");
  std::printf(
      "| path | encoding | best after Puts | worst after Puts | best after the pass | worst after "
      "the pass | worst order | worst / best | target |\n");
  std::printf("|---|---|---:|---:|---:|---:|---|---:|---|\n");
  std::vector<double> shares;
  struct Row {
    const char* path;
    const char* name;
    EncodeOptions enc;
    bool encoded;
    double target;
  };
  for (const Row& row : {Row{"compact", "lossless", lossless, false, 1.005},
                         Row{"compact", "lossy", lossy, false, 1.05},
                         Row{"default (client-encoded)", "lossless", fast_lossless, true, 1.005},
                         Row{"default (client-encoded)", "lossy", fast_lossy, true, 1.05}}) {
    const EncodeOptions& enc = row.enc;
    std::vector<int> order = {0, 1, 2, 3};
    uint64_t best_put = UINT64_MAX, worst_put = 0, best = UINT64_MAX, worst = 0;
    std::string worst_order;
    do {
      const OrderRun r = PutInOrder(dumps, order, enc, row.encoded);
      best_put = std::min(best_put, r.put);
      worst_put = std::max(worst_put, r.put);
      best = std::min(best, r.pass);
      if (r.pass > worst) worst_order = r.order;
      worst = std::max(worst, r.pass);
      if (!row.encoded) {
        shares.insert(shares.end(), r.centroid_error_share.begin(), r.centroid_error_share.end());
      }
    } while (std::next_permutation(order.begin(), order.end()));
    const double ratio = double(worst) / best;
    std::printf("| %s | %s | %llu | %llu | %llu | %llu | %s | %+.2f%% | %s |\n", row.path, row.name,
                (unsigned long long)best_put, (unsigned long long)worst_put,
                (unsigned long long)best, (unsigned long long)worst, worst_order.c_str(),
                100 * (ratio - 1), ratio <= row.target ? "met" : "NOT met");
  }
  if (!shares.empty()) {
    std::sort(shares.begin(), shares.end());
    std::printf(
        "\nLossy centroids (every compact order): achieved error max(K, V) / target over %zu "
        "centroids: "
        "min %.3f, median %.3f, max %.3f. A lossy centroid re-encoded (to become a member of "
        "another, or standalone from a residual) adds its new error to this one, so it has room "
        "for a new error of at most sqrt(1 - share^2) of the target; its members, coded against "
        "its reconstruction, would all change too. The pass moves a lossy cluster only when "
        "its bytes fall with every reconstruction kept exact (lossless coding of it), which no "
        "move here does: each order keeps its Put bytes.\n",
        shares.size(), shares.front(), shares[shares.size() / 2], shares.back());
  }
}

// Bytes a Put stored (new blocks only), over blocks [from, end).
uint64_t PutBytes(const PutSummary& s, size_t from = 0) {
  uint64_t n = 0;
  for (const BlockReport& r : s.blocks)
    if (r.block_index >= from) n += r.bytes_stored;
  return n;
}
uint64_t PutLogical(const PutSummary& s) {
  uint64_t n = 0;
  for (const BlockReport& r : s.blocks)
    if (r.outcome != BlockOutcome::kDeduplicated) n += r.bytes_logical;
  return n;
}

size_t DivergenceBlock(const KvDump& a, const KvDump& b) {
  size_t i = 0;
  while (i < a.num_tokens() && i < b.num_tokens() && a.token_ids[i] == b.token_ids[i]) ++i;
  return i / kBlockTokens;
}

// Any offset (issue 20): Genesis 1-3 stored, then the same text after an insertion of n tokens
// (tests/insertion_dumps.h); the bytes of the variant's blocks wholly after the insertion, with
// the centroid search `mode`: 0 = no centroids (standalone), 1 = half-block windows within
// block_tokens / 2 (--cluster_ngram_index=false, before), 2 = the n-gram index (after).
struct InsertionRun {
  uint64_t after = 0;  // bytes of blocks [first, 32)
  int residuals = 0;   // of those, stored against a centroid
  uint64_t ngram_entries = 0;
  uint64_t gated = 0;  // candidates over the distance limit
};

// `encoded`: the default path (each block encoded by the client, fast profile, stored
// standalone), then the background cluster pass run until a round encodes nothing; the bytes
// are then read from the stored nodes (Inspect), after the pass.
InsertionRun StoreInsertion(const KvDump& base, const KvDump& ins, size_t first,
                            const EncodeOptions& enc, int mode, bool encoded = false) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvtrie_cluster_bench_ins_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  StoreOptions o;
  o.data_dir = dir.string();
  o.near_dup.enabled = mode != 0;
  o.near_dup.ngram_index = mode == 2;
  auto store = KvStore::Open(o);
  if (!store.ok()) std::exit(1);
  InsertionRun run;
  if (encoded) {
    for (const KvDump* d : {&base, &ins}) PutEncodedOrExit(store->get(), *d, enc);
    while (KvStoreTestPeer::RunClusterPass(store->get()).encodings > 0) {
    }
    const std::vector<uint64_t> ids =
        (*store)->Lookup("bench", ins.model_id, ins.token_ids).node_ids;
    for (size_t b = first; b < ids.size(); ++b) {
      auto in = (*store)->Inspect("bench", ins.model_id, ids[b]);
      if (!in.ok()) std::exit(1);
      run.after += in->node.bytes_stored;
      run.residuals += in->node.reference_node_id != 0;
    }
  }
  for (const KvDump* d : {&base, &ins}) {
    if (encoded) break;
    const PutSummary s = PutOrExit(store->get(), *d, enc, "insertion");
    if (d != &ins) continue;
    for (const BlockReport& r : s.blocks) {
      if (r.block_index < first) continue;
      run.after += r.bytes_stored;
      run.residuals += r.outcome == BlockOutcome::kResidualOfCentroid;
    }
  }
  const ClusterStats cs = (*store)->Stats("bench").cluster;
  run.ngram_entries = cs.ngram_entries;
  run.gated = cs.gated_by_distance;
  store->reset();
  std::filesystem::remove_all(dir);
  return run;
}

void PrintInsertionRows(double target) {
  const worker::LlamaModel* model = worker::testing::TestModel();
  if (model == nullptr) {
    std::printf("\n(insertion rows skipped: no model at %s)\n",
                worker::testing::TestModelPath().c_str());
    return;
  }
  absl::StatusOr<KvDump> base = testing_insertion::BaseDump(*model);
  if (!base.ok()) std::exit(1);
  std::printf(
      "\nAny offset (issue 20): Genesis 1-3 (512 tokens) stored, then the same text with n tokens "
      "of a later passage inserted before token %zu (tests/insertion_dumps.h, the reference "
      "worker's model). Bytes of the variant's blocks wholly after the insertion (`first`..31) as "
      "a share of the same blocks standalone (c); before = half-block windows at shifts within 8 "
      "tokens (--cluster_ngram_index=false), after = the n-gram index (default: windows of 8 "
      "tokens every 4, any shift). Target: <= 15 %% lossy.\n\n",
      testing_insertion::kInsertAt);
  std::printf(
      "| inserted tokens | first | lossless before | lossless after | lossy before | lossy after "
      "| residual blocks after (lossless / lossy) | gated by distance | n-gram entries |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  const EncodeOptions lossless{.encoding = Encoding::kLossless};
  const EncodeOptions lossy{.encoding = Encoding::kResidual, .target_rel_rms = target};
  for (size_t n : {4, 8, 9, 12, 16, 64}) {
    absl::StatusOr<KvDump> ins = testing_insertion::InsertionDump(*model, n);
    if (!ins.ok()) std::exit(1);
    const size_t first = (testing_insertion::kInsertAt + n + kBlockTokens - 1) / kBlockTokens;
    InsertionRun r[2][3];
    for (int mode = 0; mode < 3; ++mode) {
      r[0][mode] = StoreInsertion(*base, *ins, first, lossless, mode);
      r[1][mode] = StoreInsertion(*base, *ins, first, lossy, mode);
    }
    auto pct = [&](int e, int mode) { return 100.0 * r[e][mode].after / r[e][0].after; };
    std::printf(
        "| %zu | %zu | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %d / %d of %zu | %llu | %llu |\n", n,
        first, pct(0, 1), pct(0, 2), pct(1, 1), pct(1, 2), r[0][2].residuals, r[1][2].residuals,
        32 - first, (unsigned long long)r[1][2].gated, (unsigned long long)r[1][2].ngram_entries);
  }
  // The default path (issue 33): the same pairs, every block encoded by the client (fast
  // profile) and stored standalone; the pass looks at each once for a block stored before it
  // that it repeats at any offset (trie/cluster_policy.h, "Any offset").
  std::printf(
      "\nThe same on the default path (issue 33): every block encoded by the client (fast "
      "profile, what workers send) and stored standalone, then the background cluster pass run "
      "until a round encodes nothing; it codes each block's exact reconstruction LOSSLESS against "
      "the stored text's window at the offset when smaller. Share of the same blocks encoded "
      "alone (fast, no centroids). Lossy blocks are not looked at (tried, 0 of these 145 were "
      "smaller: a lossy reconstruction coded exactly against a RoPE-turned window of another). "
      "Target: <= 15 %% lossy.\n\n");
  std::printf(
      "| inserted tokens | first | lossless after the pass | lossy after the pass | residual "
      "blocks after (lossless / lossy) |\n");
  std::printf("|---:|---:|---:|---:|---:|\n");
  const EncodeOptions fast_lossless{.encoding = Encoding::kLossless, .profile = Profile::kFast};
  const EncodeOptions fast_lossy{
      .encoding = Encoding::kResidual, .profile = Profile::kFast, .target_rel_rms = target};
  for (size_t n : {4, 8, 9, 12, 16, 64}) {
    absl::StatusOr<KvDump> ins = testing_insertion::InsertionDump(*model, n);
    if (!ins.ok()) std::exit(1);
    const size_t first = (testing_insertion::kInsertAt + n + kBlockTokens - 1) / kBlockTokens;
    InsertionRun r[2][2];  // [lossless, lossy][alone, with the pass]
    for (int mode = 0; mode < 2; ++mode) {
      r[0][mode] = StoreInsertion(*base, *ins, first, fast_lossless, mode == 0 ? 0 : 2, true);
      r[1][mode] = StoreInsertion(*base, *ins, first, fast_lossy, mode == 0 ? 0 : 2, true);
    }
    auto pct = [&](int e, int mode) { return 100.0 * r[e][mode].after / r[e][0].after; };
    std::printf("| %zu | %zu | %.2f%% | %.2f%% | %d / %d of %zu |\n", n, first, pct(0, 1),
                pct(1, 1), r[0][1].residuals, r[1][1].residuals, 32 - first);
  }
}

// How long a fresh namespace's near-duplicate sessions take to settle on the default path
// (issue 33): n0..n3 client-encoded into a store with the pass at its defaults (a round every
// 1000 ms, 64 encodings per round, the thread at nice 10); from the last Put until the round
// after which the bytes no longer change (three more rounds without a change confirm it).
struct SettleRun {
  double seconds = 0;  // last Put -> the end of the last round that changed the bytes
  uint64_t before = 0, after = 0;
  uint64_t rounds = 0;  // rounds that visited a group, counted at their end
};

SettleRun SettleAtDefaults(const std::vector<KvDump>& dumps, const EncodeOptions& enc) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvtrie_cluster_bench_settle_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  StoreOptions o;
  o.data_dir = dir.string();
  o.cluster_pass_interval_ms = 1000;  // the server's defaults (--cluster_pass_interval_ms, ...)
  o.cluster_pass_blocks_per_round = 64;
  auto store = KvStore::Open(o);
  if (!store.ok()) std::exit(1);
  for (size_t i = 0; i < 4; ++i) PutEncodedOrExit(store->get(), dumps[i], enc);
  const auto start = std::chrono::steady_clock::now();
  SettleRun run;
  StoreStats st = (*store)->Stats("bench");
  run.before = st.bytes_stored;
  uint64_t bytes = st.bytes_stored, rounds_at_change = st.cluster_pass_rounds;
  auto changed_at = start;
  while (std::chrono::steady_clock::now() - start < std::chrono::seconds(120)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    st = (*store)->Stats("bench");
    if (st.bytes_stored != bytes) {
      bytes = st.bytes_stored;
      changed_at = std::chrono::steady_clock::now();
      rounds_at_change = st.cluster_pass_rounds;
    } else if (std::chrono::steady_clock::now() - changed_at > std::chrono::seconds(3)) {
      break;  // three more rounds changed nothing
    }
  }
  run.seconds = std::chrono::duration<double>(changed_at - start).count();
  run.after = bytes;
  run.rounds = rounds_at_change;
  store->reset();
  std::filesystem::remove_all(dir);
  return run;
}

int Main(int argc, char** argv) {
  // The store's log lines go to stderr: stdout is the report (`> bench/cluster_bench.md`).
  spdlog::set_default_logger(spdlog::stderr_logger_mt("cluster_bench"));
  double target = 0.1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--target=", 9) == 0) target = std::atof(argv[i] + 9);
  }
  std::vector<KvDump> dumps;
  for (const char* name : kNames) {
    auto d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
    if (!d.ok()) {
      std::fprintf(stderr, "%s: %s\n", name, std::string(d.status().message()).c_str());
      return 1;
    }
    dumps.push_back(*std::move(d));
  }
  const EncodeOptions raw{.encoding = Encoding::kRaw};
  const EncodeOptions lossless{.encoding = Encoding::kLossless};
  const EncodeOptions lossy{.encoding = Encoding::kResidual, .target_rel_rms = target};
  // What a worker encodes (the default path: fast profile, the client encodes).
  const EncodeOptions fast_lossless{.encoding = Encoding::kLossless, .profile = Profile::kFast};
  const EncodeOptions fast_lossy{
      .encoding = Encoding::kResidual, .profile = Profile::kFast, .target_rel_rms = target};
  const Run dedup = Store(dumps, raw, false);
  const Run ll_plain = Store(dumps, lossless, false), ll_cent = Store(dumps, lossless, true);
  const Run ly_plain = Store(dumps, lossy, false), ly_cent = Store(dumps, lossy, true);
  const Run ll_unshifted = Store(dumps, lossless, true, false);
  const Run ly_unshifted = Store(dumps, lossy, true, false);

  auto set_bytes = [](const Run& r, const char* prefix, bool logical) {
    uint64_t n = 0;
    for (const auto& [name, s] : r.puts)
      if (name.rfind(prefix, 0) == 0) n += logical ? PutLogical(s) : PutBytes(s);
    return n;
  };
  uint64_t alone_nd = 0, alone_s = 0;
  for (size_t i = 0; i < dumps.size(); ++i) {
    const uint64_t b = dumps[i].num_tokens() / kBlockTokens * kBlockTokens * dumps[i].num_layers *
                       2 * dumps[i].num_kv_heads * dumps[i].head_dim * 2;
    (i < 4 ? alone_nd : alone_s) += b;
  }
  std::printf(
      "# cluster_bench: near-duplicate clusters on tests/data (stories260K, fp16, "
      "block_tokens 16)\n\n");
  std::printf(
      "Stored bytes; x = smaller than (b) exact-prefix dedup by that factor. Lossy rows: "
      "residual coding at target relative RMS %.3g (the server default). Command: "
      "`build/bench/cluster_bench --target=%g > bench/cluster_bench.md` (stored sizes are "
      "deterministic: one run, no timing).\n\n",
      target, target);
  std::printf(
      "| scheme | neardup n0..n3 | x vs (b) | sessions s0..s3 | x vs (b) | all 8 | x vs (b) |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
  const uint64_t b_nd = set_bytes(dedup, "neardup", true), b_s = set_bytes(dedup, "sessions", true);
  auto row = [&](const char* name, uint64_t nd, uint64_t s) {
    std::printf("| %s | %llu | %.2f | %llu | %.2f | %llu | %.2f |\n", name, (unsigned long long)nd,
                double(b_nd) / nd, (unsigned long long)s, double(b_s) / s,
                (unsigned long long)(nd + s), double(b_nd + b_s) / (nd + s));
  };
  row("(a) every session alone, fp16", alone_nd, alone_s);
  row("(b) exact-prefix dedup only (fp16)", b_nd, b_s);
  row("(c) kvtrie, no centroids, lossless", set_bytes(ll_plain, "neardup", false),
      set_bytes(ll_plain, "sessions", false));
  row("(d0) centroids, shifted branches standalone, lossless",
      set_bytes(ll_unshifted, "neardup", false), set_bytes(ll_unshifted, "sessions", false));
  row("(d) kvtrie + centroids, lossless", set_bytes(ll_cent, "neardup", false),
      set_bytes(ll_cent, "sessions", false));
  row("(c) kvtrie, no centroids, lossy", set_bytes(ly_plain, "neardup", false),
      set_bytes(ly_plain, "sessions", false));
  row("(d0) centroids, shifted branches standalone, lossy",
      set_bytes(ly_unshifted, "neardup", false), set_bytes(ly_unshifted, "sessions", false));
  row("(d) kvtrie + centroids, lossy", set_bytes(ly_cent, "neardup", false),
      set_bytes(ly_cent, "sessions", false));
  // Encoded Puts (the default path: workers encode, fast profile): as stored, then after the
  // background cluster pass.
  for (const auto& [name, enc] :
       {std::pair<const char*, EncodeOptions>{
            "lossless", {.encoding = Encoding::kLossless, .profile = Profile::kFast}},
        {"lossy",
         {.encoding = Encoding::kResidual, .profile = Profile::kFast, .target_rel_rms = target}}}) {
    const auto nd = StoreEncoded(dumps, 0, 4, enc), s = StoreEncoded(dumps, 4, dumps.size(), enc);
    row((std::string("(e0) encoded Puts, as stored, ") + name).c_str(), nd.first, s.first);
    row((std::string("(e) encoded Puts, after the pass, ") + name).c_str(), nd.second, s.second);
  }

  std::printf(
      "\nEach member branch after its divergence from n0: bytes with centroids / bytes "
      "of the same blocks standalone (c), same encoding and target. `div` = the block "
      "holding the changed word (always standalone); `after` = the blocks after it.\n\n");
  std::printf(
      "| branch | div block | blocks after | lossless incl. div | lossless after | "
      "lossy incl. div | lossy after | residual blocks (lossless / lossy) |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int i = 1; i <= 3; ++i) {
    const std::string name = kNames[i];
    const size_t div = DivergenceBlock(dumps[0], dumps[i]);
    auto pct = [&](const Run& c, const Run& p, size_t from) {
      return 100.0 * PutBytes(c.puts.at(name), from) / PutBytes(p.puts.at(name), from);
    };
    auto residuals = [&](const Run& r) {
      int n = 0;
      for (const BlockReport& b : r.puts.at(name).blocks)
        n += b.outcome == BlockOutcome::kResidualOfCentroid;
      return n;
    };
    std::printf("| %s | %zu | %zu | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %d / %d |\n", name.c_str(),
                div, dumps[i].num_tokens() / kBlockTokens - div - 1, pct(ll_cent, ll_plain, div),
                pct(ll_cent, ll_plain, div + 1), pct(ly_cent, ly_plain, div),
                pct(ly_cent, ly_plain, div + 1), residuals(ll_cent), residuals(ly_cent));
  }
  {
    // The position-shifted branch n3 before (d0) and after (d), as a share of standalone (c).
    const std::string name = kNames[3];
    const size_t div = DivergenceBlock(dumps[0], dumps[3]);
    auto pct = [&](const Run& c, const Run& p, size_t from) {
      return 100.0 * PutBytes(c.puts.at(name), from) / PutBytes(p.puts.at(name), from);
    };
    auto residuals = [&](const Run& r) {
      int n = 0;
      for (const BlockReport& b : r.puts.at(name).blocks)
        n += b.outcome == BlockOutcome::kResidualOfCentroid;
      return n;
    };
    std::printf(
        "\nPosition-shifted branch %s (the same text 4 tokens earlier after its changed word): "
        "bytes as a share of the same blocks standalone (c), before = (d0) shifted blocks "
        "standalone, after = (d) coded against n0's window at the offset (keys turned by "
        "RoPE). Its last block repeats n0's last 12 tokens, where n0 ends: a tail window of "
        "n0's last block.\n\n",
        name.c_str());
    std::printf(
        "| %s | lossless incl. div | lossless after | lossy incl. div | lossy after | "
        "residual blocks (lossless / lossy) |\n",
        name.c_str());
    std::printf("|---|---:|---:|---:|---:|---:|\n");
    std::printf("| before (d0) | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %d / %d |\n",
                pct(ll_unshifted, ll_plain, div), pct(ll_unshifted, ll_plain, div + 1),
                pct(ly_unshifted, ly_plain, div), pct(ly_unshifted, ly_plain, div + 1),
                residuals(ll_unshifted), residuals(ly_unshifted));
    std::printf("| after (d) | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %d / %d |\n",
                pct(ll_cent, ll_plain, div), pct(ll_cent, ll_plain, div + 1),
                pct(ly_cent, ly_plain, div), pct(ly_cent, ly_plain, div + 1), residuals(ll_cent),
                residuals(ly_cent));
  }
  {
    std::printf(
        "\nCentroid delete (issue 20): n0..n3 stored, then n0's own blocks %zu-%zu deleted, the "
        "centroids of n1..n3's blocks after their divergences. A cluster whose members are all "
        "bit-exact elects a member (at the old centroid's position, lowest path surprisal, then "
        "hits), re-encoded standalone, and the others are re-encoded against it (lossless coding "
        "of each one's exact reconstruction). A cluster with a lossy member keeps its deleted "
        "centroid, retained (no lookup matches it), until its last member goes (the default; "
        "`--cluster_retain_deleted_centroids=false` re-elects it as a lossless one). Before "
        "issue 20 every member was rewritten standalone lossless: lossy 78850 -> 622124 bytes "
        "(+689%%). The encoded-Put rows are the default path (issue 33): each block encoded by "
        "the client (fast profile) and stored standalone, the background cluster pass run until "
        "it settles (it codes each member's exact reconstruction LOSSLESS against its centroid), "
        "then the Delete. A block stays lossy however it is coded (NodeRecord.lossy), so the "
        "lossy members keep their deleted centroids; before issue 33 their LOSSLESS coding made "
        "them count as bit-exact, every cluster re-elected and the namespace grew: this command "
        "with the old rule measured lossy 162318 -> 285407 bytes (+75.8%%, 24 centroids "
        "re-elected, 47 members re-encoded); through a real server "
        "(tests/cluster_e2e_test.cc, ClusterPassDelete) 162318 -> 290102 before, 162318 -> "
        "162318 now.\n\n",
        kFirstDeleted, dumps[0].num_tokens() / kBlockTokens - 1);
    std::printf(
        "| encoding | bytes before | bytes after | growth | centroids re-elected | members "
        "re-encoded | bytes rewritten | centroids retained | nodes retained | nodes deleted |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    const struct {
      const char* name;
      EncodeOptions enc;
      bool retain;
      bool encoded;
    } rows[] = {{"lossless", lossless, true, false},
                {"lossy (default: retained)", lossy, true, false},
                {"lossy, `--cluster_retain_deleted_centroids=false`", lossy, false, false},
                {"encoded Puts after the pass, lossless", fast_lossless, true, true},
                {"encoded Puts after the pass, lossy (default: retained)", fast_lossy, true, true}};
    for (const auto& row : rows) {
      const DeleteRun r = StoreAndDeleteCentroids(dumps, row.enc, row.retain, row.encoded);
      std::printf("| %s | %llu | %llu | %+.1f%% | %llu | %llu | %llu | %llu | %llu | %llu |\n",
                  row.name, (unsigned long long)r.before, (unsigned long long)r.after,
                  100.0 * (double(r.after) / r.before - 1),
                  (unsigned long long)r.deleted.centroids_reelected,
                  (unsigned long long)r.deleted.nodes_rewritten,
                  (unsigned long long)r.deleted.bytes_rewritten,
                  (unsigned long long)r.deleted.centroids_retained,
                  (unsigned long long)r.deleted.nodes_retained,
                  (unsigned long long)r.deleted.nodes_deleted);
    }
  }
  // The targets, judged on the aligned members n1 and n2 (n3 is position-shifted).
  double worst_after = 0, worst_incl = 0;
  for (int i = 1; i <= 2; ++i) {
    const std::string name = kNames[i];
    const size_t div = DivergenceBlock(dumps[0], dumps[i]);
    worst_after = std::max(worst_after, 100.0 * PutBytes(ly_cent.puts.at(name), div + 1) /
                                            PutBytes(ly_plain.puts.at(name), div + 1));
    worst_incl = std::max(worst_incl, 100.0 * PutBytes(ly_cent.puts.at(name), div) /
                                          PutBytes(ly_plain.puts.at(name), div));
  }
  const double x_ll = double(b_nd) / set_bytes(ll_cent, "neardup", false);
  const double x_ly = double(b_nd) / set_bytes(ly_cent, "neardup", false);
  std::printf("\nTargets (lossy at the default target; n1, n2):\n\n");
  std::printf(
      "- near-dup branch <= 5%% of standalone: worst %.2f%% after the divergence block "
      "(%s), %.2f%% counting the divergence block itself (%s)\n",
      worst_after, worst_after <= 5 ? "met" : "NOT met", worst_incl,
      worst_incl <= 5 ? "met" : "NOT met");
  std::printf(
      "- whole neardup set >= 3x smaller than exact-prefix dedup: %.2fx lossy (%s), "
      "%.2fx lossless (%s)\n",
      x_ly, x_ly >= 3 ? "met" : "NOT met", x_ll, x_ll >= 3 ? "met" : "NOT met");
  const ClusterStats& cs = ly_cent.cluster;
  std::printf(
      "\nStats of the lossy run with centroids: centroids %llu, residual nodes %llu, "
      "near-dup groups %llu, candidates tried %llu, gated by distance %llu, kept "
      "standalone (residual not smaller) %llu, position-shifted coded %llu, position-shifted "
      "skipped %llu.\n",
      (unsigned long long)cs.centroids, (unsigned long long)cs.residual_nodes,
      (unsigned long long)cs.near_dup_groups, (unsigned long long)cs.candidates_tried,
      (unsigned long long)cs.gated_by_distance, (unsigned long long)cs.residual_not_smaller,
      (unsigned long long)cs.position_shifted_coded,
      (unsigned long long)cs.position_shifted_skipped);
  std::printf(
      "\nBranch distance histogram (bits, trie distance of each near-dup group member to "
      "the group's oldest node):");
  for (int i = 0; i < kHistogramBuckets; ++i) {
    if (cs.branch_distance_histogram[i] == 0) continue;
    std::printf(" <%g: %llu;", HistogramUpperBits(i),
                (unsigned long long)cs.branch_distance_histogram[i]);
  }
  std::printf("\n");
  PrintInsertionRows(target);
  PrintArrivalOrders(dumps, lossless, lossy, fast_lossless, fast_lossy);
  std::printf(
      "\nSettling at the default pass interval (issue 33): n0..n3 client-encoded (fast profile) "
      "into a fresh store with the pass at its defaults (a round every 1000 ms, 64 encodings per "
      "round, its thread at nice 10); seconds from the last Put to the last change of the "
      "namespace's bytes (three more rounds changed nothing; `rounds`: rounds that visited a group "
      "and had ended by then). Target: <= 10 s. Timed on this "
      "machine (the only timed row).\n\n");
  std::printf("| encoding | bytes after the Puts | settled bytes | seconds | rounds |\n");
  std::printf("|---|---:|---:|---:|---:|\n");
  for (const auto& [name, enc] :
       {std::pair<const char*, EncodeOptions>{"lossless", fast_lossless}, {"lossy", fast_lossy}}) {
    const SettleRun r = SettleAtDefaults(dumps, enc);
    std::printf("| %s | %llu | %llu | %.1f | %llu |\n", name, (unsigned long long)r.before,
                (unsigned long long)r.after, r.seconds, (unsigned long long)r.rounds);
  }
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) { return kvtrie::Main(argc, argv); }
