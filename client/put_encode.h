// client/put_encode.h
//
// The client side of an encoded Put (PutOptions::encode_on_client): which requests the client may
// encode itself, and the encoding of one block of a sequence as the server would encode it (the
// fast profile, against the namespace's latest learned predictor state when there is one), so an
// encoded Put stores the bytes a dense Put would. Internal to the client.
// Thread-safe: pure functions.
#ifndef KVTRIE_CLIENT_PUT_ENCODE_H_
#define KVTRIE_CLIENT_PUT_ENCODE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "codec/block_codec.h"
#include "codec/kv_dump.h"

namespace kvtrie {

// OK if the client can encode what `options` asks for: RAW, or LOSSLESS or RESIDUAL of the fast
// profile (PROFILE_FAST or PROFILE_UNSPECIFIED; RESIDUAL with a target_rel_rms > 0: the server's
// default target is not known here), whole blocks (layers_per_message = 0). Else
// INVALID_ARGUMENT naming `encode_on_client` and why (the Put is then sent dense).
absl::Status CheckClientEncoding(const PutOptions& options);

// Block `b` of `kv` (sequence layout) of geometry `g`, encoded as `options` says against `state`
// (null: none), with its tokens, position and previous token. `scratch` holds the dense block.
absl::StatusOr<EncodedBlock> EncodePutBlock(const KvDump& kv, const BlockGeometry& g, size_t b,
                                            const PutOptions& options, const PredictorState* state,
                                            std::vector<uint8_t>* scratch);

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_PUT_ENCODE_H_
