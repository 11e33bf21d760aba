#include "client/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/kv_layout.h"

namespace kvtrie {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

BlockGeometry GeometryOf(const v1::ModelSpec& m) {
  return {m.num_layers(), m.num_kv_heads(), m.block_tokens() ? m.block_tokens() : 16, m.head_dim(),
          static_cast<DType>(m.dtype())};
}

// The first message of a Put stream: namespace, model spec, tokens, surprisal, encoding.
v1::PutRequest PutHeaderRequest(const std::string& ns, const KvDump& kv, const BlockGeometry& g,
                                const PutOptions& options) {
  v1::PutRequest req;
  v1::PutHeader* h = req.mutable_header();
  h->set_namespace_(ns);
  v1::ModelSpec* m = h->mutable_model();
  m->set_model_id(kv.model_id);
  m->set_num_layers(g.num_layers);
  m->set_num_kv_heads(g.num_kv_heads);
  m->set_head_dim(g.head_dim);
  m->set_dtype(static_cast<v1::DType>(g.dtype));
  m->set_block_tokens(g.block_tokens);
  h->mutable_token_ids()->Add(kv.token_ids.begin(), kv.token_ids.end());
  h->mutable_surprisal_bits()->Add(kv.surprisal_bits.begin(), kv.surprisal_bits.end());
  h->mutable_encoding()->set_encoding(options.encoding);
  h->mutable_encoding()->set_target_rel_rms(options.target_rel_rms);
  h->mutable_encoding()->set_bits(options.bits);
  return req;
}

}  // namespace

std::unique_ptr<Client> Client::Create(const ClientOptions& options) {
  return std::unique_ptr<Client>(new Client(options));
}

Client::Client(const ClientOptions& options) : options_(options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  stub_ = v1::KVCache::NewStub(
      grpc::CreateCustomChannel(options.target, grpc::InsecureChannelCredentials(), args));
}

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

std::unique_ptr<grpc::ClientContext> Client::NewContext() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(options_.timeout));
  if (!options_.bearer_token.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + options_.bearer_token);
  }
  return ctx;
}

absl::StatusOr<v1::LookupResponse> Client::Lookup(const std::string& model_id,
                                                  absl::Span<const uint32_t> token_ids) {
  v1::LookupRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  v1::LookupResponse resp;
  auto ctx = NewContext();
  if (auto s = FromGrpc(stub_->Lookup(ctx.get(), req, &resp)); !s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::PutResponse> Client::Put(const KvDump& kv, const PutOptions& options) {
  const BlockGeometry g{kv.num_layers, kv.num_kv_heads, options.block_tokens, kv.head_dim,
                        kv.dtype};
  if (auto s = g.Validate(); !s.ok()) return s;
  const size_t seq_bytes =
      g.num_layers * g.num_kv_heads * kv.num_tokens() * g.head_dim * DTypeBytes(g.dtype);
  if (kv.k.size() != seq_bytes || kv.v.size() != seq_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv: k has ", kv.k.size(), " and v ", kv.v.size(), " bytes; ", kv.num_tokens(),
                     " tokens of ", g.DebugString(), " need ", seq_bytes, " each"));
  }
  auto ctx = NewContext();
  v1::PutResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer(stub_->Put(ctx.get(), &resp));
  v1::PutRequest req = PutHeaderRequest(options_.ns, kv, g, options);
  bool open = writer->Write(req);
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
  if (open) {
    req.Clear();
    req.mutable_commit();
    open = writer->Write(req);
  }
  writer->WritesDone();
  if (auto s = FromGrpc(writer->Finish()); !s.ok()) return s;
  return resp;
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
      new PutStream(stub_.get(), NewContext(), PutHeaderRequest(options_.ns, header, g, options), g,
                    options.first_block, options.layers_per_message));
}

