// codec/envelope.h
//
// The envelope of an encoded KV block — what every encoding shares: the enums that name an
// encoding, its coder and its predictors, the options and context an encoder is given and the
// result it returns, the parsed header (BlockHeader), and the envelope's parser and writer.
// A leaf of the codec: it knows no coder (the coders include it; block_codec.h dispatches to
// them), so a module that only needs these types includes this header, not block_codec.h.
//
// Encoded block, version 1 (all integers little-endian):
//   0   4  magic "KVB1"
//   4   1  format_version (1)
//   5   1  encoding (Encoding)
//   6   1  dtype (DType)
//   7   1  flags: bit 0 = the fast profile (Profile::kFast: fast_residual.h, fast_lossless.h;
//            codec/FORMAT.md); bit 1 = a predictor version follows the node id (kResidual only);
//            bit 2 = a content checksum follows (below); bit 3 = a predictor state fingerprint
//            follows the version (only with bit 1); bit 7 = coded against a shifted reference
//            (reference_shift.h: the params start with its prefix); other bits 0
//   8   2  num_layers    10  2  num_kv_heads    12  2  block_tokens    14  2  head_dim
//   16  8  reference node id (the centroid a residual is taken against; 0 = none)
//  [24  4  predictor version (> 0), only with flags bit 1: the learned PredictorState the block
//          was coded against (predictor_state.h); set exactly when some (layer, K/V, head) uses a
//          learned predictor. Blocks without it are byte-identical to before.]
//  [..  8  state fingerprint, only with flags bit 3 (and bit 1): PredictorState::fingerprint() of
//          the state the block was coded against (XXH3-64 of its serialized bytes), so a block
//          names its state, not only a per-namespace counter.]
//  [..  8  content checksum, only with flags bit 2: XXH3-64 (seed 0) of the block exactly as
//          DecodeBlock returns it (geometry.num_bytes() bytes in the block's dtype): the input of
//          a lossless block, the decoder's reconstruction of a lossy one. The encoder writes it
//          unless EncodeOptions::content_checksum is false; every decoder checks it (DATA_LOSS
//          "content checksum mismatch"). Blocks without it decode as before.]
//   ..  4  params_len P, then P bytes of encoding parameters (quantizer steps, predictor choice)
//   ..  4  payload_len N, then N bytes of payload
//   ..  4  CRC-32C of every byte before it
// A block that fails any of these checks is rejected with DATA_LOSS, never decoded.
//
// Thread-safe: pure functions.
// Source: the envelope follows LevelDB's block trailer (type byte + masked CRC32C), unmasked here.
#ifndef KVTRIE_CODEC_ENVELOPE_H_
#define KVTRIE_CODEC_ENVELOPE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"
#include "codec/reference_shift.h"

