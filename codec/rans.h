// codec/rans.h
//
// A small range asymmetric numeral system (rANS) entropy coder with adaptive multi-symbol models,
// the entropy-coding stage of the residual and lossless encodings.
//
// Coder: 32-bit state, byte-wise renormalization, state interval [2^23, 2^31). A symbol with
// cumulative start `start` and frequency `freq` out of 2^scale_bits (scale_bits <= 16) costs
// log2(2^scale_bits / freq) bits. rANS is last-in first-out, so RansEncoder records the symbols
// in the order the decoder will read them (forward) and codes them backwards in Finish().
// Stream: 4 bytes of final state (little-endian), then the renormalization bytes.
// Integrity: after the last symbol a decoder must be back in the encoder's initial state with
// every byte consumed; RansDecoder::Finish() checks both, so most corruptions are detected even
// without the envelope's CRC.
//
// Model: AdaptiveModel is a 16-symbol cumulative distribution over 2^15, adapted after each
// symbol by moving the CDF a fraction 2^-rate toward the symbol (rate 4 for the first 16 symbols,
// then 5, 6 after 48, 7 after 128), with every frequency kept >= 1. Encoder and decoder apply the
// same update, so they stay in sync without transmitting any table. Sources: J. Duda, "Asymmetric
// numeral systems" (2013), arXiv:1311.2540; F. Giesen's rans_byte.h (public domain) for the
// byte-wise renormalization; the CDF adaptation is the one of AV1 / Daala (J.-M. Valin et al.,
// "Daala: building a next-generation video codec", §entropy coding).
#ifndef KVTRIE_CODEC_RANS_H_
#define KVTRIE_CODEC_RANS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvtrie {

// An adaptive distribution over the symbols 0..15.
class AdaptiveModel {
 public:
  static constexpr int kSymbols = 16;
  static constexpr int kScaleBits = 15;
  static constexpr uint32_t kTotal = 1u << kScaleBits;

  // Starts from a geometric prior p(s) ~ decay^s (decay in (0, 1]; 1 = uniform), which suits the
  // zig-zag mapped residuals this is used for.
  explicit AdaptiveModel(double decay = 0.55);

  uint32_t start(int s) const { return cdf_[s]; }
  uint32_t freq(int s) const { return cdf_[s + 1] - cdf_[s]; }
  // The symbol whose interval holds `slot` (in [0, kTotal)).
  int Find(uint32_t slot) const {
#if defined(__SSE2__)
    // cdf_[1..15] < 2^15, so signed 16-bit compares are exact; the lanes above `slot` are a
    // suffix (the CDF increases), so the symbol is the lane before the first of them.
    const __m128i v = _mm_set1_epi16(static_cast<int16_t>(slot));
    const __m128i gt0 = _mm_cmpgt_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(cdf_)), v);
    const __m128i gt1 =
        _mm_cmpgt_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(cdf_ + 8)), v);
    const uint32_t m = static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(gt0, gt1)));
    return m ? __builtin_ctz(m) - 1 : kSymbols - 1;
#else
    int s = 0;
    while (cdf_[s + 1] <= slot) ++s;
    return s;
#endif
  }
  // Cost of `s` in bits under the current distribution (for estimates; not used by the coder).
  double CostBits(int s) const;
  // Adapts toward `s`: interior boundaries i <= s move toward i (their floor), those above s
  // toward kTotal - (16 - i) (their ceiling), by (distance >> rate). x - (x >> rate) is monotone,
  // so every frequency stays >= 1.
  void Update(int s) {
    const int rate = Tables().rate[count_];  // 4 + (count_ >= 16) + (count_ >= 48) + (... 128)
    count_ = Tables().next_count[count_];    // min(count_ + 1, 128)
#if defined(__SSE2__)
    // The same arithmetic on all 16 lanes at once, as c + ((target - c + bias) >> rate) with an
    // arithmetic shift: target = i (bias 2^rate - 1, so the shift rounds the negative distance
    // toward zero, as the scalar form does) for lanes i <= s, else the ceiling (bias 0).
    const __m128i sh = _mm_cvtsi32_si128(rate);
    const __m128i bias = _mm_set1_epi16(static_cast<int16_t>((1 << rate) - 1));
    const UpdateTables& tab = Tables();
    for (int half = 0; half < 2; ++half) {
      auto* p = reinterpret_cast<__m128i*>(cdf_ + 8 * half);
      const __m128i c = _mm_load_si128(p);
      const __m128i target =
          _mm_load_si128(reinterpret_cast<const __m128i*>(tab.target[s] + 8 * half));
      const __m128i le = _mm_load_si128(reinterpret_cast<const __m128i*>(tab.le[s] + 8 * half));
      const __m128i diff = _mm_add_epi16(_mm_sub_epi16(target, c), _mm_and_si128(le, bias));
      _mm_store_si128(p, _mm_add_epi16(c, _mm_sra_epi16(diff, sh)));
    }
#else
    for (int i = 1; i <= s; ++i) cdf_[i] -= (cdf_[i] - i) >> rate;
    for (int i = s + 1; i < kSymbols; ++i) cdf_[i] += ((kTotal - kSymbols + i) - cdf_[i]) >> rate;
#endif
  }

 private:
  // Per symbol s: the lanes' targets (i for i <= s, kTotal - kSymbols + i above) and a mask of
  // the lanes i <= s.
  struct UpdateTables {
    alignas(16) int16_t target[kSymbols][kSymbols];
    alignas(16) int16_t le[kSymbols][kSymbols];
    uint8_t rate[129];
    uint8_t next_count[129];
  };
  static const UpdateTables& Tables() {
    static constexpr UpdateTables kTables = [] {
      UpdateTables t{};
      for (int s = 0; s < kSymbols; ++s) {
        for (int i = 0; i < kSymbols; ++i) {
          t.target[s][i] = static_cast<int16_t>(i <= s ? i : kTotal - kSymbols + i);
          t.le[s][i] = static_cast<int16_t>(i <= s ? -1 : 0);
        }
      }
      for (int c = 0; c <= 128; ++c) {
        t.rate[c] = static_cast<uint8_t>(4 + (c >= 16) + (c >= 48) + (c >= 128));
        t.next_count[c] = static_cast<uint8_t>(c < 128 ? c + 1 : 128);
      }
      return t;
    }();
    return kTables;
  }
  // cdf_[0] = 0, cdf_[kSymbols] = kTotal, strictly increasing.
  alignas(16) uint16_t cdf_[kSymbols + 1];
  uint8_t count_ = 0;  // symbols seen, saturating at 128
};

