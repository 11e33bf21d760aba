// client/worker/cached_inference.h
//
// The reference worker using kvtrie as an inference worker would (issue 6): `run` (reuse a
// cached prefix, compute only the rest, store the new blocks, generate) and `eval` (NLL of a
// continuation from the model's own KV vs from context KV after a round trip through kvtrie).
//
// The worker's KV cache holds fp16 (RunOptions::kv_dtype): each token's K/V are rounded to fp16
// when computed, as an fp16 inference engine would, so a lossless round trip through kvtrie
// reproduces the computation bit for bit and RunWithCache equals RunWithoutCache exactly.
//
// Cost accounting: a prefix taken from kvtrie is not recomputed, but the logits after its last
// token are not in the cache, so scoring the first new token (or generating right after a fully
// cached prompt) takes one logits-only pass over that token: counted in logits_only_passes, not
// in computed_tokens. The surprisal of tokens in blocks the worker did not compute is unknown to
// it and is sent as 0 (those blocks are already stored; the server keeps what it has).
#ifndef KVTRIE_CLIENT_WORKER_CACHED_INFERENCE_H_
#define KVTRIE_CLIENT_WORKER_CACHED_INFERENCE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/client.h"
#include "client/sharded_client.h"
#include "client/worker/llama_model.h"

namespace kvtrie::worker {

struct RunOptions {
  size_t steps = 64;              // tokens to generate after the prompt
  DType kv_dtype = DType::kFp16;  // the worker's KV cache precision (and the stored dtype)
  PutOptions put;                 // encoding, block_tokens (first_block is set by RunWithCache)
};

struct RunResult {
  std::vector<uint32_t> prompt_tokens;  // BOS + Encode(prompt)
  size_t reused_tokens = 0;             // prompt tokens whose KV came from kvtrie
  size_t computed_tokens = 0;           // prompt tokens run through the model
  size_t logits_only_passes = 0;        // see the header comment
  size_t stored_blocks = 0;             // new blocks Put (0 if nothing new)
  size_t deduplicated_blocks = 0;
  std::vector<uint32_t> generated;           // greedy continuation
  std::vector<float> prompt_surprisal_bits;  // NaN for reused tokens (except BOS = 0)
  std::string text;                          // decoded prompt + continuation
};

// Lookup, Get the stored prefix, compute the remaining prompt tokens, Put the new full blocks
// (PutOptions.first_block = blocks already stored), then generate greedily.
// Errors: from the client (UNAVAILABLE, INVALID_ARGUMENT, ...) and the model; INTERNAL if Get
// returns KV for tokens that are not a prefix of the prompt.
absl::StatusOr<RunResult> RunWithCache(const LlamaModel& model, Client& client,
                                       absl::string_view prompt, const RunOptions& options);
// The same over N shards (kvtrie-worker --shards / --shards_dns): every call goes to the
// prompt's owner shard; a lost owner is a miss (Lookup 0: everything is computed; Put skipped,
// stored_blocks 0), never an error.
absl::StatusOr<RunResult> RunWithCache(const LlamaModel& model, ShardedClient& client,
                                       absl::string_view prompt, const RunOptions& options);

// The same computation without kvtrie (reused_tokens = 0, nothing stored).
absl::StatusOr<RunResult> RunWithoutCache(const LlamaModel& model, absl::string_view prompt,
                                          const RunOptions& options);

// One codec setting of `eval`.
struct EvalSetting {
  std::string name;  // e.g. "lossless", "residual@0.02"
  v1::Encoding encoding = v1::ENCODING_LOSSLESS;
  double target_rel_rms = 0;
  uint32_t bits = 0;
  bool encode_on_client = true;   // PutOptions::encode_on_client (kvtrie-worker --encode_on_client)
  bool learned_lossless = false;  // PutOptions::learned_lossless (--learned_lossless)
};

// Parses "NAME[@REL_RMS][/BITS]" with NAME one of raw, lossless, residual, int8, kivi2,
// turboquant, e.g. "residual@0.05", "turboquant/3". Errors: INVALID_ARGUMENT naming the setting.
absl::StatusOr<EvalSetting> ParseEvalSetting(absl::string_view text);

// A window: tokens[0, context) are the context (stored in kvtrie), tokens[context, end) the
// continuation whose NLL is measured. REQUIRES: 0 < context < tokens.size(), context a multiple
// of block_tokens (only full blocks are stored).
struct EvalWindow {
  std::vector<uint32_t> tokens;
  size_t context = 0;
};

struct EvalRow {
  std::string setting;
  size_t windows = 0;
  size_t continuation_tokens = 0;
  double bits_per_component = 16;       // stored bits per K/V element (fp16 = 16)
  double ratio_vs_fp16 = 1;             // fp16 bytes / stored bytes
  double rel_rms_k = 0, rel_rms_v = 0;  // mean achieved relative RMS error over stored blocks
  double nll_bits = 0;           // mean surprisal per continuation token, from the round trip
  double baseline_nll_bits = 0;  // the same from the model's own KV
  double delta_nll_pct = 0;      // 100 * (nll - baseline) / baseline, pooled over windows
  std::vector<double> window_delta_pct;  // per window, for the spread
  std::vector<double> window_nll_sum;    // per window: summed surprisal of the continuation
  std::vector<double> window_baseline_sum;
};

// For each setting: Puts each window's context KV (fp16, computed once) into namespace
// `ns_prefix` + setting name on client_options.target, Gets it back reconstructed, and scores
// the continuation from it. Namespaces isolate settings, so no setting deduplicates against
// another's blocks (use a fresh ns_prefix per run for the same reason).
absl::StatusOr<std::vector<EvalRow>> EvalRoundTrip(const LlamaModel& model,
                                                   const ClientOptions& client_options,
                                                   const std::string& ns_prefix,
                                                   const std::vector<EvalWindow>& windows,
                                                   const std::vector<EvalSetting>& settings,
                                                   uint32_t block_tokens = 16);

// Cuts `tokens` (BOS first) into windows: each is BOS + `context - 1` text tokens +
// `continuation` tokens, consecutive and non-overlapping in the text, at most `max_windows`.
std::vector<EvalWindow> MakeWindows(const std::vector<uint32_t>& tokens, size_t context,
                                    size_t continuation, size_t max_windows);

}  // namespace kvtrie::worker

#endif  // KVTRIE_CLIENT_WORKER_CACHED_INFERENCE_H_
