// tests/insertion_dumps.h
//
// Real KV caches of a text and of the same text with tokens inserted before a repeated part
// (issue 20, "any offset"), made by running the reference worker's model (stories260K,
// client/worker) on real text from tests/data/texts — what tests/data/neardup was made from, at
// insertion lengths the committed dumps do not have. The base is KJV Genesis 1-3 cut to 512 tokens
// (the tokens of tests/data/genesis_1-3); the variant inserts `n` tokens of a later passage of the
// same file (Genesis 3:14 on, past the base's 3000 characters) before the base's token kInsertAt,
// then continues with the base's tokens, cut to 512: the base's tokens from kInsertAt on sit n
// positions later. KV is fp16 (K after RoPE), surprisal from the same run. A few ms of CPU per
// dump. For tests and benches only.
#ifndef KVTRIE_TESTS_INSERTION_DUMPS_H_
#define KVTRIE_TESTS_INSERTION_DUMPS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/worker/llama_model.h"
#include "client/worker/worker_ops.h"
#include "codec/kv_dump.h"

namespace kvtrie::testing_insertion {

inline constexpr size_t kTokens = 512;
inline constexpr size_t kInsertAt = 100;    // in block 6 (block_tokens 16), after 4 of its tokens
inline constexpr size_t kBaseChars = 3000;  // as tests/data/genesis_1-3
// Where the inserted passage starts in the text file.
inline constexpr char kInsertedFrom[] = "And the LORD God said unto the serpent";

inline absl::StatusOr<std::string> GenesisText() {
  return worker::ReadTextFile(std::string(KVTRIE_TESTDATA_DIR) + "/texts/genesis_1-3.txt");
}

// The base: the model run on Genesis 1-3's first 3000 characters, 512 tokens.
inline absl::StatusOr<KvDump> BaseDump(const worker::LlamaModel& model) {
  absl::StatusOr<std::string> text = GenesisText();
  if (!text.ok()) return text.status();
  return worker::DumpText(model, *text, kTokens, kBaseChars);
}

// The base's tokens with `n` tokens of the later passage inserted before token kInsertAt.
// Errors: NOT_FOUND for a missing text; OUT_OF_RANGE when the passage is shorter than n tokens.
inline absl::StatusOr<KvDump> InsertionDump(const worker::LlamaModel& model, size_t n) {
  absl::StatusOr<std::string> text = GenesisText();
  if (!text.ok()) return text.status();
  const size_t from = text->find(kInsertedFrom);
  if (from == std::string::npos) return absl::NotFoundError("inserted passage not in the text");
  const worker::Tokenizer& tok = model.tokenizer();
  std::vector<uint32_t> base = tok.Encode(worker::FirstCodePoints(*text, kBaseChars), true, false);
  const std::vector<uint32_t> passage = tok.Encode(text->substr(from, 2000), false, false);
  if (passage.size() < n + 1 || base.size() < kTokens) {
    return absl::OutOfRangeError("text too short for the insertion");
  }
  std::vector<uint32_t> tokens(base.begin(), base.begin() + kInsertAt);
  // passage[0] is the dummy-prefix space: the clause starts at passage[1].
  tokens.insert(tokens.end(), passage.begin() + 1, passage.begin() + 1 + n);
  tokens.insert(tokens.end(), base.begin() + kInsertAt, base.end());
  tokens.resize(kTokens);
  worker::Sequence seq(&model,
                       kTokens);  // as DumpText: the base and the variant share their prefix KV
  if (absl::Status s = seq.Extend(tokens); !s.ok()) return s;
  return seq.ToKvDump(DType::kFp16);
}

}  // namespace kvtrie::testing_insertion

#endif  // KVTRIE_TESTS_INSERTION_DUMPS_H_
