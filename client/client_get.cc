// kvtrie::Client's Gets (client/client.h): the stored blocks as sent (the zero-copy framing of
// client/get_wire.h), decoded here when RECONSTRUCTED asks for it (client/residual_chain.h, on
// the client's codec pool), with the learned predictor states they need (GetPredictor, cached).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/client_internal.h"
#include "client/get_wire.h"
#include "client/packed_tokens.h"
#include "client/residual_chain.h"
#include "codec/block_codec.h"
#include "codec/crc32c.h"
#include "codec/kv_layout.h"

namespace kvtrie {
namespace {

using client_internal::CheckNames;
using client_internal::FromGrpc;

BlockGeometry GeometryOf(const v1::ModelSpec& m) {
  return {m.num_layers(), m.num_kv_heads(), m.block_tokens() ? m.block_tokens() : 16, m.head_dim(),
          static_cast<DType>(m.dtype())};
}

}  // namespace

absl::StatusOr<std::vector<uint8_t>> Client::ReferenceBlock(const std::string& model_id,
                                                            uint64_t node_id,
                                                            const BlockGeometry& g) {
  v1::GetRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  req.set_node_id(node_id);
  req.set_mode(v1::GET_MODE_RECONSTRUCTED);
  auto ctx = NewContext();
  std::unique_ptr<grpc::ClientReader<v1::GetResponse>> reader(stub_->Get(ctx.get(), req));
  v1::GetResponse msg;
  std::vector<uint8_t> block(g.num_bytes());
  uint32_t last = 0, layers = 0;
  if (reader->Read(&msg) && msg.has_header()) last = msg.header().matched_blocks();
  while (reader->Read(&msg)) {
    if (!msg.has_block() || last == 0 || msg.block().block_index() != last - 1) continue;
    const v1::GetBlock& b = msg.block();
    if (b.layer_begin() >= b.layer_end() || b.layer_end() > g.num_layers ||
        b.kv().size() != g.layer_range_bytes(b.layer_begin(), b.layer_end())) {
      ctx->TryCancel();
      reader->Finish();
      return absl::DataLossError(absl::StrCat("get: centroid ", node_id, ": malformed block"));
    }
    std::copy(b.kv().begin(), b.kv().end(),
              block.begin() + static_cast<ptrdiff_t>(g.layer_range_bytes(0, b.layer_begin())));
    layers += b.layer_end() - b.layer_begin();
  }
  if (auto s = FromGrpc(reader->Finish()); !s.ok()) return s;
  if (last == 0 || layers != g.num_layers) {
    return absl::NotFoundError(absl::StrCat("get: centroid node ", node_id, " is not stored"));
  }
  return block;
}

absl::StatusOr<KvDump> Client::Get(const std::string& model_id,
                                   absl::Span<const uint32_t> token_ids,
                                   const GetOptions& options) {
  KvDump out;
  if (absl::Status s = GetInto(model_id, token_ids, options, &out); !s.ok()) return s;
  return out;
}

absl::Status Client::GetInto(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                             const GetOptions& options, KvDump* out_dump) {
  if (auto s = CheckNames(options_.ns, model_id); !s.ok()) return s;
  if (options.mode == v1::GET_MODE_RESIDUAL &&
      (options.layer_begin != 0 || options.layer_end != 0)) {
    return absl::InvalidArgumentError(
        "layer_begin: a layer range needs GET_MODE_RECONSTRUCTED (a RESIDUAL block is one whole "
        "encoding)");
  }
  // A Get changes nothing, so it is sent again after UNAVAILABLE and after ABORTED: the server's
  // (its blocks were deleted while it streamed them) and this client's (a centroid or learned
  // state that a RESIDUAL block names was deleted after the Get listed it; the server re-encoded
  // the block first, so a new Get reads it standalone).
  // After DATA_LOSS from the server, once more at once: the block is gone by then.
  bool resent_after_data_loss = false;
  for (int attempt = 1;; ++attempt) {
    bool server_data_loss = false;
    absl::Status s = GetOnce(model_id, token_ids, options, out_dump, &server_data_loss);
    if (server_data_loss && !resent_after_data_loss) {
      resent_after_data_loss = true;
      --attempt;
      continue;
    }
    if (s.ok() || !(RetryableReadCode(s.code()) || absl::IsAborted(s)) ||
        attempt >= options_.retry.max_attempts) {
      return s;
    }
    absl::SleepFor(RetryBackoff(options_.retry, attempt));
  }
}

absl::Status Client::GetOnce(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                             const GetOptions& options, KvDump* out_dump, bool* server_data_loss) {
  v1::GetRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  if (options_.packed_token_ids) {
    PackTokens(token_ids, req.mutable_token_ids_packed());
  } else {
    req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  }
  req.set_mode(options.mode);
  req.set_max_blocks(options.max_blocks);
  req.set_layer_begin(options.layer_begin);
  req.set_layer_end(options.layer_end);
  auto ctx = NewContext();
  // The responses as gRPC received them: kv is scattered from the slices (client/get_wire.h).
  const grpc::internal::RpcMethod method("/kvtrie.v1.KVCache/Get",
                                         grpc::internal::RpcMethod::SERVER_STREAMING);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel_.get(), method,
                                                                    ctx.get(), req));
  v1::GetResponse msg;
  grpc::ByteBuffer buffer;
  std::vector<grpc::Slice> slices;
  std::vector<absl::Span<const uint8_t>> kv;
  bool parse_failed = false;
  auto read = [&] {
    if (!reader->Read(&buffer)) return false;
    slices.clear();
    if (!buffer.Dump(&slices).ok() || !ParseGetResponse(slices, &msg, &kv)) {
      parse_failed = true;
      return false;
    }
    return true;
  };
  KvDump& out = *out_dump;
  out.model_id = model_id;
  out.token_ids.clear();
  BlockGeometry g;
  size_t tokens = 0;
  std::vector<uint8_t> block;
  std::unique_ptr<ResidualChain> chain;  // RESIDUAL mode: decodes the blocks (fast: in parallel)
  std::vector<uint32_t> layers_seen;     // per block: layers received
  auto bad = [&](std::string what) {
    ctx->TryCancel();
    reader->Finish();
    return absl::DataLossError(absl::StrCat("get: ", what));
  };
  if (!read() || !msg.has_header()) {
    if (parse_failed) return bad("a message that does not parse");
    if (auto s = FromGrpc(reader->Finish()); !s.ok()) {
      *server_data_loss = absl::IsDataLoss(s);
      return s;
    }
    return absl::DataLossError("get: the stream did not start with a header");
  }
  size_t seq_bytes = 0;
  // The layers requested: [lb, le) of the model's (all of them by default).
  uint32_t lb = 0, le = 0;
  BlockGeometry rg;  // the range's geometry: num_layers = le - lb (the result's layers)
  if (msg.header().matched_blocks() > 0) {
    g = GeometryOf(msg.header().model());
    if (auto s = g.Validate(); !s.ok()) return bad(absl::StrCat("header: ", s.message()));
    tokens = static_cast<size_t>(msg.header().matched_blocks()) * g.block_tokens;
    if (tokens > token_ids.size()) return bad("header: matched more tokens than asked for");
    lb = options.layer_begin;
    le = options.layer_end != 0 ? options.layer_end : g.num_layers;
    if (lb >= le || le > g.num_layers) return bad("the server ignored the layer range");
    rg = g;
    rg.num_layers = le - lb;
    out.num_layers = rg.num_layers;
    out.num_kv_heads = g.num_kv_heads;
    out.head_dim = g.head_dim;
    out.dtype = g.dtype;
    out.token_ids.assign(token_ids.begin(), token_ids.begin() + static_cast<ptrdiff_t>(tokens));
    seq_bytes = rg.num_layers * g.num_kv_heads * tokens * g.head_dim * DTypeBytes(g.dtype);
    block.resize(g.num_bytes());
    layers_seen.assign(msg.header().matched_blocks(), 0);
    // What a block names and is gone now was deleted after the server listed the block (which
    // it re-encoded first): ABORTED, and GetInto lists again.
    const auto listed_then_deleted = [](absl::Status s) {
      if (!absl::IsNotFound(s)) return s;
      return absl::AbortedError(
          absl::StrCat(s.message(), " (deleted after this Get listed it; get again)"));
    };
    chain = std::make_unique<ResidualChain>(
        g,
        [&, listed_then_deleted](uint64_t node_id) -> absl::StatusOr<std::vector<uint8_t>> {
          absl::StatusOr<std::vector<uint8_t>> block = ReferenceBlock(model_id, node_id, g);
          if (!block.ok()) return listed_then_deleted(block.status());
          return block;
        },
        [&, listed_then_deleted](
            uint32_t version) -> absl::StatusOr<std::shared_ptr<const PredictorState>> {
          absl::StatusOr<std::shared_ptr<const PredictorState>> state =
              GetPredictor(model_id, version);
          if (!state.ok()) return listed_then_deleted(state.status());
          return state;
        });
  }
  out.k.resize(seq_bytes);  // the same size again (GetInto into a reused dump) writes nothing
  out.v.resize(seq_bytes);
  // RESIDUAL with codec threads: a window of encoded blocks is decoded at once (in parallel where
  // the blocks decode alone: every fast one, learned or not), each scattered by the thread that
  // decoded it.
  const size_t window = codec_pool_ ? 4 * static_cast<size_t>(codec_pool_->threads()) : 1;
  std::vector<std::string> pending_encoded(window);
  std::vector<uint32_t> pending_index;
  std::vector<uint64_t> pending_ref;
  std::vector<uint32_t> pending_version;
  std::vector<std::vector<uint8_t>> decoded;
  auto flush = [&]() -> absl::Status {
    if (pending_index.empty()) return absl::OkStatus();
    decoded.resize(pending_index.size());
    std::vector<absl::string_view> enc;
    std::vector<absl::Span<uint8_t>> outs;
    for (size_t i = 0; i < pending_index.size(); ++i) {
      decoded[i].resize(g.num_bytes());
      enc.push_back(pending_encoded[i]);
      outs.push_back(absl::MakeSpan(decoded[i]));
    }
    absl::Status s = chain->DecodeMany(pending_index, pending_ref, pending_version, out.token_ids,
                                       enc, outs, codec_pool_.get(), [&](size_t i) {
                                         ScatterBlock(g, tokens, decoded[i], pending_index[i],
                                                      out.k.data(), out.v.data());
                                       });
    for (uint32_t i : pending_index) layers_seen[i] = g.num_layers;
    pending_index.clear();
    pending_ref.clear();
    pending_version.clear();
    return s;
  };
  while (read()) {
    if (!msg.has_block()) return bad("a second header");
    const v1::GetBlock& b = msg.block();
    if (b.block_index() >= layers_seen.size()) return bad("block_index past the match");
    if (!b.encoded().empty()) {  // RESIDUAL: decode here (client -> codec)
      if (codec_pool_ != nullptr) {
        pending_encoded[pending_index.size()].swap(*msg.mutable_block()->mutable_encoded());
        pending_index.push_back(b.block_index());
        pending_ref.push_back(b.reference_node_id());
        pending_version.push_back(b.predictor_version());
        if (pending_index.size() < window) continue;
        if (absl::Status s = flush(); !s.ok()) {
          ctx->TryCancel();
          reader->Finish();
          return s;
        }
        continue;
      }
      const size_t first = static_cast<size_t>(b.block_index()) * g.block_tokens;
      const absl::Span<const uint32_t> block_tokens =
          absl::MakeConstSpan(out.token_ids).subspan(first, g.block_tokens);
      if (absl::Status s =
              chain->Decode(b.block_index(), b.reference_node_id(), b.predictor_version(),
                            block_tokens, b.encoded(), absl::MakeSpan(block));
          !s.ok()) {
        ctx->TryCancel();
        reader->Finish();
        return s;
      }
      layers_seen[b.block_index()] = g.num_layers;
      ScatterBlock(g, tokens, block, b.block_index(), out.k.data(), out.v.data());
      continue;
    }
    if (!pending_index.empty()) return bad("a RECONSTRUCTED block among RESIDUAL ones");
    const uint32_t end = b.layer_end();
    size_t kv_bytes = 0;
    for (auto piece : kv) kv_bytes += piece.size();
    if (b.layer_begin() >= end || b.layer_begin() < lb || end > le ||
        kv_bytes != g.layer_range_bytes(b.layer_begin(), end)) {
      return bad(absl::StrCat("block ", b.block_index(), ": malformed layer range"));
    }
    // Straight from the received slices into the sequence layout: the one copy of the bytes.
    ScatterLayerPieces(rg, tokens, b.layer_begin() - lb, end - lb, kv, b.block_index(),
                       out.k.data(), out.v.data());
    layers_seen[b.block_index()] += end - b.layer_begin();
  }
  if (parse_failed) return bad("a message that does not parse");
  if (auto s = FromGrpc(reader->Finish()); !s.ok()) {
    *server_data_loss = absl::IsDataLoss(s);
    return s;
  }
  if (absl::Status s = flush(); !s.ok()) return s;
  for (size_t i = 0; i < layers_seen.size(); ++i) {
    if (layers_seen[i] != rg.num_layers) {
      return absl::DataLossError(absl::StrCat("get: block ", i, " arrived incomplete"));
    }
  }
  out.surprisal_bits.assign(out.token_ids.size(), 0.0f);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const PredictorState>> Client::GetPredictor(
    const std::string& model_id, uint32_t version) {
  if (auto s = CheckNames(options_.ns, model_id); !s.ok()) return s;
  const PredictorKey key(options_.ns, model_id, version);
  {
    absl::MutexLock lock(&predictors_mu_);
    if (auto it = predictors_.find(key); it != predictors_.end()) {
      it->second.first = ++predictor_uses_;
      return it->second.second;
    }
  }
  v1::GetPredictorRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  req.set_version(version);
  std::string bytes;
  uint64_t total = 0;
  uint32_t crc = 0;
  uint64_t fingerprint = 0;  // the first chunk's (0 from a server before it)
  bool first = true;
  if (absl::Status s = RetryRead([&]() -> absl::Status {
        bytes.clear();
        first = true;
        auto ctx = NewContext();
        std::unique_ptr<grpc::ClientReader<v1::PredictorChunk>> reader(
            stub_->GetPredictor(ctx.get(), req));
        v1::PredictorChunk chunk;
        while (reader->Read(&chunk)) {
          if (first) {
            total = chunk.total_bytes();
            crc = chunk.crc32c();
            fingerprint = chunk.fingerprint();
            first = false;
          }
          if (chunk.version() != version || chunk.total_bytes() != total || chunk.crc32c() != crc ||
              chunk.offset() != bytes.size() || bytes.size() + chunk.data().size() > total) {
            ctx->TryCancel();
            reader->Finish();
            return absl::DataLossError(absl::StrCat(
                "get_predictor: chunk at offset ", chunk.offset(), " does not continue the ",
                bytes.size(), " bytes received of version ", version));
          }
          bytes += chunk.data();
        }
        return FromGrpc(reader->Finish());
      });
      !s.ok()) {
    return s;
  }
  if (first || bytes.size() != total || Crc32c(bytes) != crc) {
    return absl::DataLossError(absl::StrCat("get_predictor: received ", bytes.size(), " of ", total,
                                            " bytes of version ", version,
                                            " or their CRC-32C differs"));
  }
  absl::StatusOr<std::shared_ptr<const PredictorState>> state = PredictorState::Parse(bytes);
  if (!state.ok()) return state.status();
  if ((*state)->version() != version) {
    return absl::DataLossError(absl::StrCat("get_predictor: asked for version ", version,
                                            ", got version ", (*state)->version()));
  }
  if (fingerprint != 0 && (*state)->fingerprint() != fingerprint) {
    return absl::DataLossError(absl::StrCat("get_predictor: version ", version, " has fingerprint ",
                                            absl::Hex(fingerprint), ", the bytes received ",
                                            absl::Hex((*state)->fingerprint())));
  }
  absl::MutexLock lock(&predictors_mu_);
  if (predictors_.size() >= kMaxCachedPredictors) {  // drop the least recently used
    auto oldest = predictors_.begin();
    for (auto it = predictors_.begin(); it != predictors_.end(); ++it) {
      if (it->second.first < oldest->second.first) oldest = it;
    }
    predictors_.erase(oldest);
  }
  predictors_[key] = {++predictor_uses_, *state};
  return *state;
}

}  // namespace kvtrie
