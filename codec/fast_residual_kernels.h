// codec/fast_residual_kernels.h
//
// The arithmetic of the fast residual profile (fast_residual.h) that encoder and decoder share,
// and its SIMD kernels (AVX2 / F16C, chosen at run time, with scalar versions that give the same
// floats): the symbol alphabet (direct ZigZag values and log buckets), closed-loop quantization
// of a head, reconstruction, and error sums. Internal to the codec; layout in codec/FORMAT.md.
#ifndef KVTRIE_CODEC_FAST_RESIDUAL_KERNELS_H_
#define KVTRIE_CODEC_FAST_RESIDUAL_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "codec/rans_interleaved.h"

namespace kvtrie {
namespace internal {
namespace fast {

// Per-thread scratch of `n` floats (or bytes) that outlives the call: no allocation, zeroing
// or page faults per block. `slot` names the buffer (each caller its own, see kSlot*); contents
// are unspecified on entry. Buffers of more than kMaxReused bytes are not kept (returned as a
// fresh vector in `local`, which must outlive the use). Not reentrant per slot.
enum ReusedSlot { kSlotEncLearned, kSlotEncResidual, kSlotDecLearned, kNumSlots };
inline constexpr size_t kMaxReused = 16u << 20;  // a Llama-3-70B block of floats fits
template <typename T>
T* Reused(ReusedSlot slot, size_t n, std::vector<T>* local) {
  if (n * sizeof(T) > kMaxReused) {
    local->resize(n);
    return local->data();
  }
  thread_local std::vector<T> kept[kNumSlots];
  std::vector<T>& v = kept[slot];
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Symbols: ZigZag values z < kDirect are a symbol each; larger ones fall in one of kBuckets
// buckets, two per octave (bucket b holds 2^(b / 2 + 1) values from kBucketBase[b]), coded as the
// bucket's symbol kDirect + b and b / 2 + 1 raw bits (the offset in the bucket) in the plane's
// bit stream, as DEFLATE's length codes.
constexpr int kDirect = 12;
constexpr int kBuckets = irans::kMaxSymbols - kDirect;  // 20
constexpr int BucketBits(int b) { return b / 2 + 1; }
struct BucketTable {
  uint32_t base[kBuckets + 1];
  constexpr BucketTable() : base() {
    base[0] = kDirect;
    for (int b = 0; b < kBuckets; ++b) base[b + 1] = base[b] + (1u << BucketBits(b));
  }
};
constexpr BucketTable kBucket;
constexpr int32_t kMaxQ = 2051;  // ZigZag(+-kMaxQ) < kBucket.base[kBuckets] = 4104
static_assert(2 * kMaxQ < kBucket.base[kBuckets]);

// Predictor codes of a head (2 bits in params). kPredToken: a per-token prediction [T][D] (the
// learned token mean, predictor_state.h); the kernels' `mean` then points to the head's [T][D].
enum : uint8_t { kPredNone = 0, kPredMean = 1, kPredTemporal = 2, kPredToken = 3 };

// LSB-first bit stream.
class BitWriter {
 public:
  void Put(uint32_t v, int n) {
    acc_ |= static_cast<uint64_t>(v) << fill_;
    fill_ += n;
    total_ += n;
    if (fill_ >= 32) {  // four bytes at once (n <= 32, so fill_ < 64)
      const char b[4] = {static_cast<char>(acc_), static_cast<char>(acc_ >> 8),
                         static_cast<char>(acc_ >> 16), static_cast<char>(acc_ >> 24)};
      bytes_.append(b, 4);
      acc_ >>= 32;
      fill_ -= 32;
    }
  }
  uint64_t bits() const { return total_; }
  void Finish(std::string* out) {
    for (; fill_ > 0; fill_ -= 8, acc_ >>= 8) bytes_.push_back(static_cast<char>(acc_));
    fill_ = 0;
    out->append(bytes_);
  }

 private:
  std::string bytes_;
  uint64_t acc_ = 0;
  int fill_ = 0;
  uint64_t total_ = 0;
};

// x' = prediction + q * step, the one reconstruction rule (the codec is built with
// -ffp-contract=off: never an FMA, so encoder, scalar and AVX2 decoders agree bit for bit).
inline float Recon(float pred, int32_t q, float step) {
  return pred + static_cast<float>(q) * step;
}

constexpr uint8_t kNoSymbol = 255;

// Reads n <= 16 bits at bit `pos` of a stream padded with 8 bytes.
inline uint32_t ReadBits(const uint8_t* s, uint64_t pos, int n) {
  uint64_t v;
  std::memcpy(&v, s + pos / 8, 8);
  return static_cast<uint32_t>((v >> (pos % 8)) & ((1u << n) - 1));
}

// sym[i] = ZigZag(q[i]) when < kDirect, else kNoSymbol.
void MapSymbols(const int32_t* __restrict q, size_t n, uint8_t* __restrict sym);
// counts[s] = occurrences of s < irans::kMaxSymbols in sym (kNoSymbol is not counted).
void Histogram(const uint8_t* __restrict sym, size_t n, uint32_t* __restrict counts);
// Histogram of MapSymbols' output (every sym < kDirect or kNoSymbol; counts[kDirect..] = 0),
// AVX2 where available; the same counts.
void HistogramDirect(const uint8_t* __restrict sym, size_t n, uint32_t* __restrict counts);
// Replaces every kNoSymbol by its bucket's symbol, counts it and writes its offset bits, in
// element order.
void EncodeBuckets(const int32_t* q, size_t n, uint8_t* sym, uint32_t* counts, BitWriter* bits);
// True if any float is an infinity or a NaN.
bool AnyNonFinite(const float* x, size_t n);
// Sum of squares in double and the largest magnitude: of a[i] (b == nullptr) or a[i] - b[i].
double SumSquares(const float* a, const float* b, size_t n, float* max_abs);
// The encoder's per-channel L1 sums of head x [T][D] for the predictor choice: sum[d] += x[t][d]
// (the channel sums, for the means), acc[0][d] = sum |x|, acc[1][d] = sum |x - mean|,
// acc[2][d] = sum |x - x of the previous token| (token 0 against 0), acc[3][d] = sum
// |x - learned| and acc[4][d] = sum |x - linear| (learned, linear [T][D] or null: the row is
// left alone). `acc` is [5][D], overwritten; every channel sums its tokens in order, so the
// AVX2 and scalar versions give the same floats. ChannelSums adds the column sums into sum.
void ChannelSums(const float* x, size_t T, size_t D, float* sum);
void HeadL1(const float* x, const float* mean, const float* learned, const float* linear, size_t T,
            size_t D, float* acc);

// Closed-loop quantization of one head [T][D] with predictor `pred` (kPred*): q and x'.
void QuantizeHead(const float* x, size_t T, size_t D, uint8_t pred, const float* mean,
                  const float* zeros, float step, float dz, int32_t* q, float* rec);
// True if QuantizeHeadFp16 may be called (AVX2 and F16C).
bool HasAvx2F16c();
// QuantizeHead for an fp16 block with D % 8 == 0, returning the squared error of x' rounded to
// fp16 and raising *max_abs to its largest |error|. REQUIRES: HasAvx2F16c().
double QuantizeHeadFp16(const float* x, size_t T, size_t D, uint8_t pred, const float* mean,
                        const float* zeros, float step, float dz, int32_t* q, float* rec,
                        float* max_abs);
// q as floats from the direct symbols (bucket symbols get a placeholder).
void DirectValues(const uint8_t* sym, size_t n, float* qf);
// x' = prediction + q * step of one head [T][D].
void ReconHead(const float* qf, size_t T, size_t D, uint8_t pred, const float* mean,
               const float* zeros, float step, float* rec);
// The decorrelating transform of a learned head (PredictorState::Klt; u = its D x D basis U,
// row-major, column j = basis vector j). KltForward: z[t] = U^T (x[t] - pred[t]).
// KltReconHead: x'[t][i] = pred[t][i] + sum_j U[i][j] * (q[t][j] * step) (float32, j ascending,
// never fused; the encoder and decoder both reconstruct with it). `scratch`: D floats.
void KltForward(const float* x, const float* pred, const float* u, size_t T, size_t D, float* z);
void KltReconHead(const float* qf, const float* pred, const float* u, size_t T, size_t D,
                  float step, float* scratch, float* rec);

}  // namespace fast
}  // namespace internal
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_FAST_RESIDUAL_KERNELS_H_
