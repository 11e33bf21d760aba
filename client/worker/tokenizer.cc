#include "client/worker/tokenizer.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace kvtrie::worker {

absl::StatusOr<Tokenizer> Tokenizer::FromGguf(const GgufFile& gguf) {
  absl::StatusOr<std::vector<std::string>> tokens = gguf.GetStringArray("tokenizer.ggml.tokens");
  if (!tokens.ok()) return tokens.status();
  absl::StatusOr<std::vector<float>> scores = gguf.GetFloatArray("tokenizer.ggml.scores");
  if (!scores.ok()) return scores.status();
  if (tokens->size() != scores->size()) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.scores: ", scores->size(),
                                                   " scores for ", tokens->size(), " tokens"));
  }
  if (tokens->size() < 259) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.tokens: ", tokens->size(),
                                                   " tokens; byte fallback needs at least 259"));
  }
  absl::StatusOr<uint64_t> bos = gguf.GetUint("tokenizer.ggml.bos_token_id");
  absl::StatusOr<uint64_t> eos = gguf.GetUint("tokenizer.ggml.eos_token_id");
  for (std::string& p : *tokens) p = absl::StrReplaceAll(p, {{"\xE2\x96\x81", " "}});
  return Tokenizer(std::move(*tokens), std::move(*scores), bos.ok() ? *bos : 1,
                   eos.ok() ? *eos : 2);
}

Tokenizer::Tokenizer(std::vector<std::string> pieces, std::vector<float> scores, uint32_t bos_id,
                     uint32_t eos_id)
    : pieces_(std::move(pieces)), scores_(std::move(scores)), bos_id_(bos_id), eos_id_(eos_id) {
  for (uint32_t id = 0; id < pieces_.size(); ++id) index_.emplace(pieces_[id], id);
}

int Tokenizer::Lookup(absl::string_view piece) const {
  auto it = index_.find(std::string(piece));
  return it == index_.end() ? -1 : static_cast<int>(it->second);
}

std::vector<uint32_t> Tokenizer::Encode(absl::string_view text, bool bos, bool eos) const {
  std::vector<uint32_t> tokens;
  tokens.reserve(text.size() + 3);
  if (bos) tokens.push_back(bos_id_);
  // llama2.c: add_dummy_prefix is true by default.
  if (!text.empty()) {
    int dummy = Lookup(" ");
    if (dummy >= 0) tokens.push_back(static_cast<uint32_t>(dummy));
  }
  // One token per UTF-8 code point (at most 4 bytes), byte fallback when not in the vocabulary.
  std::string buf;
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if ((c & 0xC0) != 0x80) buf.clear();
    buf.push_back(static_cast<char>(c));
    if (i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80 &&
        buf.size() < 4) {
      continue;
    }
    int id = Lookup(buf);
    if (id >= 0) {
      tokens.push_back(static_cast<uint32_t>(id));
    } else {
      for (unsigned char b : buf) tokens.push_back(static_cast<uint32_t>(b) + 3);
    }
    buf.clear();
  }
  // Merge the best-scoring adjacent pair until none merges.
  std::string merged;
  while (true) {
    float best_score = -1e10f;
    int best_id = -1;
    size_t best_idx = 0;
    for (size_t i = 0; i + 1 < tokens.size(); ++i) {
      merged.assign(pieces_[tokens[i]]);
      merged.append(pieces_[tokens[i + 1]]);
      int id = Lookup(merged);
      if (id >= 0 && scores_[id] > best_score) {
        best_score = scores_[id];
        best_id = id;
        best_idx = i;
      }
    }
    if (best_id < 0) break;
    tokens[best_idx] = static_cast<uint32_t>(best_id);
    tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(best_idx) + 1);
  }
  if (eos) tokens.push_back(eos_id_);
  return tokens;
}

std::string Tokenizer::Decode(uint32_t prev_token, uint32_t token) const {
  if (token >= pieces_.size()) return "";
  absl::string_view piece = pieces_[token];
  if (prev_token == bos_id_ && !piece.empty() && piece[0] == ' ') piece.remove_prefix(1);
  unsigned int byte = 0;
  char close = 0;
  if (piece.size() == 6 &&
      std::sscanf(std::string(piece).c_str(), "<0x%02X%c", &byte, &close) == 2 && close == '>') {
    return std::string(1, static_cast<char>(byte));
  }
  return std::string(piece);
}

std::string Tokenizer::DecodeAll(const std::vector<uint32_t>& tokens) const {
  std::string out;
  uint32_t prev = bos_id_;
  for (uint32_t t : tokens) {
    if (t != bos_id_) out += Decode(prev, t);
    prev = t;
  }
  return out;
}

}  // namespace kvtrie::worker
