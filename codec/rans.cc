#include "codec/rans.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtrie {
namespace {
constexpr uint32_t kRansLower = 1u << 23;
}  // namespace

AdaptiveModel::AdaptiveModel(double decay) {
  // The prior is a pure function of `decay`; a few recent ones are kept per thread (a block
  // builds dozens of models from the same handful of decays).
  struct Prior {
    double decay = -1;
    uint16_t cdf[kSymbols + 1];
  };
  thread_local Prior cache[4];
  thread_local int next = 0;
  for (const Prior& p : cache) {
    if (p.decay == decay) {
      std::memcpy(cdf_, p.cdf, sizeof(cdf_));
      return;
    }
  }
  // Each symbol gets 1 plus its share of the rest, the remainder going to symbol 0.
  double weights[kSymbols], sum = 0;
  for (int s = 0; s < kSymbols; ++s) sum += weights[s] = std::pow(decay, s);
  const uint32_t spare = kTotal - kSymbols;
  uint32_t freqs[kSymbols], used = 0;
  for (int s = 0; s < kSymbols; ++s) {
    freqs[s] = 1 + static_cast<uint32_t>(spare * weights[s] / sum);
    used += freqs[s];
  }
  freqs[0] += kTotal - used;
  cdf_[0] = 0;
  for (int s = 0; s < kSymbols; ++s) cdf_[s + 1] = static_cast<uint16_t>(cdf_[s] + freqs[s]);
  // cdf_[kSymbols] == kTotal == 32768 fits in uint16_t.
  Prior& slot = cache[next];
  next = (next + 1) % 4;
  slot.decay = decay;
  std::memcpy(slot.cdf, cdf_, sizeof(cdf_));
}

double AdaptiveModel::CostBits(int s) const {
  return kScaleBits - std::log2(static_cast<double>(freq(s)));
}

void RansEncoder::Finish(std::string* out) {
  // Renormalization bytes are produced last-to-first: write them backwards from the end of a
  // buffer sized for the worst case (a symbol emits at most 3 bytes), then append in order.
  std::vector<uint8_t> buf(3 * ops_.size() + 8);
  uint8_t* const end = buf.data() + buf.size();
  uint8_t* p = end;
  uint32_t x = kRansLower;
  for (size_t i = ops_.size(); i-- > 0;) {
    const Op& op = ops_[i];
    const uint32_t freq = op.freq, start = op.start, bits = op.scale_bits;
    const uint32_t x_max = ((kRansLower >> bits) << 8) * freq;
    while (x >= x_max) {
      *--p = static_cast<uint8_t>(x & 0xff);
      x >>= 8;
    }
    if (freq == 1) {  // raw bits (PutBits) or a frequency-1 symbol: no division
      x = (x << bits) | start;
    } else {
      const uint32_t q = x / freq;
      x = (q << bits) + (x - q * freq) + start;
    }
  }
  char state[4];
  for (int i = 0; i < 4; ++i) state[i] = static_cast<char>((x >> (8 * i)) & 0xff);
  out->append(state, 4);
  out->append(reinterpret_cast<const char*>(p), static_cast<size_t>(end - p));
  ops_.clear();
}

RansDecoder::RansDecoder(absl::string_view in) : in_(in) {
  if (in_.size() < 4) {
    overrun_ = true;
    state_ = kRansLower;
    pos_ = in_.size();
    return;
  }
  for (int i = 0; i < 4; ++i)
    state_ |= static_cast<uint32_t>(static_cast<uint8_t>(in_[i])) << (8 * i);
  pos_ = 4;
  Renormalize();
}

absl::Status RansDecoder::Finish() const {
  if (overrun_) return absl::DataLossError("rANS stream: read past the end");
  if (pos_ != in_.size()) {
    return absl::DataLossError(
        absl::StrCat("rANS stream: ", in_.size() - pos_, " bytes left after the last symbol"));
  }
  if (state_ != kRansLower) return absl::DataLossError("rANS stream: bad final state");
  return absl::OkStatus();
}

}  // namespace kvtrie
