// codec/fuzz/predictor_state_fuzzer.cc
//
// libFuzzer target for PredictorState::Parse (codec/predictor_state.h). The input is a serialized
// state without its CRC-32C trailer (the fuzzer appends the right one, so the parser's own checks
// are what is exercised, not only the checksum). Whatever the bytes: DATA_LOSS or a state whose
// Serialize() gives back exactly the input, and whose predictions of a few tokens stay in bounds
// (ASan + UBSan); format 2's linear weights and KLT bases are used too. Seeds in
// codec/fuzz/predictor_state_corpus (linear_klt: format 2).
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "codec/crc32c.h"
#include "codec/predictor_state.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  const uint32_t crc = kvtrie::Crc32c(bytes);
  for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<char>((crc >> (8 * i)) & 0xff));
  auto state = kvtrie::PredictorState::Parse(bytes);
  if (!state.ok()) {
    if (!absl::IsDataLoss(state.status())) std::abort();
    return 0;
  }
  if ((*state)->Serialize() != bytes) std::abort();
  const kvtrie::BlockGeometry& g = (*state)->geometry();
  const size_t per_token = static_cast<size_t>(g.num_layers) * 2 * g.num_kv_heads * g.head_dim;
  if (per_token > (1u << 20)) return 0;  // a huge geometry: predicting it is only slow
  const std::vector<int32_t> tokens = {0, 2, 7, 511, 7};
  std::vector<float> out(per_token * tokens.size());
  (*state)->Predict(tokens, 12345, 2, out.data());
  (*state)->PredictTokenMean(tokens, 0, out.data());
  // Format 2: the linear weights and KLT bases (bounded and finite by Parse).
  const size_t plane = static_cast<size_t>(g.num_kv_heads) * tokens.size() * g.head_dim;
  std::vector<float> in(plane, 0.5f), pred(plane, 0.0f);
  for (size_t p = 0; p < 2 * static_cast<size_t>(g.num_layers); ++p) {
    if ((*state)->HasLinear(p)) {
      (*state)->PredictLinear(p, 77, tokens.size(), in.data(), p >= 2 ? in.data() : nullptr,
                              pred.data());
    }
    if (const float* u = (*state)->Klt(p); u != nullptr) {
      volatile float sink = u[static_cast<size_t>(g.num_kv_heads) * g.head_dim * g.head_dim - 1];
      (void)sink;
    }
  }
  return 0;
}
