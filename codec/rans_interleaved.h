// codec/rans_interleaved.h
//
// A static-model rANS coder with many interleaved states ("lanes"), built for decode throughput:
// no per-symbol adaptation, one table lookup per symbol, and a stream layout that 8 AVX2 lanes,
// 32 GPU threads of a warp, or one scalar loop all read the same way. The entropy stage of the
// fast residual profile (fast_residual.h); see codec/FORMAT.md for the byte layout.
//
// Model: a Table is a frequency table over up to kMaxSymbols symbols summing to 2^kScaleBits
// (4096), with at least two symbols of nonzero frequency (so every frequency is <= 4095 and a
// decode-table entry fits 32 bits). It is sent once per plane in the block's params.
//
// Coder: 32-bit states in [2^16, 2^32), 16-bit renormalization words (at most one per symbol).
// Symbol i of a segment of n symbols belongs to lane i % lanes and round i / lanes; rounds are
// decoded in order, the lanes of a round in lane order, and a lane that drops below 2^16 after
// its symbol reads the next 16-bit word of the segment's shared word stream. So in a round, lane
// j's word (if any) sits at position (words read before the round) + (number of lanes < j that
// also renormalize): a SIMD or GPU decoder computes it with a popcount / warp ballot. A segment
// is  [lanes x u32 final encoder states][u16 words]; after its last symbol every lane is back at
// 2^16 and every word is consumed, which the decoder checks (most corruptions fail there).
// Tables switch every `run` symbols (run % lanes == 0, so a round never straddles two tables).
// Source: J. Duda, arXiv:1311.2540; F. Giesen, "Interleaved entropy coders" (2014) and
// rans_word_sse41; the warp-wide layout of DietGPU (J. Johnson, Meta, 2021).
#ifndef KVTRIE_CODEC_RANS_INTERLEAVED_H_
#define KVTRIE_CODEC_RANS_INTERLEAVED_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvtrie {
namespace irans {

inline constexpr int kScaleBits = 12;
inline constexpr uint32_t kScale = 1u << kScaleBits;
inline constexpr int kMaxSymbols = 32;
inline constexpr int kMaxLanes = 32;
inline constexpr uint32_t kLow = 1u << 16;  // state interval [kLow, 2^32)

struct Table {
  int num_symbols = 0;  // symbols 0..num_symbols-1 may occur (2..kMaxSymbols)
  uint16_t freq[kMaxSymbols] = {};
  uint16_t start[kMaxSymbols + 1] = {};
};

// The table closest to `counts` (num_symbols = the last nonzero count + 1, at least 2): every
// symbol with a nonzero count gets a nonzero frequency, frequencies sum to kScale.
Table NormalizeCounts(const uint32_t* counts, int n);
// Bits to code `counts` with `t` (for choosing between table layouts).
double CostBits(const Table& t, const uint32_t* counts, int n);
// Serialized: u8 num_symbols, then LEB128 freq of symbols 0..num_symbols-2 (the last one is
// kScale minus their sum). Appends to `*out`.
void WriteTable(const Table& t, std::string* out);
// Parses a table at `*in` and advances it. Errors: DATA_LOSS if malformed.
absl::Status ReadTable(absl::string_view* in, Table* t);

// The decoder's view of a Table: entry[slot] = symbol | freq << 8 | (slot - start) << 20.
struct DecodeTable {
  uint32_t entry[kScale];
};
void BuildDecodeTable(const Table& t, DecodeTable* d);

// Encodes symbols[0..n) (n % lanes == 0, lanes a power of two in [1, kMaxLanes]) with table
// tables[i / run] for symbol i (run % lanes == 0), appending one segment to `*out`.
// REQUIRES: each symbol has a nonzero frequency in its table.
void EncodeSegment(absl::Span<const uint8_t> symbols, int lanes, size_t run,
                   absl::Span<const Table* const> tables, std::string* out);

// Decodes a segment of symbols.size() symbols written by EncodeSegment into `symbols`.
// Uses AVX2 when the CPU has it (checked at run time), else scalar code; both read the same
// layout. Errors: DATA_LOSS if the segment is truncated, has trailing words, or does not end in
// the initial state.
absl::Status DecodeSegment(absl::string_view segment, int lanes, size_t run,
                           absl::Span<const DecodeTable* const> tables,
                           absl::Span<uint8_t> symbols);
// The scalar decoder, always available (tests compare it with the dispatching one).
absl::Status DecodeSegmentScalar(absl::string_view segment, int lanes, size_t run,
                                 absl::Span<const DecodeTable* const> tables,
                                 absl::Span<uint8_t> symbols);
// True if the CPU has AVX2 (and popcnt) and SIMD is not turned off for a test.
bool HasAvx2();
// Tests: false makes every fast-profile kernel take its scalar path (process-wide).
void SetSimdForTesting(bool enabled);

}  // namespace irans
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_RANS_INTERLEAVED_H_
