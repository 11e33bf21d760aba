#include "codec/rans_interleaved.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVTRIE_IRANS_AVX2 1
#endif

#include "absl/strings/str_cat.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the stream is read in place");

namespace kvtrie {
namespace irans {
namespace {

// What the encoder needs per symbol: x_max = freq << (32 - kScaleBits - 16 + 16) and a
// reciprocal with floor(x / freq) == (x * rcp) >> 45 for every x < 2^32 (freq < 2^13).
struct EncSymbol {
  uint32_t x_max = 0;
  uint32_t freq = 0;
  uint32_t start = 0;
  uint64_t rcp = 0;
};
constexpr int kRcpShift = 45;

void BuildEncSymbols(const Table& t, EncSymbol* out) {
  for (int s = 0; s < kMaxSymbols; ++s) {
    EncSymbol& e = out[s];
    e.freq = s < t.num_symbols ? t.freq[s] : 0;
    e.start = s < t.num_symbols ? t.start[s] : 0;
    e.x_max = e.freq << (32 - kScaleBits);  // (kLow >> kScaleBits) << 16, times freq
    e.rcp = e.freq ? ((1ull << kRcpShift) + e.freq - 1) / e.freq : 0;
  }
}

uint32_t Load32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

Table NormalizeCounts(const uint32_t* counts, int n) {
  Table t;
  n = std::min(n, kMaxSymbols);
  uint64_t total = 0;
  int last = -1, used = 0;
  for (int s = 0; s < n; ++s) {
    total += counts[s];
    if (counts[s]) last = s, ++used;
  }
  int64_t freq[kMaxSymbols] = {};
  if (used <= 1) {
    // One symbol (or none): give a second one frequency 1 so every frequency is < kScale.
    const int only = last < 0 ? 0 : last;
    const int other = only == 0 ? 1 : 0;
    freq[only] = kScale - 1;
    freq[other] = 1;
    last = std::max(only, other);
  } else {
    int64_t sum = 0;
    for (int s = 0; s <= last; ++s) {
      if (!counts[s]) continue;
      freq[s] = std::max<int64_t>(
          1, std::llround(static_cast<double>(counts[s]) * kScale / static_cast<double>(total)));
      sum += freq[s];
    }
    // Fix the sum on the largest frequencies (the relative error there is smallest).
    while (sum != kScale) {
      int big = 0;
      for (int s = 1; s <= last; ++s)
        if (freq[s] > freq[big]) big = s;
      if (sum < kScale) {
        freq[big] += kScale - sum;
        sum = kScale;
      } else {
        const int64_t take = std::min<int64_t>(sum - kScale, std::max<int64_t>(freq[big] / 8, 1));
        freq[big] -= take;
        sum -= take;
      }
    }
  }
  t.num_symbols = last + 1;
  uint32_t start = 0;
  for (int s = 0; s < t.num_symbols; ++s) {
    t.freq[s] = static_cast<uint16_t>(freq[s]);
    t.start[s] = static_cast<uint16_t>(start);
    start += t.freq[s];
  }
  t.start[t.num_symbols] = static_cast<uint16_t>(start);
  return t;
}

double CostBits(const Table& t, const uint32_t* counts, int n) {
  double bits = 0;
  for (int s = 0; s < n; ++s) {
    if (!counts[s]) continue;
    if (s >= t.num_symbols || t.freq[s] == 0) return INFINITY;
    bits += counts[s] * (kScaleBits - std::log2(static_cast<double>(t.freq[s])));
  }
  return bits;
}

void WriteTable(const Table& t, std::string* out) {
  out->push_back(static_cast<char>(t.num_symbols));
  for (int s = 0; s + 1 < t.num_symbols; ++s) {
    uint32_t f = t.freq[s];
    while (f >= 128) {
      out->push_back(static_cast<char>((f & 127) | 128));
      f >>= 7;
    }
    out->push_back(static_cast<char>(f));
  }
}

absl::Status ReadTable(absl::string_view* in, Table* t) {
  if (in->empty()) return absl::DataLossError("rans table: truncated");
  *t = Table();
  t->num_symbols = static_cast<uint8_t>((*in)[0]);
  in->remove_prefix(1);
  if (t->num_symbols < 2 || t->num_symbols > kMaxSymbols) {
    return absl::DataLossError(absl::StrCat("rans table: ", t->num_symbols, " symbols"));
  }
  uint32_t sum = 0;
  for (int s = 0; s + 1 < t->num_symbols; ++s) {
    uint32_t f = 0;
    for (int shift = 0;; shift += 7) {
      if (in->empty() || shift > 14) return absl::DataLossError("rans table: bad frequency");
      const uint8_t b = static_cast<uint8_t>((*in)[0]);
      in->remove_prefix(1);
      f |= static_cast<uint32_t>(b & 127) << shift;
      if (!(b & 128)) break;
    }
    sum += f;
    if (sum >= kScale) return absl::DataLossError("rans table: frequencies exceed the scale");
    t->start[s] = static_cast<uint16_t>(sum - f);
    t->freq[s] = static_cast<uint16_t>(f);
  }
  const int last = t->num_symbols - 1;
  t->start[last] = static_cast<uint16_t>(sum);
  t->freq[last] = static_cast<uint16_t>(kScale - sum);
  t->start[last + 1] = static_cast<uint16_t>(kScale);
  return absl::OkStatus();
}

void BuildDecodeTable(const Table& t, DecodeTable* d) {
  for (int s = 0; s < t.num_symbols; ++s) {
    const uint32_t base = static_cast<uint32_t>(s) | (static_cast<uint32_t>(t.freq[s]) << 8);
    uint32_t* e = d->entry + t.start[s];
    for (uint32_t k = 0; k < t.freq[s]; ++k) e[k] = base | (k << 20);
  }
}

namespace {

#ifdef KVTRIE_IRANS_AVX2
// The encoder's per-symbol values, one array per field for AVX2 gathers.
struct EncTable {
  alignas(32) uint32_t freq_start[kMaxSymbols];  // freq | start << 16 (x_max = freq << 20)
  alignas(32) float inv[kMaxSymbols];            // 1 / freq, rounded: q within 1 of floor(x / freq)
};
static_assert(kMaxSymbols == 32, "EncodeAvx2 looks symbols up in four 8-entry registers");

// compress[m][j]: the lanes of mask m in increasing order, in the top popcount(m) positions.
struct CompressTable {
  alignas(32) uint32_t v[256][8];
  CompressTable() {
    for (int m = 0; m < 256; ++m) {
      const int k = __builtin_popcount(m);
      int at = 8 - k;
      for (int j = 0; j < 8; ++j) v[m][j] = 0;
      for (int j = 0; j < 8; ++j)
        if (m >> j & 1) v[m][at++] = j;
    }
  }
};
const CompressTable& Compress() {
  static const CompressTable* const t = new CompressTable;
  return *t;
}

// The scalar encoder's loop, 8 lanes per AVX2 register (lanes % 8 == 0): the same states and the
// same words in the same order. Writes may reach 8 words below *wp (the buffer has that slack).
// v[idx] for idx < 32 from four 8-entry registers (bit3, bit4: idx's bits 3, 4 in the sign).
__attribute__((target("avx2"))) inline __m256 Lookup32(const uint32_t* v, __m256i idx, __m256 bit3,
                                                       __m256 bit4) {
  const __m256i* r = reinterpret_cast<const __m256i*>(v);
  const __m256 a = _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(_mm256_load_si256(r), idx));
  const __m256 b = _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(_mm256_load_si256(r + 1), idx));
  const __m256 c = _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(_mm256_load_si256(r + 2), idx));
  const __m256 d = _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(_mm256_load_si256(r + 3), idx));
  return _mm256_blendv_ps(_mm256_blendv_ps(a, b, bit3), _mm256_blendv_ps(c, d, bit3), bit4);
}

