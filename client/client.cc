#include "client/client.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/get_wire.h"
#include "client/packed_tokens.h"
#include "client/put_encode.h"
#include "client/residual_chain.h"
#include "codec/block_codec.h"
#include "codec/crc32c.h"
#include "codec/kv_layout.h"

namespace kvtrie {
namespace {

// Token ids (and as many surprisal values) per Put message: 128K x 8 bytes = 1 MiB.
constexpr size_t kTokensPerMessage = 128 * 1024;

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

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

// proto3 `string` fields must be UTF-8: a server cannot parse a message with invalid UTF-8 and
// answers only INTERNAL (unary) or sees the stream end (Put). Checked here to name the field.
absl::Status CheckUtf8(absl::string_view field, absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    bool ok = n != 0 && i + n <= s.size() && !(n == 2 && c < 0xc2);
    uint32_t cp = n == 1 ? c : c & (0x7f >> n);
    for (size_t k = 1; ok && k < n; ++k) {
      const auto d = static_cast<uint8_t>(s[i + k]);
      ok = (d & 0xc0) == 0x80;
      cp = (cp << 6) | (d & 0x3f);
    }
    if (ok && n == 3) ok = cp >= 0x800 && (cp < 0xd800 || cp > 0xdfff);
    if (ok && n == 4) ok = cp >= 0x10000 && cp <= 0x10ffff;
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": not valid UTF-8 (byte ", i, "); proto3 strings must be UTF-8"));
    }
    i += n;
  }
  return absl::OkStatus();
}

absl::Status CheckNames(absl::string_view ns, absl::string_view model_id) {
  if (auto s = CheckUtf8("namespace", ns); !s.ok()) return s;
  return CheckUtf8("model_id", model_id);
}

BlockGeometry GeometryOf(const v1::ModelSpec& m) {
  return {m.num_layers(), m.num_kv_heads(), m.block_tokens() ? m.block_tokens() : 16, m.head_dim(),
          static_cast<DType>(m.dtype())};
}

absl::Status ReadPem(const char* flag, const std::string& path, std::string* out) {
  if (path.empty()) return absl::OkStatus();
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  *out = text.str();
  return absl::OkStatus();
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

absl::Status LoadTlsFiles(const std::string& ca, const std::string& cert, const std::string& key,
                          ClientOptions* options) {
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError(cert.empty() ? "--tls_cert: needed with --tls_key"
                                                   : "--tls_key: needed with --tls_cert");
  }
  if (auto s = ReadPem("--tls_ca", ca, &options->tls_root_pem); !s.ok()) return s;
  if (auto s = ReadPem("--tls_cert", cert, &options->tls_cert_pem); !s.ok()) return s;
  if (auto s = ReadPem("--tls_key", key, &options->tls_key_pem); !s.ok()) return s;
  if (!ca.empty() || !cert.empty()) options->tls = true;
  return absl::OkStatus();
}

std::unique_ptr<Client> Client::Create(const ClientOptions& options) {
  return std::unique_ptr<Client>(new Client(options));
}

Client::Client(const ClientOptions& options) : options_(options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  // After a failed connection the channel fails calls fast until its resolver resolves the target
  // again, which gRPC's DNS resolver does at most every 30 s, and its reconnect backoff grows to
  // 120 s: a retried call never reached a server restarted meanwhile (the break-it run of issue
  // 18). Both follow the retry policy's pace instead.
  const auto ms = [](absl::Duration d) {
    return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 20, 120'000));
  };
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, ms(options.retry.initial_backoff));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, ms(options.retry.max_backoff));
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, ms(options.retry.initial_backoff));
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_pem;
    ssl.pem_cert_chain = options.tls_cert_pem;
    ssl.pem_private_key = options.tls_key_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  }
  channel_ = grpc::CreateCustomChannel(options.target, credentials, args);
  stub_ = v1::KVCache::NewStub(channel_);
  const int threads = options.codec_threads > 0
                          ? options.codec_threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (threads > 1) codec_pool_ = std::make_unique<ThreadPool>(threads);
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

ContextPtr Client::NewContext() const {
  ContextPtr ctx(new grpc::ClientContext(), ContextDeleter{calls_});
  ctx->set_deadline(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(options_.timeout));
  if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
  calls_->Add(ctx.get());
  return ctx;
}

absl::Status Client::CheckHealth(absl::Duration deadline) {
  // HealthCheckRequest{service: ""} is the empty message; the answer's field 1 is the status.
  static const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check",
                                                grpc::internal::RpcMethod::NORMAL_RPC);
  grpc::ClientContext ctx;  // not in calls(): a probe is never cancelled with the real calls
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMicroseconds(deadline));
  if (!options_.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options_.token);
  grpc::ByteBuffer request, response;
  grpc::Slice empty("", 0);
  request = grpc::ByteBuffer(&empty, 1);
  if (auto s = FromGrpc(grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer,
                                                          grpc::ByteBuffer, grpc::ByteBuffer>(
          channel_.get(), method, &ctx, request, &response));
      !s.ok()) {
    return s;
  }
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Dump(&slices).ok()) {
    for (const grpc::Slice& sl : slices) {
      bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
  }
  // SERVING is 1: the bytes 0x08 0x01 (an unknown or NOT_SERVING status is anything else).
  if (bytes.size() == 2 && bytes[0] == 0x08 && bytes[1] == 0x01) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("health: the server answers status ",
                                             bytes.size() == 2 ? int{bytes[1]} : 0,
                                             " (not SERVING)"));
}

