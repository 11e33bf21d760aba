// codec/det_math.h
//
// Deterministic elementary functions: e^y and cos, sin computed with IEEE +, *, / only (no libm,
// whose last bits differ between machines and library versions), so that an encoder and a decoder
// on different machines compute the same bits. The RoPE angle tables of the residual codec
// (residual_kernels.h), the learned predictor state (predictor_state.h) and the shifted reference
// (reference_shift.h) are built from them; a changed bit here changes the blocks they decode, so
// these are part of the format. Internal to the codec. Requires the codec's -ffp-contract=off.
// Thread-safe: pure functions.
#ifndef KVTRIE_CODEC_DET_MATH_H_
#define KVTRIE_CODEC_DET_MATH_H_

namespace kvtrie {
namespace internal {

// e^y for |y| <= ~40: the Taylor series of e^(y / 2^12), squared 12 times.
double DetExp(double y);

// cos(a) and sin(a) for |a| <= 1: the Taylor series (23 terms). Callers reduce larger angles
// themselves (each format fixes its own reduction).
void DetCosSin(double a, double* c, double* s);

}  // namespace internal
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_DET_MATH_H_