__attribute__((target("avx2,popcnt"))) void EncodeAvx2(const uint8_t* symbols, size_t n, int lanes,
                                                       size_t run, const EncTable* tables,
                                                       uint32_t* x, uint16_t** wpp) {
  const int groups = lanes / 8;
  __m256i xs[kMaxLanes / 8];
  for (int g = 0; g < groups; ++g)
    xs[g] = _mm256_loadu_si256(reinterpret_cast<__m256i*>(x + 8 * g));
  const CompressTable& ct = Compress();
  const __m256i low16 = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256 two = _mm256_set1_ps(2.0f);
  uint16_t* wp = *wpp;
  for (size_t r = n / lanes; r-- > 0;) {
    const size_t i0 = r * lanes;
    const EncTable& t = tables[i0 / run];
    for (int g = groups; g-- > 0;) {
      const __m256i idx = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(symbols + i0 + 8 * g)));
      // 32-entry lookups from four registers each (symbols < 32): no gathers.
      const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
      const __m256 bit4 = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 27));
      const __m256i fs = _mm256_castps_si256(Lookup32(t.freq_start, idx, bit3, bit4));
      const __m256i freq = _mm256_and_si256(fs, _mm256_set1_epi32(0xffff));
      const __m256i start = _mm256_srli_epi32(fs, 16);
      const __m256i x_max = _mm256_slli_epi32(freq, 32 - kScaleBits);
      const __m256 inv = Lookup32(reinterpret_cast<const uint32_t*>(t.inv), idx, bit3, bit4);
      __m256i s = xs[g];
      const __m256i emit = _mm256_cmpeq_epi32(_mm256_max_epu32(s, x_max), s);  // s >= x_max
      // Branch-free (some lane of 8 emits about 4 times in 5: a branch mispredicts often): the
      // 8 words are stored below wp either way and wp moves by the number of emitting lanes.
      const int m = _mm256_movemask_ps(_mm256_castsi256_ps(emit));
      const __m256i moved = _mm256_permutevar8x32_epi32(
          s, _mm256_load_si256(reinterpret_cast<const __m256i*>(ct.v[m])));
      const __m256i w = _mm256_shuffle_epi8(moved, low16);
      _mm_storeu_si128(
          reinterpret_cast<__m128i*>(wp - 8),
          _mm_unpacklo_epi64(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
      wp -= __builtin_popcount(m);
      s = _mm256_blendv_epi8(s, _mm256_srli_epi32(s, 16), emit);
      // q = floor(s / freq): s < freq << 20 here, so the float estimate is within 1.
      const __m256 sf = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(s, 1)), two);
      __m256i q = _mm256_cvttps_epi32(_mm256_mul_ps(sf, inv));
      __m256i rem = _mm256_sub_epi32(s, _mm256_mullo_epi32(q, freq));
      const __m256i neg = _mm256_cmpgt_epi32(_mm256_setzero_si256(), rem);  // -1 where rem < 0
      q = _mm256_add_epi32(q, neg);
      rem = _mm256_add_epi32(rem, _mm256_and_si256(neg, freq));
      const __m256i big = _mm256_cmpgt_epi32(rem, _mm256_sub_epi32(freq, one));  // rem >= freq
      q = _mm256_sub_epi32(q, big);
      rem = _mm256_sub_epi32(rem, _mm256_and_si256(big, freq));
      xs[g] = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(q, kScaleBits), rem), start);
    }
  }
  for (int g = 0; g < groups; ++g)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 8 * g), xs[g]);
  *wpp = wp;
}
#endif

}  // namespace