template <typename Call>
absl::Status Client::RetryRead(Call&& call) {
  for (int attempt = 1;; ++attempt) {
    absl::Status s = call();
    if (s.ok() || !RetryableReadCode(s.code()) || attempt >= options_.retry.max_attempts) return s;
    absl::SleepFor(RetryBackoff(options_.retry, attempt));
  }
}

absl::StatusOr<v1::LookupResponse> Client::Lookup(const std::string& model_id,
                                                  absl::Span<const uint32_t> token_ids) {
  if (auto s = CheckNames(options_.ns, model_id); !s.ok()) return s;
  v1::LookupRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  v1::LookupResponse resp;
  if (options_.packed_token_ids && ABSL_IS_LITTLE_ENDIAN) {
    // The ids go to the wire from the caller's memory (a 1M-token Lookup is 4 MB): no copy into
    // the message nor into a serialized buffer.
    std::string head;
    const grpc::ByteBuffer wire =
        WithPackedTokens(req, v1::LookupRequest::kTokenIdsPackedFieldNumber, token_ids, &head);
    const grpc::internal::RpcMethod method("/kvtrie.v1.KVCache/Lookup",
                                           grpc::internal::RpcMethod::NORMAL_RPC);
    if (auto s = RetryRead([&] {
          auto ctx = NewContext();
          return FromGrpc(
              grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, v1::LookupResponse,
                                                grpc::ByteBuffer, grpc::protobuf::MessageLite>(
                  channel_.get(), method, ctx.get(), wire, &resp));
        });
        !s.ok()) {
      return s;
    }
    return resp;
  }
  if (options_.packed_token_ids) {
    PackTokens(token_ids, req.mutable_token_ids_packed());
  } else {
    req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  }
  if (auto s = RetryRead([&] {
        auto ctx = NewContext();
        return FromGrpc(stub_->Lookup(ctx.get(), req, &resp));
      });
      !s.ok()) {
    return s;
  }
  return resp;
}

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
    if (!absl::IsFailedPrecondition(r.status()) ||
        r.status().message().find("predictor_version") == absl::string_view::npos) {
      return r;
    }
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

absl::StatusOr<v1::StatsResponse> Client::Stats(const std::string& ns_override) {
  if (auto s = CheckUtf8("namespace", ns_override.empty() ? options_.ns : ns_override); !s.ok())
    return s;
  v1::StatsRequest req;
  req.set_namespace_(ns_override.empty() ? options_.ns : ns_override);
  v1::StatsResponse resp;
  if (auto s = RetryRead([&] {
        auto ctx = NewContext();
        return FromGrpc(stub_->Stats(ctx.get(), req, &resp));
      });
      !s.ok()) {
    return s;
  }
  return resp;
}

absl::StatusOr<v1::InspectResponse> Client::Inspect(const std::string& model_id, uint64_t node_id) {
  if (auto s = CheckNames(options_.ns, model_id); !s.ok()) return s;
  v1::InspectRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  req.set_node_id(node_id);
  v1::InspectResponse resp;
  if (auto s = RetryRead([&] {
        auto ctx = NewContext();
        return FromGrpc(stub_->Inspect(ctx.get(), req, &resp));
      });
      !s.ok()) {
    return s;
  }
  return resp;
}

absl::StatusOr<v1::DeleteResponse> Client::Delete(const std::string& model_id,
                                                  absl::Span<const uint32_t> token_ids,
                                                  bool erase) {
  if (auto s = CheckNames(options_.ns, model_id); !s.ok()) return s;
  v1::DeleteRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  req.set_erase(erase);
  v1::DeleteResponse resp;
  auto ctx = NewContext();
  if (auto s = FromGrpc(stub_->Delete(ctx.get(), req, &resp)); !s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::PinResponse> Client::Pin(const std::string& model_id,
                                            absl::Span<const uint32_t> token_ids,
                                            uint64_t ttl_seconds, bool unpin, bool extend_only) {
  v1::PinRequest req;
  req.set_namespace_(options_.ns);
  req.set_model_id(model_id);
  req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  req.set_ttl_seconds(ttl_seconds);
  req.set_unpin(unpin);
  req.set_extend_only(extend_only);
  v1::PinResponse resp;
  auto ctx = NewContext();
  if (auto s = FromGrpc(stub_->Pin(ctx.get(), req, &resp)); !s.ok()) return s;
  return resp;
}

}  // namespace kvtrie
