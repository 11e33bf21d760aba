#include "codec/fast_lossless_learned.h"

#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/predictor_state.h"
#include "codec/rans_interleaved.h"

namespace kvtrie {
namespace {

constexpr int kLanes = 32;
constexpr int kTokens = 28;

// The monotone bijection of 16-bit patterns onto uint16 arithmetic (int16 order): a set sign bit
// flips the 15 magnitude bits (0xffff - magnitude). Its own inverse. Branchless.
inline uint16_t Ord(uint16_t h) {
  return static_cast<uint16_t>(h ^ (static_cast<uint16_t>(static_cast<int16_t>(h) >> 15) & 0x7fff));
}
inline uint16_t Unord(uint16_t u) { return Ord(u); }

// Token t -> the bits of z above the raw ones, and how many raw bits follow (t < kTokens).
struct TokenCode {
  uint16_t base;
  uint8_t raw_bits;
};
constexpr TokenCode MakeCode(int t) {
  return t < 16 ? TokenCode{static_cast<uint16_t>(t), 0}
                : TokenCode{static_cast<uint16_t>(1u << (t - 12)), static_cast<uint8_t>(t - 12)};
}
constexpr TokenCode kCodes[kTokens] = {
    MakeCode(0),  MakeCode(1),  MakeCode(2),  MakeCode(3),  MakeCode(4),  MakeCode(5),
    MakeCode(6),  MakeCode(7),  MakeCode(8),  MakeCode(9),  MakeCode(10), MakeCode(11),
    MakeCode(12), MakeCode(13), MakeCode(14), MakeCode(15), MakeCode(16), MakeCode(17),
    MakeCode(18), MakeCode(19), MakeCode(20), MakeCode(21), MakeCode(22), MakeCode(23),
    MakeCode(24), MakeCode(25), MakeCode(26), MakeCode(27)};

inline int BitLength(uint32_t z) { return 32 - __builtin_clz(z); }

void PutU32(std::string* out, uint32_t v) {
  char b[4];
  std::memcpy(b, &v, 4);
  out->append(b, 4);
}

absl::Status GetU32(absl::string_view* in, uint32_t* v, const char* what) {
  if (in->size() < 4) return absl::DataLossError(absl::StrCat("fast lossless learned: ", what));
  std::memcpy(v, in->data(), 4);
  in->remove_prefix(4);
  return absl::OkStatus();
}

// The block's prediction rounded to the dtype, one 16-bit pattern per element.
void Prediction(const BlockGeometry& g, const PredictorState& state,
                absl::Span<const int32_t> tokens, uint32_t first_position, int32_t previous_token,
                std::vector<uint16_t>* ph) {
  std::vector<float> p(g.num_elements());
  state.Predict(tokens, first_position, previous_token, p.data());
  ph->resize(p.size());
  FromFloat(g.dtype, p.data(), p.size(), ph->data());
}

class BitWriter {
 public:
  explicit BitWriter(std::string* out) : out_(out) {}
  void Put(uint32_t v, int n) {  // n <= 16
    acc_ |= static_cast<uint64_t>(v) << fill_;
    fill_ += n;
    if (fill_ >= 32) {
      char b[4];
      const uint32_t w = static_cast<uint32_t>(acc_);
      std::memcpy(b, &w, 4);
      out_->append(b, 4);
      acc_ >>= 32;
      fill_ -= 32;
    }
  }
  void Flush() {
    while (fill_ > 0) {
      out_->push_back(static_cast<char>(acc_ & 0xff));
      acc_ >>= 8;
      fill_ = fill_ > 8 ? fill_ - 8 : 0;
    }
    acc_ = 0;
  }

 private:
  std::string* out_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

class BitReader {
 public:
  explicit BitReader(absl::string_view in) : in_(in) {}
  // False if fewer than n (<= 16) bits are left.
  bool Get(int n, uint32_t* v) {
    if (fill_ < n) {
      if (pos_ + 8 <= in_.size()) {
        // Branchless refill (F. Giesen, "Reading bits in far too many ways", variant 4): the
        // bytes past the ones counted are ORed in again, identically, by the next refill.
        uint64_t w;
        std::memcpy(&w, in_.data() + pos_, 8);
        acc_ |= w << fill_;
        pos_ += (63 - fill_) >> 3;
        fill_ |= 56;
      } else {
        while (fill_ < n) {
          if (pos_ >= in_.size()) return false;
          acc_ |= static_cast<uint64_t>(static_cast<uint8_t>(in_[pos_++])) << fill_;
          fill_ += 8;
        }
      }
    }
    *v = static_cast<uint32_t>(acc_ & ((1ull << n) - 1));
    acc_ >>= n;
    fill_ -= n;
    return true;
  }
  // True if every byte was read and the unread bits of the last one are zero.
  bool AtEnd() const { return pos_ == in_.size() && fill_ < 8 && acc_ == 0; }

