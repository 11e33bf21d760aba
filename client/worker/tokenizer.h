// client/worker/tokenizer.h
//
// SentencePiece-style BPE with byte fallback, exactly as llama2.c's `encode()`/`decode()`
// (Karpathy, llama2.c run.c), on a vocabulary read from GGUF metadata
// `tokenizer.ggml.tokens` / `tokenizer.ggml.scores` (SentencePiece's U+2581 "▁" is read as a
// space, as llama2.c's tokenizer.bin stores it).
//
// Encode(text): [BOS] + (if text is non-empty) the dummy-prefix token " " + one token per UTF-8
// code point looked up in the vocabulary (a code point not in the vocabulary becomes its bytes as
// byte tokens, id = byte + 3) + repeated merges of the adjacent pair whose concatenation is in the
// vocabulary with the highest score (the first such pair on ties) + [EOS].
// Thread-safe: a Tokenizer is immutable after construction.
#ifndef KVTRIE_CLIENT_WORKER_TOKENIZER_H_
#define KVTRIE_CLIENT_WORKER_TOKENIZER_H_

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/worker/gguf.h"

namespace kvtrie::worker {

class Tokenizer {
 public:
  // Reads tokens and scores (and bos/eos ids, default 1/2) from a GGUF file. Errors: NOT_FOUND /
  // INVALID_ARGUMENT from the metadata; INVALID_ARGUMENT if tokens and scores differ in length or
  // the vocabulary has fewer than 259 entries (ids 3..258 must be the byte tokens).
  static absl::StatusOr<Tokenizer> FromGguf(const GgufFile& gguf);
  Tokenizer(std::vector<std::string> pieces, std::vector<float> scores, uint32_t bos_id,
            uint32_t eos_id);

  std::vector<uint32_t> Encode(absl::string_view text, bool bos, bool eos) const;
  // The text of `token` following `prev_token`: a leading space is dropped after BOS, byte
  // tokens "<0xXX>" become that byte.
  std::string Decode(uint32_t prev_token, uint32_t token) const;
  // Decode of a whole sequence (the first token's predecessor is taken to be BOS).
  std::string DecodeAll(const std::vector<uint32_t>& tokens) const;

  size_t vocab_size() const { return pieces_.size(); }
  uint32_t bos_id() const { return bos_id_; }
  uint32_t eos_id() const { return eos_id_; }
  const std::string& piece(uint32_t id) const { return pieces_[id]; }

 private:
  int Lookup(absl::string_view piece) const;  // -1 if absent

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, uint32_t> index_;  // piece -> lowest id
  uint32_t bos_id_ = 1;
  uint32_t eos_id_ = 2;
};

}  // namespace kvtrie::worker

#endif  // KVTRIE_CLIENT_WORKER_TOKENIZER_H_
