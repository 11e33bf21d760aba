#include "client/client.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client_internal.h"
#include "client/packed_tokens.h"

namespace kvtrie {

namespace client_internal {

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

}  // namespace client_internal

namespace {

using client_internal::CheckNames;
using client_internal::CheckUtf8;
using client_internal::FromGrpc;

absl::Status ReadPem(const char* flag, const std::string& path, std::string* out) {
  if (path.empty()) return absl::OkStatus();
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  *out = text.str();
  return absl::OkStatus();
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
