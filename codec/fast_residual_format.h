// codec/fast_residual_format.h
//
// The FAST residual params layout shared by its encoder (fast_residual.cc) and decoder
// (fast_residual_decode.cc): flag bits, predictor codes beyond the kernels', the segment layout.
// Byte layout: codec/FORMAT.md. Internal to the codec.
#ifndef KVTRIE_CODEC_FAST_RESIDUAL_FORMAT_H_
#define KVTRIE_CODEC_FAST_RESIDUAL_FORMAT_H_

#include <cstddef>
#include <cstdint>

#include "codec/fast_residual_kernels.h"

namespace kvtrie {
namespace internal {
namespace fast_format {

using fast::kPredToken;

// Params flags (byte 1): one table per K/V, after the planes.
inline constexpr uint8_t kFlagSharedTables = 1;
// ... and a bitmap of the planes whose quantized residual is all zero: they have no step, bucket
// bit count, table or symbols (x' is the prediction).
inline constexpr uint8_t kFlagZeroPlanes = 2;
// ... every head of every plane uses the learned predictor (code 3): no predictor bytes.
inline constexpr uint8_t kFlagAllLearned = 4;
// ... predictor codes are 4 bits per head (codes 0..4; never with kFlagAllLearned).
inline constexpr uint8_t kFlagWideCodes = 8;
// ... with kFlagAllLearned: a bitmap of the planes whose every head uses code 4 (linear) follows.
inline constexpr uint8_t kFlagLinearPlanes = 16;
// ... a bitmap of the planes whose learned heads (codes 3, 4) are coded in the state's KLT basis.
inline constexpr uint8_t kFlagKltPlanes = 32;
// Code 4: the learned mean plus the state's cross-layer linear prediction (kTokenMeanLinear);
// the kernels see it as kPredToken with the plane's linear prediction as the side.
inline constexpr uint8_t kPredLinear = 4;
inline constexpr uint8_t KernelCode(uint8_t c) {
  return c == kPredLinear ? uint8_t{kPredToken} : c;
}
// ... but of at most this many planes: a decoder holds a 16 KiB table per plane of a segment.
inline constexpr size_t kMaxSegmentPlanes = 64;

// Segments of coded planes and rANS lanes.
struct Layout {
  size_t planes_per_segment = 1;
  int lanes = 1;
  size_t num_segments(size_t planes) const {
    return (planes + planes_per_segment - 1) / planes_per_segment;
  }
};

}  // namespace fast_format
}  // namespace internal
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_FAST_RESIDUAL_FORMAT_H_
