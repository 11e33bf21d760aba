// kvtrie::Client's Puts (client/client.h): dense or encoded here (client/put_encode.h) against
// the latest learned predictor state, sent again against the new latest when the server answers
// that the state is gone (STALE_PREDICTOR_VERSION, client/status_reason.h); and OpenPut.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/client_internal.h"
#include "client/put_encode.h"
#include "client/put_stream.h"
#include "codec/block_codec.h"
#include "codec/kv_layout.h"

namespace kvtrie {
namespace {

using client_internal::CheckNames;
using client_internal::FromGrpc;

// Token ids (and as many surprisal values) per Put message: 128K x 8 bytes = 1 MiB.
constexpr size_t kTokensPerMessage = 128 * 1024;

// Ends a Put's writes: the PutCommit while the stream is `open`, then the server's status.
absl::Status CommitPut(grpc::ClientWriter<v1::PutRequest>* writer, bool open) {
  if (open) {
    v1::PutRequest commit;
    commit.mutable_commit();
    writer->Write(commit);
  }
  writer->WritesDone();
  return FromGrpc(writer->Finish());
}

// The first messages of a Put stream: a header (namespace, model spec, encoding and the first
// kTokensPerMessage token ids and surprisal values), then PutTokens messages with the rest, so
// no message passes gRPC's default 4 MiB limit (1M tokens with surprisal: 8 MB).
std::vector<v1::PutRequest> PutHeaderRequests(const std::string& ns, const KvDump& kv,
                                              const BlockGeometry& g, const PutOptions& options) {
  const auto chunk = [&](const auto& values, size_t begin) {
    const size_t end = std::min(values.size(), begin + kTokensPerMessage);
    return std::make_pair(values.begin() + static_cast<ptrdiff_t>(std::min(begin, end)),
                          values.begin() + static_cast<ptrdiff_t>(end));
  };
  std::vector<v1::PutRequest> out(1);
  v1::PutHeader* h = out[0].mutable_header();
  h->set_namespace_(ns);
  v1::ModelSpec* m = h->mutable_model();
  m->set_model_id(kv.model_id);
  m->set_num_layers(g.num_layers);
  m->set_num_kv_heads(g.num_kv_heads);
  m->set_head_dim(g.head_dim);
  m->set_dtype(static_cast<v1::DType>(g.dtype));
  m->set_block_tokens(g.block_tokens);
  h->mutable_encoding()->set_encoding(options.encoding);
  h->mutable_encoding()->set_target_rel_rms(options.target_rel_rms);
  h->mutable_encoding()->set_profile(options.profile);
  h->mutable_encoding()->set_bits(options.bits);
  h->mutable_encoding()->set_learned_lossless(options.learned_lossless);
  for (size_t begin = 0;
       begin == 0 || begin < kv.token_ids.size() || begin < kv.surprisal_bits.size();
       begin += kTokensPerMessage) {
    if (begin > 0) out.emplace_back();
    // Token ids packed little-endian (token_ids_packed): no varint encoding on either side.
    std::string* ids = begin == 0 ? h->mutable_token_ids_packed()
                                  : out.back().mutable_tokens()->mutable_token_ids_packed();
    auto* bits = begin == 0 ? h->mutable_surprisal_bits()
                            : out.back().mutable_tokens()->mutable_surprisal_bits();
    auto [tb, te] = chunk(kv.token_ids, begin);
    ids->resize(static_cast<size_t>(te - tb) * 4);
    for (auto it = tb; it != te; ++it) {
      const uint32_t id = *it;
      const size_t at = static_cast<size_t>(it - tb) * 4;
      for (int byte = 0; byte < 4; ++byte) (*ids)[at + byte] = static_cast<char>(id >> (8 * byte));
    }
    auto [sb, se] = chunk(kv.surprisal_bits, begin);
    bits->Add(sb, se);
  }
  return out;
}

}  // namespace

absl::StatusOr<v1::PutResponse> Client::Put(const KvDump& kv, const PutOptions& options) {
  const BlockGeometry g{kv.num_layers, kv.num_kv_heads, options.block_tokens, kv.head_dim,
                        kv.dtype};
  if (auto s = g.Validate(); !s.ok()) return s;
  if (auto s = CheckNames(options_.ns, kv.model_id); !s.ok()) return s;
  const size_t seq_bytes =
      g.num_layers * g.num_kv_heads * kv.num_tokens() * g.head_dim * DTypeBytes(g.dtype);
  if (kv.k.size() != seq_bytes || kv.v.size() != seq_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv: k has ", kv.k.size(), " and v ", kv.v.size(), " bytes; ", kv.num_tokens(),
                     " tokens of ", g.DebugString(), " need ", seq_bytes, " each"));
  }
  // Encoded when the client can code the request (PutOptions::encode_on_client); the header
  // then names the encoding and the fast profile, so the server's defaults do not matter.
  PutOptions encoded = options;
  if (encoded.encoding == v1::ENCODING_UNSPECIFIED) {
    absl::MutexLock lock(&default_encoding_mu_);
    if (absl::Now() - default_encoding_at_ < kDefaultEncodingTtl) {
      encoded.encoding = default_encoding_;
    }
  }
  if (IsByteDType(g.dtype) && options.encoding == v1::ENCODING_UNSPECIFIED) {
    // FP8 / uint8 blocks: the server stores an unnamed encoding LOSSLESS whatever its default.
    encoded.encoding = v1::ENCODING_LOSSLESS;
  }
  const bool encode = options.encode_on_client && encoded.encoding != v1::ENCODING_UNSPECIFIED &&
                      CheckClientEncoding(encoded).ok();
  encoded.profile = v1::EncodingSpec::PROFILE_FAST;
  for (int attempt = 1;; ++attempt) {
    absl::StatusOr<v1::PutResponse> r = PutOnce(kv, g, encode ? encoded : options, encode);
    if (r.ok() && !encode && options.encoding == v1::ENCODING_UNSPECIFIED &&
        !IsByteDType(g.dtype)) {
      // The encoding the server stored a new block in is its default: later Puts encode it here.
      for (const v1::BlockResult& b : r->blocks()) {
        if (b.disposition() != v1::BLOCK_STORED || b.encoding() == v1::ENCODING_UNSPECIFIED) {
          continue;
        }
        absl::MutexLock lock(&default_encoding_mu_);
        default_encoding_ = b.encoding();
        default_encoding_at_ = absl::Now();
        break;
      }
    }
    if (r.ok() || !RetryablePutCode(r.status().code()) || attempt >= options_.retry.max_attempts) {
      return r;
    }
    absl::SleepFor(RetryBackoff(options_.retry, attempt));
  }
}