 private:
  absl::string_view in_;
  size_t pos_ = 0;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

}  // namespace

bool CanCodeFastLosslessLearned(const BlockGeometry& g, const PredictorState& state,
                                absl::Span<const int32_t> tokens) {
  return DTypeBytes(g.dtype) == 2 && tokens.size() == g.block_tokens &&
         internal::CheckLearnedGeometry(state, g).ok();
}

void CompressFastLosslessLearned(const BlockGeometry& g, absl::Span<const uint8_t> data,
                                 const PredictorState& state, absl::Span<const int32_t> tokens,
                                 uint32_t first_position, int32_t previous_token,
                                 std::string* out) {
  std::vector<uint16_t> ph;
  Prediction(g, state, tokens, first_position, previous_token, &ph);
  const size_t planes = 2 * g.num_layers;
  const size_t n = g.num_elements() / planes;
  const size_t padded = (n + kLanes - 1) / kLanes * kLanes;
  std::vector<uint8_t> sym(planes * padded);
  std::vector<irans::Table> tables(planes);
  std::string raw;
  BitWriter bits(&raw);
  for (size_t pl = 0; pl < planes; ++pl) {
    uint32_t counts[kTokens] = {};
    uint8_t* ps = sym.data() + pl * padded;
    for (size_t i = 0; i < n; ++i) {
      const size_t e = pl * n + i;
      uint16_t x;
      std::memcpy(&x, data.data() + 2 * e, 2);
      const int16_t d = static_cast<int16_t>(static_cast<uint16_t>(Ord(x) - Ord(ph[e])));
      const uint32_t z = (static_cast<uint32_t>(static_cast<uint16_t>(d)) << 1 & 0xffff) ^
                         static_cast<uint32_t>(static_cast<uint16_t>(d >> 15));
      // Branchless: z < 16 is its own token, else 11 + bit length with bit length - 1 raw bits.
      const int nb = BitLength(z | 1);
      const bool small = z < 16;
      const int raw_bits = small ? 0 : nb - 1;
      ps[i] = static_cast<uint8_t>(small ? z : static_cast<uint32_t>(11 + nb));
      bits.Put(z & ((1u << raw_bits) - 1), raw_bits);
      ++counts[ps[i]];
    }
    for (size_t i = n; i < padded; ++i) ps[i] = 0, ++counts[0];
    int last = 0;
    for (int s = 0; s < kTokens; ++s)
      if (counts[s]) last = s;
    tables[pl] = irans::NormalizeCounts(counts, std::max(2, last + 1));
    irans::WriteTable(tables[pl], out);
  }
  bits.Flush();
  std::vector<const irans::Table*> table_ptrs(planes);
  for (size_t pl = 0; pl < planes; ++pl) table_ptrs[pl] = &tables[pl];
  std::string segment;
  irans::EncodeSegment(sym, kLanes, padded, table_ptrs, &segment);
  PutU32(out, static_cast<uint32_t>(segment.size()));
  out->append(segment);
  PutU32(out, static_cast<uint32_t>(raw.size()));
  out->append(raw);
}

absl::Status DecompressFastLosslessLearned(const BlockGeometry& g, absl::string_view payload,
                                           const PredictorState& state,
                                           absl::Span<const int32_t> tokens,
                                           uint32_t first_position, int32_t previous_token,
                                           absl::Span<uint8_t> out) {
  if (out.size() != g.num_bytes()) return absl::InvalidArgumentError("out: wrong size");
  if (!CanCodeFastLosslessLearned(g, state, tokens)) {
    return absl::FailedPreconditionError(
        "fast lossless learned: needs a 16-bit dtype, a state of the block's geometry and its "
        "token ids");
  }
  const size_t planes = 2 * g.num_layers;
  const size_t n = g.num_elements() / planes;
  const size_t padded = (n + kLanes - 1) / kLanes * kLanes;
  absl::string_view in = payload;
  std::vector<irans::DecodeTable> dtables(planes);
  std::vector<const irans::DecodeTable*> table_ptrs(planes);
  for (size_t pl = 0; pl < planes; ++pl) {
    irans::Table table;
    if (auto s = irans::ReadTable(&in, &table); !s.ok()) return s;
    if (table.num_symbols > kTokens) {
      return absl::DataLossError("fast lossless learned: a table with more than 28 symbols");
    }
    irans::BuildDecodeTable(table, &dtables[pl]);
    table_ptrs[pl] = &dtables[pl];
  }
  uint32_t seg_bytes = 0, raw_bytes = 0;
  if (auto s = GetU32(&in, &seg_bytes, "truncated before the segment length"); !s.ok()) return s;
  if (seg_bytes > in.size()) return absl::DataLossError("fast lossless learned: segment length");
  const absl::string_view segment = in.substr(0, seg_bytes);
  in.remove_prefix(seg_bytes);
  std::vector<uint8_t> sym(planes * padded);
  if (auto s = irans::DecodeSegment(segment, kLanes, padded, table_ptrs, absl::MakeSpan(sym));
      !s.ok()) {
    return s;
  }
  if (auto s = GetU32(&in, &raw_bytes, "truncated before the raw length"); !s.ok()) return s;
  if (raw_bytes != in.size()) {
    return absl::DataLossError(absl::StrCat("fast lossless learned: ", raw_bytes,
                                            " raw bytes, the payload has ", in.size()));
  }
  std::vector<uint16_t> ph;
  Prediction(g, state, tokens, first_position, previous_token, &ph);
  BitReader bits(in);
  for (size_t pl = 0; pl < planes; ++pl) {
    const uint8_t* ps = sym.data() + pl * padded;
    for (size_t i = 0; i < n; ++i) {
      // ps[i] < kTokens: the segment only decodes symbols of its table (<= 28 symbols, checked).
      const TokenCode c = kCodes[ps[i]];
      uint32_t low = 0;
      if (!bits.Get(c.raw_bits, &low)) {
        return absl::DataLossError("fast lossless learned: raw bits truncated");
      }
      const uint32_t z = c.base | low;
      const uint16_t d = static_cast<uint16_t>((z >> 1) ^ (0u - (z & 1)));
      const size_t e = pl * n + i;
      const uint16_t x = Unord(static_cast<uint16_t>(Ord(ph[e]) + d));
      std::memcpy(out.data() + 2 * e, &x, 2);
    }
  }
  if (!bits.AtEnd()) return absl::DataLossError("fast lossless learned: trailing raw bits");
  return absl::OkStatus();
}

absl::Status CheckFastLosslessLearnedLayout(const BlockGeometry& g, absl::string_view payload) {
  if (DTypeBytes(g.dtype) != 2) {
    return absl::DataLossError("fast lossless learned: the dtype is not 16-bit");
  }
  const size_t planes = 2 * g.num_layers;
  const size_t n = g.num_elements() / planes;
  const size_t padded = (n + kLanes - 1) / kLanes * kLanes;
  absl::string_view in = payload;
  for (size_t pl = 0; pl < planes; ++pl) {
    irans::Table table;
    if (auto s = irans::ReadTable(&in, &table); !s.ok()) {
      return absl::DataLossError(absl::StrCat("plane ", pl, ": ", s.message()));
    }
    if (table.num_symbols > kTokens) {
      return absl::DataLossError(absl::StrCat("plane ", pl, ": the table has ", table.num_symbols,
                                              " symbols, at most 28"));
    }
  }
  uint32_t seg = 0, raw = 0;
  if (auto s = GetU32(&in, &seg, "truncated before the segment length"); !s.ok()) return s;
  if (seg > in.size() || seg < 4u * kLanes || (seg - 4u * kLanes) % 2 != 0 ||
      (seg - 4u * kLanes) / 2 > planes * padded) {  // a symbol reads at most one word
    return absl::DataLossError(absl::StrCat("payload: a segment of ", seg, " bytes for ",
                                            planes * padded, " symbols and ", in.size(),
                                            " bytes left"));
  }
  in.remove_prefix(seg);
  if (auto s = GetU32(&in, &raw, "truncated before the raw length"); !s.ok()) return s;
  if (raw != in.size() || raw > 2 * g.num_elements()) {  // at most 15 raw bits an element
    return absl::DataLossError(
        absl::StrCat("payload: ", raw, " raw bytes, ", in.size(), " bytes left"));
  }
  return absl::OkStatus();
}

}  // namespace kvtrie