namespace kvtrie {

class PredictorState;  // codec/predictor_state.h

// How a block is stored. Values match kvtrie.v1.Encoding.
enum class Encoding : uint8_t {
  kRaw = 1,       // the tensor bytes as given
  kLossless = 2,  // bit-exact (lossless.h): fp16/bf16 context-modelled with rANS, else zstd planes
  kResidual = 3,  // kvtrie predictive residual coding, lossy to an error target (residual_codec.h)
  kInt8 = 4,      // baseline: int8 per token and head, fp16 absmax scale (baselines.h)
  kKivi2 = 5,  // baseline: KIVI 2-bit, keys per channel (group = block_tokens tokens), values per
               // token (group = head_dim channels), fp16 min and scale per group (baselines.h)
  kTurboQuant = 6,  // baseline: randomized Hadamard rotation + Gaussian Lloyd-Max at
                    // turboquant_bits bits, fp16 norm per vector (baselines.h)
};
bool IsValidEncoding(uint32_t value);
absl::string_view EncodingName(Encoding encoding);
// True for the encodings that are not bit-exact (kResidual, kInt8, kKivi2, kTurboQuant).
bool IsLossyEncoding(Encoding encoding);

// Predictors of the residual encoding, chosen per (layer, K/V, head). Values are stored in params.
enum class Predictor : uint8_t {
  kNone = 0,         // prediction 0
  kChannelMean = 1,  // per-channel mean of the head over the block (fp16, in params)
  kTemporal = 2,     // previous token's reconstructed vector (closed loop); first token from 0
  kParent = 3,       // as temporal, first token from the parent block's last token
  kCentroid = 4,     // the reference block, same position
  kExternal = 5,     // the caller's prediction tensor, same position
  // Learned (PredictionContext::learned, PredictorState::Predict): the state's (previous token,
  // token) pair mean where it has one, else E[kv | token], else the all-token mean (keys pre-RoPE,
  // rotated at first_position + t). Needs context.learned and context.tokens (and the same
  // previous_token at encode and decode); the block then names the state's version.
  kTokenMean = 6,
  // Learned, cross-layer (FAST profile only): kTokenMean plus the state's ridge-fitted linear
  // prediction of the plane's residual from the two planes before it in the block, as decoded
  // (PredictorState::PredictLinear; needs a state with HasLinear(plane)). codec/FORMAT.md.
  kTokenMeanLinear = 7,
};
inline constexpr int kNumPredictors = 8;
absl::string_view PredictorName(Predictor predictor);
// Bit mask of every predictor, for EncodeOptions::predictors.
inline constexpr uint32_t kAllPredictors = (1u << kNumPredictors) - 1;

// Quantizer step groups of the residual encoding (EncodeOptions::step_groups).
enum class StepGroups : uint8_t {
  kPlane = 0,  // one step per (layer, K/V) plane (times the surprisal token scale, if any)
  // The plane step times a per-group scale 2^(c / 2), c in [-8, 7] (coded in the payload): keys
  // per (head, channel), values per (head, token), each group's step in proportion to its
  // residual RMS (KIVI's grouping, entropy coded). Measured on tests/data (codec_bench
  // --step_groups): +0.35 to +0.45 bits per component at every target 0.02-0.3, and a larger
  // attention error, so kPlane stays the default.
  kChannelKeysTokenValues = 1,
};

// Which coder a kResidual or kLossless block uses. The values are the envelope's flags bit 0, NOT
// kvtrie.v1.EncodingSpec.Profile's (PROFILE_FAST = 1, PROFILE_COMPACT = 2): map them by name, as
// server/put_call.cc and client/put_encode.cc do (issue 34).
enum class Profile : uint8_t {
  // kResidual: adaptive context-modelled rANS, predictors incl. the parent (residual_codec.h);
  // kLossless: context-modelled half words (lossless.h). Smallest.
  kCompact = 0,
  // kResidual: static tables, 32 interleaved rANS lanes, no parent predictor (fast_residual.h);
  // kLossless: high byte plane + zstd, low bytes as is (fast_lossless.h). Built for GB/s.
  kFast = 1,
};

// What EncodeOptions::target_rel_rms is relative to for keys (values: always their energy).
// Keys carry a large per-channel offset (80-94 % of their energy on stories260K), so a key plane at
// "rel RMS 0.173" of its raw energy is about 0.5 of its content around the offset: measured
// (bench/learned.md, learned_nll_bench), today's predictors at 0.173 cost +4.3 % ΔNLL, mostly from
// keys. With the learned state the prediction removes the offset and the content the tokens
// explain, and the same raw-energy target costs +0.3 % ΔNLL at 25x smaller than fp16; kRaw stays
// the default (old blocks and callers keep their meaning), and kMeanRemoved is the definition that
// tracks ΔNLL when no state is at hand.
enum class KeyError : uint8_t {
  kRaw = 0,  // ||K - K'|| / ||K||, per (layer) plane
  // ||K - K'|| / ||K - mean||, mean per (head, channel) over the block's tokens. FAST profile only
  // (the compact profile answers INVALID_ARGUMENT naming `key_error`).
  kMeanRemoved = 1,
};

struct EncodeOptions {
  Encoding encoding = Encoding::kLossless;
  // kResidual / kLossless: the coder (Profile). kFast ignores the parent and reference contexts.
  Profile profile = Profile::kCompact;
  // kResidual: target relative RMS error ||x - x'|| / ||x|| per (layer, K/V), e.g. 0.05, measured
  // on the decoded block in the model dtype. Met exactly or better (smaller).
  double target_rel_rms = 0.0;
  // kResidual: bits budget, 0 = none. With a budget, the step is the larger (cheaper) of the one
  // meeting target_rel_rms and the one meeting the budget (the budget wins); at least one of the
  // two must be set. Counts the whole encoded block, envelope included.
  double target_bits_per_component = 0.0;
  // kResidual: predictors the encoder may choose from (bit 1 << Predictor). A predictor is also
  // only eligible when its context is present (parent, reference, external).
  uint32_t predictors = kAllPredictors;
  // kResidual: randomized Hadamard rotation of each head vector before prediction (head_dim must be
  // a power of two, else INVALID_ARGUMENT). kTurboQuant always rotates.
  bool rotate = false;
  uint32_t rotation_seed = 0x6b767472;  // "kvtr"
  // kResidual: surprisal-adaptive quantization. 0 = off. With strength a > 0 and per-token
  // surprisal s_t in the context, token t's step is scaled by 2^(-a * log2((s_t + 1) / (mean + 1)))
  // rounded to quarter powers of two in [2^-3, 2^3]: surprising tokens get a finer step.
  // Measured on held-out text (bench/paper.md, section 4): strength 0.5-2 costs +13 % to +92 %
  // bits at the same target and lowers ΔNLL at matched bits by no more than its noise, so 0 (off)
  // stays the default.
  double surprisal_step_strength = 0.0;
  // kResidual with a kCentroid prediction: the centroid's node id, written to the header.
  // kLossless: when set and PredictionContext::reference is present, the block is coded bit-exact
  // as the difference from the reference (centroid_lossless.h) and the id is written to the header.
  uint64_t reference_node_id = 0;
  // kResidual (compact) / kLossless against a reference: predict from the reference window at a
  // position offset (reference_shift.h; needs PredictionContext::reference_parent when
  // token_shift > 0). Written to the params only when the reference is used. INVALID_ARGUMENT
  // for another encoding or profile, or without reference_node_id and the reference.
  ReferenceShift reference_shift = {};
  // kTurboQuant: bits per component of the codebook, 1..8.
  int turboquant_bits = 3;
  // kResidual: how the quantizer step is shared (StepGroups). Every (layer, K/V) plane meets
  // target_rel_rms either way.
  StepGroups step_groups = StepGroups::kPlane;
  // kResidual: what target_rel_rms means for keys (KeyError). EncodedBlock::rel_rms_error_k
  // always reports the raw-energy error.
  KeyError key_error = KeyError::kRaw;
  // kResidual FAST with a learned state that has KLT bases (PredictorState::Klt): the encoder may
  // code a plane's learned heads in the basis (chosen per plane by its cost model; FORMAT.md).
  bool klt = true;
  // kLossless FAST with PredictionContext::learned: also try coding every element against the
  // learned prediction (params 5, codec/fast_lossless_learned.h: ~1.56x fp16 / 2.0x bf16 on
  // held-out text vs 1.12x / 1.42x) and keep it when smaller. Off by default: it encodes at
  // ~0.1-0.3 GB/s per core against ~2 GB/s (bench/lossless.md). Decoding needs no option.
  bool learned_lossless = false;
  // Every encoding: write the content checksum (envelope flags bit 2: XXH3-64 of what DecodeBlock
  // returns, checked by every decoder) and, for a block coded against a learned state, the
  // state's fingerprint (flags bit 3). Off only to write blocks as decoders before them read them.
  bool content_checksum = true;
};

// What the codec may need besides the encoded bytes. Spans are empty when absent. Blocks are in the
// model dtype and the same geometry as the block coded.
struct PredictionContext {
  // The reconstructed parent block (kParent predicts the first token from its last token).
  absl::Span<const uint8_t> parent;
  // The reconstructed reference (centroid) block named in the header (kCentroid).
  absl::Span<const uint8_t> reference;
  // The reconstructed parent of the reference block (the first tokens of a shifted reference
  // window, reference_shift.h; BlockHeader::reference_shift.reference_parent_node_id names it).
  absl::Span<const uint8_t> reference_parent = {};
  // A caller-supplied prediction of this block (kExternal), e.g. the paper's top-k expected KV.
  // The server cannot compute it: decoding a block that used it without it is FAILED_PRECONDITION.
  absl::Span<const uint8_t> external;
  // Encoder only: per-token surprisal in bits (block_tokens values) for surprisal_step_strength.
  absl::Span<const float> surprisal_bits;
  // The learned predictor state of the block's (namespace, model) (codec/predictor_state.h), null
  // when there is none. The encoder may code against it; the block then names learned->version()
  // (BlockHeader::predictor_version) and decoding it needs that same state, else
  // FAILED_PRECONDITION naming the version. Learned predictors also need the three fields below.
  const PredictorState* learned = nullptr;
  // The block's token ids (block_tokens values), the absolute position of tokens[0] in its prefix
  // (block index * block_tokens; RoPE angles), and the token before tokens[0] (-1 at the start).
  absl::Span<const int32_t> tokens;
  uint32_t first_position = 0;
  int32_t previous_token = -1;
};

// The result of encoding one block.
struct EncodedBlock {
  std::string bytes;              // the self-describing encoded block
  double bits_per_component = 0;  // 8 * bytes.size() / geometry.num_elements()
  // ||K - K'|| / ||K|| over the whole block (every layer's K plane together; raw energy, whatever
  // key_error says); 0 when lossless. The root of the energy-weighted mean of the planes' squared
  // errors, so <= the largest plane's: kResidual meets target_rel_rms on every (layer, K/V) plane.
  double rel_rms_error_k = 0;
  double rel_rms_error_v = 0;  // same for V
  double max_abs_error = 0;    // max |x - x'| over the block
  // kResidual: how many (layer, head) groups chose each Predictor, [0 = K, 1 = V][Predictor].
  uint32_t predictor_count[2][kNumPredictors] = {};
  // The learned state the block is coded against (BlockHeader::predictor_version; 0 = none).
  uint32_t predictor_version = 0;
  // What the learned predictors bought (FAST kResidual with a state; 0 otherwise): the bytes the
  // block would have cost with the best non-learned predictor per head minus what it costs with
  // the chosen ones, from the encoder's cost model at each plane's first step (an estimate: the
  // block is not encoded twice). Bytes, >= 0.
  double learned_bytes_saved = 0;
};

// The parsed envelope of an encoded block; views point into the encoded bytes.
struct BlockHeader {
  uint32_t format_version = 0;
  Encoding encoding = Encoding::kRaw;
  Profile profile = Profile::kCompact;  // flags bit 0
  BlockGeometry geometry;
  uint64_t reference_node_id = 0;
  // Flags bit 7: the reference is used at a position offset (reference_shift.h); `params` below
  // is what follows its prefix.
  ReferenceShift reference_shift;
  // The learned predictor state the block was coded against (codec/predictor_state.h); 0 = none.
  uint32_t predictor_version = 0;
  // Flags bit 3: PredictorState::fingerprint() of that state; 0 = the block does not name it.
  uint64_t predictor_fingerprint = 0;
  // Flags bit 2: XXH3-64 of the decoded block (DecodeBlock checks it).
  bool has_content_checksum = false;
  uint64_t content_checksum = 0;
  absl::string_view params;
  absl::string_view payload;
};

// Parses and checks the envelope (magic, version, lengths, CRC-32C). Errors: DATA_LOSS.
absl::StatusOr<BlockHeader> ParseBlock(absl::string_view encoded);
// As ParseBlock without the CRC-32C pass, for bytes whose checksum was already verified and that
// have not left memory since (a store's hot payload): every length is still checked.
absl::StatusOr<BlockHeader> ParseVerifiedBlock(absl::string_view encoded);

// The predictor version the envelope's flags bit 1 names (the u32 at offset 24), read without
// checking anything else (no magic, lengths or CRC-32C: ParseBlock and DecodeBlock check those);
// 0 when the block names none or is too short to hold one.
uint32_t PeekPredictorVersion(absl::string_view encoded);

namespace internal {
// Builds the envelope around `params` and `payload`.
std::string WriteEnvelope(Encoding encoding, const BlockGeometry& geometry,
                          uint64_t reference_node_id, absl::string_view params,
                          absl::string_view payload, Profile profile = Profile::kCompact,
                          uint32_t predictor_version = 0, const ReferenceShift* shift = nullptr);
// Returns `encoded` (a well-formed envelope without flags bits 2 and 3) with the optional fields
// added: the state fingerprint (if `fingerprint` != 0 and the block names a version) and the
// content checksum (if `content_checksum` is set); the CRC-32C is recomputed.
std::string AddEnvelopeChecks(absl::string_view encoded, uint64_t fingerprint,
                              const uint64_t* content_checksum);
// XXH3-64 (seed 0) of a decoded block: the envelope's content checksum.
uint64_t ContentChecksum(absl::Span<const uint8_t> block);
}  // namespace internal

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_ENVELOPE_H_
