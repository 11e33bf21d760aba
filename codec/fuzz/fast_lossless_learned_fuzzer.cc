// codec/fuzz/fast_lossless_learned_fuzzer.cc
//
// libFuzzer target for the fast LOSSLESS mode against a learned state
// (codec/fast_lossless_learned.h). A small state per dtype is learned once from deterministic
// synthetic blocks (2 layers, 2 KV heads, 4 tokens, head_dim 8). Input byte 0 picks:
//   bit 0: the dtype (fp16 / bf16);
//   bit 1: 0 = the rest is a payload: the layout check and the decoder return a status, never a
//          crash or an out-of-bounds read (ASan + UBSan), and a payload the decoder accepts
//          re-encodes to a block that decodes to the same bytes;
//          1 = the rest (repeated) is a block's bit patterns: encoded, checked and decoded, it
//          must come back bit for bit (any pattern: NaN payloads, infinities, -0, subnormals).
// Bytes 1-4 are the block's token ids (mod 64), so predictions vary. Seeds in
// codec/fuzz/fast_lossless_learned_corpus.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "codec/fast_lossless_learned.h"
#include "codec/predictor_state.h"

namespace {

constexpr uint32_t kT = 4;

kvtrie::BlockGeometry Geometry(bool bf16) {
  return {.num_layers = 2,
          .num_kv_heads = 2,
          .block_tokens = kT,
          .head_dim = 8,
          .dtype = bf16 ? kvtrie::DType::kBf16 : kvtrie::DType::kFp16};
}

std::shared_ptr<const kvtrie::PredictorState> MakeState(bool bf16) {
  const kvtrie::BlockGeometry g = Geometry(bf16);
  auto learner = kvtrie::PredictorLearner::Create(g, {});
  if (!learner.ok()) std::abort();
  std::vector<float> f(g.num_elements());
  std::vector<uint8_t> kv(g.num_bytes());
  for (uint32_t b = 0; b < 160; ++b) {  // 640 tokens: past the RoPE detection
    std::vector<int32_t> tokens(kT);
    for (uint32_t t = 0; t < kT; ++t) tokens[t] = static_cast<int32_t>((b * 7 + t * 3) % 64);
    for (size_t i = 0; i < f.size(); ++i) {
      const int32_t tok = tokens[(i / g.head_dim) % kT];
      f[i] = static_cast<float>(static_cast<int>((tok * 37 + i * 11) % 101) - 50) / 25.0f;
    }
    kvtrie::FromFloat(g.dtype, f.data(), f.size(), kv.data());
    if (!(*learner)->Observe(kv, tokens, b * kT, b ? 5 : -1).ok()) std::abort();
  }
  auto state = (*learner)->Fit(1);
  if (!state.ok()) {
    std::fprintf(stderr, "%s (observed %llu)\n", state.status().ToString().c_str(),
                 static_cast<unsigned long long>((*learner)->tokens_observed()));
    std::abort();
  }
  return *state;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::shared_ptr<const kvtrie::PredictorState> states[2] = {MakeState(false),
                                                                          MakeState(true)};
  if (size < 5) return 0;
  const bool bf16 = data[0] & 1;
  const kvtrie::BlockGeometry g = Geometry(bf16);
  const kvtrie::PredictorState& state = *states[bf16];
  std::vector<int32_t> tokens(kT);
  for (uint32_t t = 0; t < kT; ++t) tokens[t] = data[1 + t] % 64;
  const uint32_t position = data[1] * 4u;
  const int32_t previous = data[2] % 2 ? -1 : data[3] % 64;
  const absl::string_view rest(reinterpret_cast<const char*>(data) + 5, size - 5);
  std::vector<uint8_t> out(g.num_bytes());
  if ((data[0] & 2) == 0) {
    (void)kvtrie::CheckFastLosslessLearnedLayout(g, rest);
    const absl::Status s = kvtrie::DecompressFastLosslessLearned(g, rest, state, tokens, position,
                                                                 previous, absl::MakeSpan(out));
    if (s.ok()) {
      std::string again;
      kvtrie::CompressFastLosslessLearned(g, out, state, tokens, position, previous, &again);
      std::vector<uint8_t> back(g.num_bytes());
      if (!kvtrie::DecompressFastLosslessLearned(g, again, state, tokens, position, previous,
                                                 absl::MakeSpan(back))
               .ok() ||
          back != out) {
        std::abort();
      }
    } else if (!absl::IsDataLoss(s)) {
      std::abort();
    }
    return 0;
  }
  if (rest.empty()) return 0;
  std::vector<uint8_t> kv(g.num_bytes());
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<uint8_t>(rest[i % rest.size()]);
  std::string payload;
  kvtrie::CompressFastLosslessLearned(g, kv, state, tokens, position, previous, &payload);
  if (!kvtrie::CheckFastLosslessLearnedLayout(g, payload).ok()) std::abort();
  if (!kvtrie::DecompressFastLosslessLearned(g, payload, state, tokens, position, previous,
                                             absl::MakeSpan(out))
           .ok() ||
      out != kv) {
    std::abort();
  }
  return 0;
}