void EncodeSegment(absl::Span<const uint8_t> symbols, int lanes, size_t run,
                   absl::Span<const Table* const> tables, std::string* out) {
  const size_t n = symbols.size();
  std::vector<EncSymbol> enc(tables.size() * kMaxSymbols);
  for (size_t i = 0; i < tables.size(); ++i)
    BuildEncSymbols(*tables[i], enc.data() + i * kMaxSymbols);
  uint32_t x[kMaxLanes];
  std::fill(x, x + lanes, kLow);
  // Words are written backwards from the end (at most one per symbol), so they end up in the
  // decoder's order.
  // Reused per thread up to 32 MiB (no zeroing or page faults per call); larger ones are local.
  thread_local std::vector<uint16_t> reused;
  std::vector<uint16_t> local;
  std::vector<uint16_t>& words = n + 2 <= (16u << 20) ? reused : local;
  if (words.size() < n + 16) words.resize(n + 16);  // 8 words of slack below for EncodeAvx2
  uint16_t* const wend = words.data() + n + 16;
  uint16_t* wp = wend;
  const size_t mask = static_cast<size_t>(lanes) - 1;
  bool simd = false;
#ifdef KVTRIE_IRANS_AVX2
  if (lanes >= 8 && HasAvx2()) {
    std::vector<EncTable> soa(tables.size());
    for (size_t t = 0; t < tables.size(); ++t) {
      const EncSymbol* e = enc.data() + t * kMaxSymbols;
      for (int k = 0; k < kMaxSymbols; ++k) {
        soa[t].freq_start[k] = e[k].freq | e[k].start << 16;
        soa[t].inv[k] = e[k].freq ? 1.0f / static_cast<float>(e[k].freq) : 0.0f;
      }
    }
    EncodeAvx2(symbols.data(), n, lanes, run, soa.data(), x, &wp);
    simd = true;
  }
#endif
  for (size_t r = (n + run - 1) / run; !simd && r-- > 0;) {  // runs backwards, one table each
    const EncSymbol* table = enc.data() + r * kMaxSymbols;
    for (size_t i = std::min(n, (r + 1) * run); i-- > r * run;) {
      const EncSymbol& e = table[symbols[i]];
      uint32_t& s = x[i & mask];
      // Branch-free renormalization (the branch is taken about half the time): the word is
      // written below wp either way and kept only when the state had to shrink.
      const uint32_t emit = s >= e.x_max;
      wp[-1] = static_cast<uint16_t>(s);
      wp -= emit;
      s >>= 16 * emit;
      const uint32_t q =
          static_cast<uint32_t>((static_cast<unsigned __int128>(s) * e.rcp) >> kRcpShift);
      s = (q << kScaleBits) + (s - q * e.freq) + e.start;
    }
  }
  const size_t old = out->size();
  const size_t num_words = static_cast<size_t>(wend - wp);
  out->resize(old + 4 * lanes + 2 * num_words);
  char* p = out->data() + old;
  std::memcpy(p, x, 4 * lanes);
  std::memcpy(p + 4 * lanes, wp, 2 * num_words);
}

