// codec/block_verify.h
//
// Checks a block a client encoded itself (an encoded Put, kvtrie.v1.PutBlock.encoded) without
// decoding it: the envelope of envelope.h (magic, format version, lengths, CRC-32C), the
// geometry and dtype against the model it is put to, the encoding (RAW, LOSSLESS fast, RESIDUAL
// fast: the formats whose blocks decode without another block), reference node id 0, and every
// length, table and lane bound inside the payload (codec/FORMAT.md). What it cannot see without
// decoding — whether the rANS words and zstd frame decode to exactly the symbols they claim —
// the decoder still checks, and it never reads out of bounds on any byte string either (both are
// fuzzed: codec/fuzz/block_verify_fuzzer.cc).
//
// The predictor version a block names is returned, not checked: only the store knows which
// versions a (namespace, model) keeps. Linear and KLT planes, and the state fingerprint the block
// names (envelope flags bit 3: "predictor_fingerprint: ..." when it is another state's), are
// checked against `learned` when the caller has the state.
// Thread-safe: pure functions.
#ifndef KVTRIE_CODEC_BLOCK_VERIFY_H_
#define KVTRIE_CODEC_BLOCK_VERIFY_H_

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "codec/block_geometry.h"
#include "codec/envelope.h"

namespace kvtrie {

class PredictorState;  // codec/predictor_state.h

// Returns the parsed envelope of `encoded` if it is a well-formed block of `model` (geometry
// and dtype) in an accepted encoding. Errors: INVALID_ARGUMENT with a message naming what is
// wrong and where, without a field prefix (the caller adds "kv: block 7 encoded: "), e.g.
// "CRC-32C mismatch (stored 1a2b, computed 3c4d)", "head_dim: the block has 16, the model 8",
// "encoding: RESIDUAL of the compact profile is not accepted (...)", "segment 2 lane 12 runs past
// the payload". `learned`, when not null, must be the state of the version the block names.
absl::StatusOr<BlockHeader> VerifyEncodedBlock(const BlockGeometry& model,
                                               absl::string_view encoded,
                                               const PredictorState* learned = nullptr);

// As above, with the state looked up by the version the block names: `find_state` is called
// once, after the envelope checks, only for a block that names a version; its error is returned
// as it is (a store answers FAILED_PRECONDITION for a version it does not keep).
using FindPredictorState =
    absl::FunctionRef<absl::StatusOr<const PredictorState*>(uint32_t version)>;
absl::StatusOr<BlockHeader> VerifyEncodedBlock(const BlockGeometry& model,
                                               absl::string_view encoded,
                                               FindPredictorState find_state);

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_BLOCK_VERIFY_H_
