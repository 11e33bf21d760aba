#include "client/worker/worker_ops.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace kvtrie::worker {

std::string DefaultModelPath(const std::string& repo_root) {
  const char* env = std::getenv("KVTRIE_MODEL");
  if (env != nullptr && env[0] != '\0') return env;
  return (std::filesystem::path(repo_root) / ".." / "shared" / "data" / "stories260K" /
          "stories260K.gguf")
      .lexically_normal()
      .string();
}

std::string FirstCodePoints(absl::string_view text, size_t max_chars) {
  if (max_chars == 0) return std::string(text);
  size_t count = 0, i = 0;
  for (; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) {
      if (count == max_chars) break;
      ++count;
    }
  }
  return std::string(text.substr(0, i));
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return std::move(ss).str();
}

absl::StatusOr<KvDump> DumpText(const LlamaModel& model, absl::string_view text, size_t max_tokens,
                                size_t max_chars) {
  const std::string cut = FirstCodePoints(text, max_chars);
  std::vector<uint32_t> tokens = model.tokenizer().Encode(cut, /*bos=*/true, /*eos=*/false);
  size_t n = std::min<size_t>(tokens.size(), model.config().context_length);
  if (max_tokens > 0) n = std::min(n, max_tokens);
  tokens.resize(n);
  Sequence seq(&model, n);
  if (absl::Status s = seq.Extend(tokens); !s.ok()) return s;
  return seq.ToKvDump(DType::kFp16);
}

absl::StatusOr<std::vector<uint32_t>> ContinueGreedy(const LlamaModel& model, Sequence& seq,
                                                     size_t steps) {
  if (seq.logits().empty()) {
    return absl::FailedPreconditionError("ContinueGreedy: the sequence has no logits");
  }
  std::vector<uint32_t> out;
  const Tokenizer& tok = model.tokenizer();
  for (size_t i = 0; i < steps && seq.num_tokens() < seq.capacity(); ++i) {
    const uint32_t next = seq.Greedy();
    if (next == tok.bos_id() || next == tok.eos_id()) break;
    out.push_back(next);
    if (absl::Status s = seq.Extend({next}); !s.ok()) return s;
  }
  return out;
}

absl::StatusOr<Generation> GenerateGreedy(const LlamaModel& model, absl::string_view prompt,
                                          size_t steps) {
  Generation g;
  g.tokens = model.tokenizer().Encode(prompt, /*bos=*/true, /*eos=*/false);
  g.prompt_tokens = g.tokens.size();
  Sequence seq(&model);
  if (absl::Status s = seq.Extend(g.tokens); !s.ok()) return s;
  absl::StatusOr<std::vector<uint32_t>> more = ContinueGreedy(model, seq, steps);
  if (!more.ok()) return more.status();
  g.tokens.insert(g.tokens.end(), more->begin(), more->end());
  g.text = model.tokenizer().DecodeAll(g.tokens);
  return g;
}

}  // namespace kvtrie::worker