absl::StatusOr<KvDump> Client::Get(const std::string& model_id,
                                   absl::Span<const uint32_t> token_ids,
                                   const GetOptions& options) {
  v1::GetRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  req.set_mode(options.mode);
  req.set_max_blocks(options.max_blocks);
  auto ctx = NewContext();
  std::unique_ptr<grpc::ClientReader<v1::GetResponse>> reader(stub_->Get(ctx.get(), req));
  v1::GetResponse msg;
  KvDump out;
  out.model_id = model_id;
  BlockGeometry g;
  size_t tokens = 0;
  std::vector<uint8_t> block, parent;
  std::map<uint64_t, std::vector<uint8_t>> references;  // centroid node id -> reconstruction
  std::vector<uint32_t> layers_seen;                    // per block: layers received
  auto bad = [&](std::string what) {
    ctx->TryCancel();
    reader->Finish();
    return absl::DataLossError(absl::StrCat("get: ", what));
  };
  if (!reader->Read(&msg) || !msg.has_header()) {
    if (auto s = FromGrpc(reader->Finish()); !s.ok()) return s;
    return absl::DataLossError("get: the stream did not start with a header");
  }
  if (msg.header().matched_blocks() > 0) {
    g = GeometryOf(msg.header().model());
    if (auto s = g.Validate(); !s.ok()) return bad(absl::StrCat("header: ", s.message()));
    tokens = static_cast<size_t>(msg.header().matched_blocks()) * g.block_tokens;
    if (tokens > token_ids.size()) return bad("header: matched more tokens than asked for");
    out.num_layers = g.num_layers;
    out.num_kv_heads = g.num_kv_heads;
    out.head_dim = g.head_dim;
    out.dtype = g.dtype;
    out.token_ids.assign(token_ids.begin(), token_ids.begin() + static_cast<ptrdiff_t>(tokens));
    const size_t seq_bytes =
        g.num_layers * g.num_kv_heads * tokens * g.head_dim * DTypeBytes(g.dtype);
    out.k.resize(seq_bytes);
    out.v.resize(seq_bytes);
    block.resize(g.num_bytes());
    layers_seen.assign(msg.header().matched_blocks(), 0);
  }
  while (reader->Read(&msg)) {
    if (!msg.has_block()) return bad("a second header");
    const v1::GetBlock& b = msg.block();
    if (b.block_index() >= layers_seen.size()) return bad("block_index past the match");
    if (!b.encoded().empty()) {  // RESIDUAL: decode here (client -> codec)
      PredictionContext pctx;
      pctx.parent = parent;
      if (b.reference_node_id() != 0) {  // a near-duplicate: needs its centroid's reconstruction
        auto it = references.find(b.reference_node_id());
        if (it == references.end()) {
          absl::StatusOr<std::vector<uint8_t>> ref =
              ReferenceBlock(model_id, b.reference_node_id(), g);
          if (!ref.ok()) {
            ctx->TryCancel();
            reader->Finish();
            return ref.status();
          }
          if (references.size() >= 64) references.clear();  // bound the cache
          it = references.emplace(b.reference_node_id(), *std::move(ref)).first;
        }
        pctx.reference = it->second;
      }
      if (auto s = DecodeBlock(b.encoded(), absl::MakeSpan(block), pctx); !s.ok()) {
        ctx->TryCancel();
        reader->Finish();
        return s;
      }
      layers_seen[b.block_index()] = g.num_layers;
      ScatterBlock(g, tokens, block, b.block_index(), out.k.data(), out.v.data());
      parent = block;
      continue;
    }
    const uint32_t end = b.layer_end();
    if (b.layer_begin() >= end || end > g.num_layers ||
        b.kv().size() != g.layer_range_bytes(b.layer_begin(), end)) {
      return bad(absl::StrCat("block ", b.block_index(), ": malformed layer range"));
    }
    std::copy(b.kv().begin(), b.kv().end(),
              block.begin() + static_cast<ptrdiff_t>(g.layer_range_bytes(0, b.layer_begin())));
    layers_seen[b.block_index()] += end - b.layer_begin();
    if (layers_seen[b.block_index()] == g.num_layers) {
      ScatterBlock(g, tokens, block, b.block_index(), out.k.data(), out.v.data());
    }
  }
  if (auto s = FromGrpc(reader->Finish()); !s.ok()) return s;
  for (size_t i = 0; i < layers_seen.size(); ++i) {
    if (layers_seen[i] != g.num_layers) {
      return absl::DataLossError(absl::StrCat("get: block ", i, " arrived incomplete"));
    }
  }
  out.surprisal_bits.assign(out.token_ids.size(), 0.0f);
  return out;
}

absl::StatusOr<v1::StatsResponse> Client::Stats(const std::string& ns_override) {
  v1::StatsRequest req;
  req.set_namespace_(ns_override.empty() ? options_.ns : ns_override);
  v1::StatsResponse resp;
  auto ctx = NewContext();
  if (auto s = FromGrpc(stub_->Stats(ctx.get(), req, &resp)); !s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::InspectResponse> Client::Inspect(const std::string& model_id, uint64_t node_id) {
  v1::InspectRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  req.set_node_id(node_id);
  v1::InspectResponse resp;
  auto ctx = NewContext();
  if (auto s = FromGrpc(stub_->Inspect(ctx.get(), req, &resp)); !s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::DeleteResponse> Client::Delete(const std::string& model_id,
                                                  absl::Span<const uint32_t> token_ids) {
  v1::DeleteRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  v1::DeleteResponse resp;
  auto ctx = NewContext();
  if (auto s = FromGrpc(stub_->Delete(ctx.get(), req, &resp)); !s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::PinResponse> Client::Pin(const std::string& model_id,
                                            absl::Span<const uint32_t> token_ids,
                                            uint64_t ttl_seconds, bool unpin) {
  v1::PinRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  req.set_ttl_seconds(ttl_seconds);
  req.set_unpin(unpin);
  v1::PinResponse resp;
  auto ctx = NewContext();
  if (auto s = FromGrpc(stub_->Pin(ctx.get(), req, &resp)); !s.ok()) return s;
  return resp;
}

}  // namespace kvtrie