namespace {

// Decodes rounds [round, rounds) with the lane states in x[] and words from *w.
absl::Status ScalarRounds(uint32_t* x, int lanes, size_t run, size_t round, size_t rounds,
                          absl::Span<const DecodeTable* const> tables, const char** w,
                          const char* wend, uint8_t* symbols) {
  const char* p = *w;
  for (size_t r = round; r < rounds; ++r) {
    const size_t i0 = r * lanes;
    const uint32_t* entry = tables[i0 / run]->entry;
    uint8_t* out = symbols + i0;
    for (int j = 0; j < lanes; ++j) {
      uint32_t s = x[j];
      const uint32_t e = entry[s & (kScale - 1)];
      out[j] = static_cast<uint8_t>(e);
      s = ((e >> 8) & 0xfff) * (s >> kScaleBits) + (e >> 20);
      if (s < kLow) {
        if (wend - p < 2) return absl::DataLossError("rans segment: truncated");
        uint16_t v;
        std::memcpy(&v, p, 2);
        p += 2;
        s = (s << 16) | v;
      }
      x[j] = s;
    }
  }
  *w = p;
  return absl::OkStatus();
}

absl::Status CheckEnd(const uint32_t* x, int lanes, const char* w, const char* wend) {
  if (w != wend) return absl::DataLossError("rans segment: trailing words");
  for (int j = 0; j < lanes; ++j) {
    if (x[j] != kLow) return absl::DataLossError("rans segment: final state mismatch");
  }
  return absl::OkStatus();
}

absl::Status CheckShape(absl::string_view segment, int lanes, size_t run, size_t n,
                        size_t num_tables) {
  if (lanes < 1 || lanes > kMaxLanes || (lanes & (lanes - 1)) || run == 0 || run % lanes ||
      n % lanes || (n + run - 1) / run > num_tables) {
    return absl::DataLossError("rans segment: bad lane layout");
  }
  if (segment.size() < 4u * lanes || (segment.size() - 4u * lanes) % 2) {
    return absl::DataLossError("rans segment: truncated states");
  }
  return absl::OkStatus();
}

#ifdef KVTRIE_IRANS_AVX2
// perm[m][j] = the index of lane j's word among the lanes of mask m that renormalize.
struct PermTable {
  alignas(32) uint32_t v[256][8];
  PermTable() {
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int j = 0; j < 8; ++j) v[m][j] = (m >> j & 1) ? k++ : 0;
    }
  }
};
const PermTable& Perm() {
  static const PermTable* const t = new PermTable;
  return *t;
}

