// bench/paper_workload.cc
//
// Section 5 of bench/paper_bench: the multi-session workload through a real store
// (KvStore, real RocksDB, learning on). Sessions are built from held-out texts of bench/texts
// with the reference model: a system prompt (story_prompt), one of 4 few-shot variants
// (200-character pieces of the held-out stories story_8 and story_9) and one of 12 user turns
// (pieces of genesis_1-3): 48 sessions. The store first takes the training dumps (so the namespace
// has a learned state, as a serving store would), then every session's context (all but its last
// >= 64 tokens, block aligned) as a fast RESIDUAL Put; each session's context is then read back
// reconstructed (BlockReader) and its last tokens scored by the model against the fp16 KV.
// "x smaller" = the sessions' fp16 bytes (each stored separately) / the bytes the store added.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/learned_data.h"
#include "client/worker/llama_model.h"
#include "trie/kv_store.h"
#include "trie/kv_store_testing.h"

namespace kvtrie {
namespace {

std::string ReadText(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Cuts `text` at a space near `at` (so no word is split).
std::string Piece(const std::string& text, size_t begin, size_t len) {
  size_t b = begin == 0 ? 0 : text.find(' ', begin);
  size_t e = text.find(' ', begin + len);
  if (b == std::string::npos) b = text.size();
  if (e == std::string::npos) e = text.size();
  return text.substr(b, e - b);
}

struct Session {
  std::vector<uint32_t> tokens;
  std::vector<float> surprisal;
  KvDump fp16;      // the whole session's KV (fp16)
  size_t context;   // stored tokens (block aligned)
  double baseline;  // bits of the scored tokens after the fp16 context
};

double Score(const worker::LlamaModel& model, const Session& s, const KvDump& prefix) {
  worker::Sequence seq(&model, s.tokens.size(), DType::kFp16);
  if (!seq.LoadPrefix(prefix).ok() || !seq.RecomputeLastLogits().ok()) std::exit(2);
  std::vector<uint32_t> rest(s.tokens.begin() + s.context, s.tokens.end());
  if (!seq.Extend(rest).ok()) std::exit(2);
  double bits = 0;
  for (size_t i = s.context; i < s.tokens.size(); ++i) bits += seq.surprisal_bits()[i];
  return bits;
}

bool PutDump(KvStore* store, const std::string& ns, const BlockGeometry& g, const KvDump& d,
             size_t tokens, double target) {
  const ModelInfo model{"stories260K", g};
  std::vector<uint32_t> ids(d.token_ids.begin(), d.token_ids.begin() + tokens);
  std::vector<float> s(d.surprisal_bits.begin(), d.surprisal_bits.begin() + tokens);
  EncodeOptions o;
  o.encoding = Encoding::kResidual;
  o.profile = Profile::kFast;
  o.target_rel_rms = target;
  auto session = store->BeginPut(ns, model, ids, s, o);
  if (!session.ok()) return false;
  std::vector<uint8_t> block(g.num_bytes());
  for (size_t b = 0; b < tokens / g.block_tokens; ++b) {
    GatherBlock(g, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
    if (!(*session)->AddLayers(b, 0, 0, block).ok()) return false;
  }
  absl::StatusOr<PutSummary> sum = (*session)->Finish();
  if (!sum.ok()) std::fprintf(stderr, "put: %s\n", sum.status().ToString().c_str());
  return sum.ok();
}

// The session's context coded in process (fast, against `state`), decoded: the codec alone.
KvDump CodedInProcess(const BlockGeometry& g, const Session& s, const PredictorState* state,
                      double target) {
  KvDump p = s.fp16;
  p.token_ids.resize(s.context);
  p.surprisal_bits.resize(s.context);
  p.k.assign(size_t(g.num_layers) * g.num_kv_heads * s.context * g.head_dim * 2, 0);
  p.v.assign(p.k.size(), 0);
  EncodeOptions o;
  o.encoding = Encoding::kResidual;
  o.profile = Profile::kFast;
  o.target_rel_rms = target;
  std::vector<uint8_t> block(g.num_bytes()), decoded(g.num_bytes());
  for (size_t b = 0; b < s.context / g.block_tokens; ++b) {
    GatherBlock(g, s.fp16.num_tokens(), s.fp16.k.data(), s.fp16.v.data(), b, absl::MakeSpan(block));
    Block blk;
    blk.tokens.assign(s.tokens.begin() + b * g.block_tokens,
                      s.tokens.begin() + (b + 1) * g.block_tokens);
    blk.first_position = b * g.block_tokens;
    blk.previous_token = b ? int32_t(s.tokens[b * g.block_tokens - 1]) : -1;
    const PredictionContext ctx = ContextOf(blk, state);
    auto e = EncodeBlock(g, block, o, ctx);
    if (!e.ok() || !DecodeBlock(e->bytes, absl::MakeSpan(decoded), ctx).ok()) std::exit(3);
    ScatterBlock(g, s.context, decoded, b, p.k.data(), p.v.data());
  }
  return p;
}

}  // namespace

int RunWorkload(const worker::LlamaModel& model, const BlockGeometry& g,
                const std::vector<Text>& train, const PredictorState* state,
                const std::string& texts_dir) {
  const std::string system = ReadText(texts_dir + "/story_prompt.txt");
  const std::string s8 = ReadText(texts_dir + "/story_8.txt");
  const std::string s9 = ReadText(texts_dir + "/story_9.txt");
  const std::string genesis = ReadText(texts_dir + "/genesis_1-3.txt");
  const std::vector<std::string> shots = {Piece(s8, 0, 200), Piece(s8, 400, 200), Piece(s9, 0, 200),
                                          Piece(s9, 400, 200)};
  std::vector<std::string> users;
  for (int j = 0; j < 12; ++j) users.push_back(Piece(genesis, 800 + j * 700, 240));
  std::vector<Session> sessions;
  for (const std::string& shot : shots) {
    for (const std::string& user : users) {
      Session s;
      s.tokens = model.tokenizer().Encode(system + "\n" + shot + "\n" + user, true, false);
      if (s.tokens.size() > 512) s.tokens.resize(512);
      worker::Sequence seq(&model, s.tokens.size(), DType::kFp16);
      if (!seq.Extend(s.tokens).ok()) return 1;
      s.surprisal = seq.surprisal_bits();
      s.fp16 = seq.ToKvDump(DType::kFp16);
      s.context = (s.tokens.size() - 64) / g.block_tokens * g.block_tokens;
      KvDump prefix = seq.ToKvDump(DType::kFp16, s.context);
      s.baseline = Score(model, s, prefix);
      sessions.push_back(std::move(s));
    }
  }
  // The blocks every session shares (the system prompt's): stored once, read by all.
  size_t sys = sessions[0].context;
  for (const Session& s : sessions) {
    size_t i = 0;
    while (i < sys && s.tokens[i] == sessions[0].tokens[i]) ++i;
    sys = i;
  }
  sys = sys / g.block_tokens * g.block_tokens;
  size_t tokens = 0, stored_tokens = 0;
  for (const Session& s : sessions) tokens += s.tokens.size(), stored_tokens += s.context;
  const double fp16_bytes = double(stored_tokens) * g.num_elements() / g.block_tokens * 2;
  std::printf(
      "## 5. Multi-session workload through the store (KvStore, RocksDB, learning on)\n\n"
      "%zu sessions (system prompt %zu chars + 1 of %zu few-shot variants + 1 of %zu user turns),"
      " %zu tokens; %zu stored (block aligned), the rest scored. fp16 separately: %.0f bytes. "
      "The store first took the %zu training dumps (learned state fitted from them); the state's "
      "bytes are shown, not counted in \"x smaller\". The blocks every session shares (the system "
      "prompt's) are stored once and read by all: one draw of their coding error, not 48.\n\n"
      "| target rel RMS | blocks stored / deduplicated / on the learned state | mean relK / relV "
      "| bytes the sessions added | x smaller than separate fp16 | with the "
      "state's bytes | ΔNLL %% | s.e. %% | ΔNLL %%, only the %zu shared tokens from the store "
      "| ΔNLL %%, codec alone |\n|---|---|---|---|---|---|---|---|---|---|\n",
      sessions.size(), system.size(), shots.size(), users.size(), tokens, stored_tokens, fp16_bytes,
      train.size(), sys);
  for (double target : {0.173, 0.3, 0.5}) {
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() / ("paper_workload_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    StoreOptions o;
    o.data_dir = dir.string();
    o.background = false;
    o.predictors.learn = true;
    double added = 0, with_state = 0, sum = 0, base = 0, in_process = 0, sys_only = 0;
    std::vector<double> per_session;
    uint64_t blocks = 0, on_learned = 0, dedup = 0;
    double rel_k = 0, rel_v = 0;
    {
      auto store = KvStore::Open(o);
      if (!store.ok()) return 1;
      for (const Text& t : train) {
        if (!PutDump(store->get(), "paper", g, t.dump, t.blocks.size() * g.block_tokens, target)) {
          return 1;
        }
      }
      KvStoreTestPeer::DrainLearning(store->get());
      const StoreStats st0 = (*store)->Stats("paper");
      const uint64_t before = st0.bytes_stored;
      for (const Session& s : sessions) {
        if (!PutDump(store->get(), "paper", g, s.fp16, s.context, target)) return 1;
      }
      const StoreStats st = (*store)->Stats("paper");
      added = double(st.bytes_stored - before);
      with_state = added + st.predictor_state_bytes;
      blocks = st.blocks_stored - st0.blocks_stored;
      on_learned = st.blocks_on_learned - st0.blocks_on_learned;
      rel_k = (st.sum_rel_rms_error_k - st0.sum_rel_rms_error_k) / blocks;
      rel_v = (st.sum_rel_rms_error_v - st0.sum_rel_rms_error_v) / blocks;
      dedup = st.blocks_deduplicated - st0.blocks_deduplicated;
      for (const Session& s : sessions) {
        auto reader = (*store)->NewReader("paper", "stories260K",
                                          absl::MakeConstSpan(s.tokens).subspan(0, s.context), 0,
                                          BlockReader::Mode::kReconstructed, nullptr);
        if (!reader.ok()) return 1;
        KvDump prefix = s.fp16;  // geometry and ids; its KV is overwritten by the store's
        prefix.token_ids.resize(s.context);
        prefix.surprisal_bits.resize(s.context);
        const size_t row = size_t(g.head_dim) * 2;
        prefix.k.assign(size_t(g.num_layers) * g.num_kv_heads * s.context * row, 0);
        prefix.v.assign(prefix.k.size(), 0);
        size_t got = 0;
        for (;;) {
          BlockReader::Block blk;
          bool end = false;
          if (!(*reader)->Next(&blk, &end).ok()) return 1;
          if (end) break;
          const auto* p = reinterpret_cast<const uint8_t*>(blk.bytes.data());
          ScatterBlock(g, s.context, absl::MakeConstSpan(p, blk.bytes.size()), blk.index,
                       prefix.k.data(), prefix.v.data());
          ++got;
        }
        if (got * g.block_tokens != s.context) {
          std::fprintf(stderr, "read back %zu blocks of %zu\n", got, s.context / g.block_tokens);
          return 1;
        }
        {
          KvDump mixed = prefix;
          const size_t row = size_t(g.head_dim) * 2;
          const size_t n = s.fp16.num_tokens();
          for (size_t lh = 0; lh < size_t(g.num_layers) * g.num_kv_heads; ++lh) {
            std::memcpy(mixed.k.data() + (lh * s.context + sys) * row,
                        s.fp16.k.data() + (lh * n + sys) * row, (s.context - sys) * row);
            std::memcpy(mixed.v.data() + (lh * s.context + sys) * row,
                        s.fp16.v.data() + (lh * n + sys) * row, (s.context - sys) * row);
          }
          sys_only += Score(model, s, mixed);
        }
        const double bits = Score(model, s, prefix);
        sum += bits;
        base += s.baseline;
        per_session.push_back(100 * (bits - s.baseline) / s.baseline);
        in_process += Score(model, s, CodedInProcess(g, s, state, target));
      }
    }
    std::filesystem::remove_all(dir);
    double mean = 0, var = 0;
    for (double v : per_session) mean += v / per_session.size();
    for (double v : per_session) var += (v - mean) * (v - mean) / (per_session.size() - 1);
    std::printf(
        "| %.3f | %lu / %lu / %lu | %.3f / %.3f | %.0f | %.1fx | %.1fx | %+.3f | %.3f | %+.3f | "
        "%+.3f |\n",
        target, static_cast<unsigned long>(blocks), static_cast<unsigned long>(dedup),
        static_cast<unsigned long>(on_learned), rel_k, rel_v, added, fp16_bytes / added,
        fp16_bytes / with_state, 100 * (sum - base) / base, std::sqrt(var / per_session.size()),
        100 * (sys_only - base) / base, 100 * (in_process - base) / base);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace kvtrie
