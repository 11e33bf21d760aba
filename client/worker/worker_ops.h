// client/worker/worker_ops.h
//
// What `kvtrie-worker dump` and `generate` do, as library calls (the CLI and the tests share
// them). A dump is the exchange format of shared/data/README.md / codec/kv_dump.h: K (after
// RoPE) and V [layers][kv_heads][tokens][head_dim] in fp16, token ids, per-token surprisal in
// bits (BOS: 0, written as null).
#ifndef KVTRIE_CLIENT_WORKER_WORKER_OPS_H_
#define KVTRIE_CLIENT_WORKER_WORKER_OPS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/worker/llama_model.h"
#include "codec/kv_dump.h"

namespace kvtrie::worker {

// The default model path: $KVTRIE_MODEL if set and non-empty, else
// `<repo>/../shared/data/stories260K/stories260K.gguf` with <repo> = `repo_root`.
std::string DefaultModelPath(const std::string& repo_root);

// The first `max_chars` UTF-8 code points of `text` (all of it if max_chars == 0).
std::string FirstCodePoints(absl::string_view text, size_t max_chars);

// Reads a whole file. Errors: NOT_FOUND naming the path.
absl::StatusOr<std::string> ReadTextFile(const std::string& path);

// BOS + Encode(first max_chars code points of text), cut to max_tokens (0 = no cut) and to the
// model's context length, run through the model. The result's KV is in fp16.
absl::StatusOr<KvDump> DumpText(const LlamaModel& model, absl::string_view text, size_t max_tokens,
                                size_t max_chars);

struct Generation {
  std::vector<uint32_t> tokens;  // prompt tokens (BOS first) then generated ones
  size_t prompt_tokens = 0;
  std::string text;  // decoded prompt + generation (no BOS)
};

// Greedy decoding: BOS + Encode(prompt) (just BOS for an empty prompt), then `steps` argmax
// tokens, stopping early at BOS or EOS (not included) or the context length.
absl::StatusOr<Generation> GenerateGreedy(const LlamaModel& model, absl::string_view prompt,
                                          size_t steps);

// Continues greedy decoding from `seq` (whose logits() must be set) for `steps` tokens, stopping at
// BOS/EOS or capacity. Returns the generated token ids.
absl::StatusOr<std::vector<uint32_t>> ContinueGreedy(const LlamaModel& model, Sequence& seq,
                                                     size_t steps);

}  // namespace kvtrie::worker

#endif  // KVTRIE_CLIENT_WORKER_WORKER_OPS_H_