absl::StatusOr<v1::PutResponse> Client::PutOnce(const KvDump& kv, const BlockGeometry& g,
                                                const PutOptions& options, bool encode) {
  if (encode) {
    absl::StatusOr<v1::PutResponse> r = PutEncoded(kv, g, options);
    if (!IsStalePredictorVersion(r.status())) return r;
    // The state it was coded against is gone (freed after a newer one): ask for the latest again
    // and encode against it.
    if (absl::StatusOr<std::shared_ptr<const PredictorState>> latest =
            LatestPredictor(kv.model_id, /*refresh=*/true);
        !latest.ok()) {
      return latest.status();
    }
    return PutEncoded(kv, g, options);
  }
  auto ctx = NewContext();
  v1::PutResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer(stub_->Put(ctx.get(), &resp));
  std::vector<v1::PutRequest> header = PutHeaderRequests(options_.ns, kv, g, options);
  bool open = true;
  for (const v1::PutRequest& m : header) open = open && writer->Write(m);
  v1::PutRequest req;
  std::vector<uint8_t> block(g.num_bytes());
  const uint32_t per_msg = options.layers_per_message ? options.layers_per_message : g.num_layers;
  const size_t blocks = kv.num_tokens() / g.block_tokens;
  for (size_t b = options.first_block; open && b < blocks; ++b) {
    GatherBlock(g, kv.num_tokens(), kv.k.data(), kv.v.data(), b, absl::MakeSpan(block));
    for (uint32_t l = 0; open && l < g.num_layers; l += per_msg) {
      const uint32_t end = std::min(g.num_layers, l + per_msg);
      req.Clear();
      v1::PutBlock* pb = req.mutable_block();
      pb->set_block_index(static_cast<uint32_t>(b));
      pb->set_layer_begin(l);
      pb->set_layer_end(end);
      pb->set_kv(block.data() + g.layer_range_bytes(0, l), g.layer_range_bytes(l, end));
      open = writer->Write(req);
    }
  }
  if (auto s = CommitPut(writer.get(), open); !s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::PutResponse> Client::PutEncoded(const KvDump& kv, const BlockGeometry& g,
                                                   const PutOptions& options) {
  std::shared_ptr<const PredictorState> state;
  if (options.encoding == v1::ENCODING_RESIDUAL ||
      (options.encoding == v1::ENCODING_LOSSLESS && options.learned_lossless)) {
    absl::StatusOr<std::shared_ptr<const PredictorState>> latest =
        LatestPredictor(kv.model_id, /*refresh=*/false);
    if (!latest.ok()) return latest.status();
    state = *std::move(latest);
  }
  auto ctx = NewContext();
  v1::PutResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer(stub_->Put(ctx.get(), &resp));
  bool open = true;
  for (const v1::PutRequest& m : PutHeaderRequests(options_.ns, kv, g, options)) {
    open = open && writer->Write(m);
  }
  v1::PutRequest req;
  // Windows of blocks encoded on codec_threads, then sent in order.
  const size_t window = codec_pool_ ? 4 * static_cast<size_t>(codec_pool_->threads()) : 1;
  std::vector<absl::StatusOr<EncodedBlock>> encoded(window);
  std::vector<std::vector<uint8_t>> scratch(window);
  const size_t blocks = kv.num_tokens() / g.block_tokens;
  for (size_t first = options.first_block; open && first < blocks; first += window) {
    const size_t n = std::min(window, blocks - first);
    const auto encode = [&](size_t i) {
      encoded[i] = EncodePutBlock(kv, g, first + i, options, state.get(), &scratch[i]);
    };
    if (codec_pool_ != nullptr) {
      codec_pool_->ParallelFor(n, encode);
    } else {
      for (size_t i = 0; i < n; ++i) encode(i);
    }
    for (size_t i = 0; open && i < n; ++i) {
      const size_t b = first + i;
      absl::StatusOr<EncodedBlock>& e = encoded[i];
      if (!e.ok()) {
        ctx->TryCancel();  // no PutCommit: nothing is stored
        writer->Finish();
        return absl::Status(e.status().code(),
                            absl::StrCat("kv: block ", b, ": ", e.status().message()));
      }
      req.Clear();
      v1::PutBlock* pb = req.mutable_block();
      pb->set_block_index(static_cast<uint32_t>(b));
      pb->set_encoded(std::move(e->bytes));
      pb->set_rel_rms_error_k(e->rel_rms_error_k);
      pb->set_rel_rms_error_v(e->rel_rms_error_v);
      pb->set_max_abs_error(e->max_abs_error);
      open = writer->Write(req);
    }
  }
  if (auto s = CommitPut(writer.get(), open); !s.ok()) return s;
  return resp;
}

absl::StatusOr<std::shared_ptr<const PredictorState>> Client::LatestPredictor(
    const std::string& model_id, bool refresh) {
  uint32_t version = 0;
  bool known = false;
  {
    absl::MutexLock lock(&predictors_mu_);
    if (auto it = latest_predictor_.find(model_id);
        it != latest_predictor_.end() && !refresh &&
        absl::Now() - it->second.second < options_.predictor_refresh) {
      version = it->second.first;
      known = true;
    }
  }
  if (!known) {
    absl::StatusOr<v1::InspectResponse> root = Inspect(model_id, 0);
    if (!root.ok() && !absl::IsNotFound(root.status())) return root.status();
    for (int i = 0; root.ok() && i < root->predictors_size(); ++i) {
      if (root->predictors(i).latest()) version = root->predictors(i).version();
    }
    absl::MutexLock lock(&predictors_mu_);
    latest_predictor_[model_id] = {version, absl::Now()};
  }
  if (version == 0) return std::shared_ptr<const PredictorState>();
  return GetPredictor(model_id, version);
}

absl::StatusOr<std::unique_ptr<PutStream>> Client::OpenPut(const KvDump& header,
                                                           const PutOptions& options) {
  const BlockGeometry g{header.num_layers, header.num_kv_heads, options.block_tokens,
                        header.head_dim, header.dtype};
  if (auto s = g.Validate(); !s.ok()) return s;
  if (!header.surprisal_bits.empty() && header.surprisal_bits.size() != header.num_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("surprisal_bits: ", header.surprisal_bits.size(),
                                                   " values for ", header.num_tokens(),
                                                   " tokens (give one per token or none)"));
  }
  return std::unique_ptr<PutStream>(
      new PutStream(this, PutHeaderRequests(options_.ns, header, g, options), g,
                    options.first_block, options.layers_per_message));
}

}  // namespace kvtrie