class RansEncoder {
 public:
  // Codes `s` with `model` and adapts the model.
  void Put(AdaptiveModel& model, int s) {
    ops_.push_back({static_cast<uint16_t>(model.start(s)), static_cast<uint16_t>(model.freq(s)),
                    AdaptiveModel::kScaleBits});
    model.Update(s);
  }
  // Codes the low `nbits` bits of `value` (nbits <= 16) at one bit per bit.
  void PutBits(uint32_t value, int nbits) {
    if (nbits > 0) {
      ops_.push_back(
          {static_cast<uint16_t>(value & ((1u << nbits) - 1)), 1, static_cast<uint8_t>(nbits)});
    }
  }
  // Capacity for `n` more symbols (avoids regrowth in a hot loop).
  void Reserve(size_t n) { ops_.reserve(ops_.size() + n); }
  // Appends the coded stream to `*out` and resets the encoder.
  void Finish(std::string* out);

 private:
  struct Op {  // start < 2^16, 1 <= freq < 2^15 (or 1 for raw bits), scale_bits <= 16
    uint16_t start, freq;
    uint8_t scale_bits;
  };
  std::vector<Op> ops_;
};

class RansDecoder {
 public:
  // `in` must stay alive while decoding.
  explicit RansDecoder(absl::string_view in);

  int Get(AdaptiveModel& model) {
    const uint32_t slot = state_ & (AdaptiveModel::kTotal - 1);
    const int s = model.Find(slot);
    state_ = model.freq(s) * (state_ >> AdaptiveModel::kScaleBits) + slot - model.start(s);
    model.Update(s);
    Renormalize();
    return s;
  }
  uint32_t GetBits(int nbits) {
    if (nbits <= 0) return 0;
    const uint32_t value = state_ & ((1u << nbits) - 1);
    state_ >>= nbits;
    Renormalize();
    return value;
  }
  // OK if the stream was well formed and fully consumed; DATA_LOSS otherwise.
  absl::Status Finish() const;

 private:
  static constexpr uint32_t kLower = 1u << 23;
  void Renormalize() {
    while (state_ < kLower) {
      if (pos_ < in_.size()) {
        state_ = (state_ << 8) | static_cast<uint8_t>(in_[pos_++]);
      } else {
        overrun_ = true;
        state_ = (state_ << 8) | 0x80;  // keeps the loop finite; Finish() reports the overrun
      }
    }
  }
  absl::string_view in_;
  size_t pos_ = 0;
  uint32_t state_ = 0;
  bool overrun_ = false;
};

// Integers through a 16-symbol model: zig-zag value z = 0..14 is one symbol; z >= 15 is symbol 15
// (escape), then e = z - 15 as Elias-gamma: the bit length n - 1 of (e + 1) with `escape_model`
// and its n - 1 low bits raw. |value| must be < 2^15.
inline uint32_t ZigZag(int32_t v) {
  return (static_cast<uint32_t>(v) << 1) ^ static_cast<uint32_t>(v >> 31);
}
inline int32_t UnZigZag(uint32_t z) {
  return static_cast<int32_t>(z >> 1) ^ -static_cast<int32_t>(z & 1);
}

inline void PutInt(RansEncoder& enc, AdaptiveModel& model, AdaptiveModel& escape_model, int32_t v) {
  const uint32_t z = ZigZag(v);
  if (z < 15) {
    enc.Put(model, static_cast<int>(z));
    return;
  }
  enc.Put(model, 15);
  const uint32_t e1 = z - 15 + 1;
  const int n = 31 - __builtin_clz(e1);  // e1 in [2^n, 2^(n+1))
  enc.Put(escape_model, n);
  enc.PutBits(e1, n);
}

// Returns false on a malformed escape (the decoder is then in an undefined but safe state).
inline bool GetInt(RansDecoder& dec, AdaptiveModel& model, AdaptiveModel& escape_model,
                   int32_t* v) {
  const int s = dec.Get(model);
  if (s < 15) {
    *v = UnZigZag(static_cast<uint32_t>(s));
    return true;
  }
  const int n = dec.Get(escape_model);
  const uint32_t e1 = (1u << n) | dec.GetBits(n);
  *v = UnZigZag(e1 - 1 + 15);
  return true;
}

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_RANS_H_