__attribute__((target("avx2,popcnt"))) absl::Status DecodeAvx2(
    absl::string_view segment, int lanes, size_t run, absl::Span<const DecodeTable* const> tables,
    absl::Span<uint8_t> symbols) {
  const size_t rounds = symbols.size() / lanes;
  const int groups = lanes / 8;
  alignas(32) uint32_t x[kMaxLanes];
  std::memcpy(x, segment.data(), 4 * lanes);
  const char* w = segment.data() + 4 * lanes;
  const char* const wend = segment.data() + segment.size();
  __m256i xs[kMaxLanes / 8];
  for (int g = 0; g < groups; ++g) xs[g] = _mm256_load_si256(reinterpret_cast<__m256i*>(x + 8 * g));
  const __m256i slot_mask = _mm256_set1_epi32(kScale - 1);
  const __m256i freq_mask = _mm256_set1_epi32(0xfff);
  const __m256i byte0 =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const PermTable& perm = Perm();
  size_t r = 0;
  for (; r < rounds; ++r) {
    if ((wend - w) / 2 < lanes) break;  // near the end: the scalar loop checks every word
    const size_t i0 = r * lanes;
    const int* entry = reinterpret_cast<const int*>(tables[i0 / run]->entry);
    for (int g = 0; g < groups; ++g) {
      __m256i s = xs[g];
      const __m256i e = _mm256_i32gather_epi32(entry, _mm256_and_si256(s, slot_mask), 4);
      const __m256i f = _mm256_and_si256(_mm256_srli_epi32(e, 8), freq_mask);
      s = _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(s, kScaleBits)),
                           _mm256_srli_epi32(e, 20));
      const __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(s, 16), _mm256_setzero_si256());
      const int m = _mm256_movemask_ps(_mm256_castsi256_ps(need));
      const __m256i words =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
      const __m256i sel = _mm256_permutevar8x32_epi32(
          words, _mm256_load_si256(reinterpret_cast<const __m256i*>(perm.v[m])));
      s = _mm256_blendv_epi8(s, _mm256_or_si256(_mm256_slli_epi32(s, 16), sel), need);
      w += 2 * __builtin_popcount(m);
      xs[g] = s;
      const __m256i b = _mm256_shuffle_epi8(e, byte0);
      const __m128i packed =
          _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(symbols.data() + i0 + 8 * g), packed);
    }
  }
  for (int g = 0; g < groups; ++g) _mm256_store_si256(reinterpret_cast<__m256i*>(x + 8 * g), xs[g]);
  if (auto st = ScalarRounds(x, lanes, run, r, rounds, tables, &w, wend, symbols.data());
      !st.ok()) {
    return st;
  }
  return CheckEnd(x, lanes, w, wend);
}
#endif

}  // namespace

namespace {
std::atomic<bool> simd_enabled{true};
}  // namespace

void SetSimdForTesting(bool enabled) { simd_enabled.store(enabled); }

bool HasAvx2() {
#ifdef KVTRIE_IRANS_AVX2
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
  return has && simd_enabled.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

absl::Status DecodeSegmentScalar(absl::string_view segment, int lanes, size_t run,
                                 absl::Span<const DecodeTable* const> tables,
                                 absl::Span<uint8_t> symbols) {
  if (auto s = CheckShape(segment, lanes, run, symbols.size(), tables.size()); !s.ok()) return s;
  uint32_t x[kMaxLanes];
  for (int j = 0; j < lanes; ++j) x[j] = Load32(segment.data() + 4 * j);
  const char* w = segment.data() + 4 * lanes;
  const char* const wend = segment.data() + segment.size();
  if (auto s =
          ScalarRounds(x, lanes, run, 0, symbols.size() / lanes, tables, &w, wend, symbols.data());
      !s.ok()) {
    return s;
  }
  return CheckEnd(x, lanes, w, wend);
}

absl::Status DecodeSegment(absl::string_view segment, int lanes, size_t run,
                           absl::Span<const DecodeTable* const> tables,
                           absl::Span<uint8_t> symbols) {
#ifdef KVTRIE_IRANS_AVX2
  if (lanes >= 8 && HasAvx2()) {
    if (auto s = CheckShape(segment, lanes, run, symbols.size(), tables.size()); !s.ok()) return s;
    return DecodeAvx2(segment, lanes, run, tables, symbols);
  }
#endif
  return DecodeSegmentScalar(segment, lanes, run, tables, symbols);
}

}  // namespace irans
}  // namespace kvtrie
