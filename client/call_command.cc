#include "client/call_command.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/status_reason.h"

namespace kvtrie {
namespace {

namespace pbu = google::protobuf::util;

absl::Status FromGrpc(const grpc::Status& s) { return FromGrpcStatus(s); }

absl::Status Parse(const std::string& json, google::protobuf::Message* msg) {
  pbu::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  pbu::Status s = pbu::JsonStringToMessage(json, msg, options);
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("JSON for ", msg->GetDescriptor()->full_name(),
                                                   ": ", s.message().as_string()));
  }
  return absl::OkStatus();
}

void Print(const google::protobuf::Message& msg, std::ostream& out) {
  pbu::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = false;
  std::string text;
  (void)pbu::MessageToJsonString(msg, &text, options);
  out << text;
  if (text.empty() || text.back() != '\n') out << "\n";
}

absl::StatusOr<std::string> ReadJson(const std::string& arg) {
  if (arg == "-" || absl::StartsWith(arg, "@")) {
    std::stringstream text;
    if (arg == "-") {
      text << std::cin.rdbuf();
    } else {
      std::ifstream in(arg.substr(1), std::ios::binary);
      if (!in) return absl::InvalidArgumentError(absl::StrCat("JSON: cannot read ", arg.substr(1)));
      text << in.rdbuf();
    }
    return text.str();
  }
  return arg;
}

template <typename Req, typename Resp, typename Call>
absl::Status Unary(Client& client, const std::string& json, std::ostream& out, Call call) {
  Req req;
  if (auto s = Parse(json, &req); !s.ok()) return s;
  Resp resp;
  auto ctx = client.NewContext();
  if (auto s = FromGrpc(call(ctx.get(), req, &resp)); !s.ok()) return s;
  Print(resp, out);
  return absl::OkStatus();
}

// Splits a JSON array's top-level elements (objects) without a JSON library: protobuf parses
// each one. Strings may contain brackets and braces; they are skipped with their escapes.
absl::StatusOr<std::vector<std::string>> SplitArray(const std::string& json) {
  std::vector<std::string> out;
  size_t i = json.find_first_not_of(" \t\r\n");
  if (i == std::string::npos || json[i] != '[') {
    return absl::InvalidArgumentError("JSON for Put: a JSON array of PutRequest messages");
  }
  int depth = 0;
  size_t start = 0;
  bool in_string = false;
  for (++i; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"')
      in_string = true;
    else if (c == '{' || c == '[') {
      if (depth++ == 0) start = i;
    } else if (c == '}' || c == ']') {
      if (depth == 0 && c == ']') return out;
      if (--depth == 0) out.push_back(json.substr(start, i + 1 - start));
    }
  }
  return absl::InvalidArgumentError("JSON for Put: the array is not closed");
}

}  // namespace

absl::Status CallMethod(Client& client, const std::string& method_arg, const std::string& json_arg,
                        std::ostream& out) {
  absl::string_view method = method_arg;
  absl::ConsumePrefix(&method, "/");
  absl::ConsumePrefix(&method, "kvtrie.v1.");
  if (!absl::ConsumePrefix(&method, "KVCache/")) absl::ConsumePrefix(&method, "KVCache.");
  absl::StatusOr<std::string> json = ReadJson(json_arg);
  if (!json.ok()) return json.status();
  v1::KVCache::Stub* stub = client.stub();
  using grpc::ClientContext;
  if (method == "Lookup") {
    return Unary<v1::LookupRequest, v1::LookupResponse>(
        client, *json, out,
        [&](ClientContext* c, const auto& q, auto* r) { return stub->Lookup(c, q, r); });
  }
  if (method == "Stats") {
    return Unary<v1::StatsRequest, v1::StatsResponse>(
        client, *json, out,
        [&](ClientContext* c, const auto& q, auto* r) { return stub->Stats(c, q, r); });
  }
  if (method == "Inspect") {
    return Unary<v1::InspectRequest, v1::InspectResponse>(
        client, *json, out,
        [&](ClientContext* c, const auto& q, auto* r) { return stub->Inspect(c, q, r); });
  }
  if (method == "Delete") {
    return Unary<v1::DeleteRequest, v1::DeleteResponse>(
        client, *json, out,
        [&](ClientContext* c, const auto& q, auto* r) { return stub->Delete(c, q, r); });
  }
  if (method == "Pin") {
    return Unary<v1::PinRequest, v1::PinResponse>(
        client, *json, out,
        [&](ClientContext* c, const auto& q, auto* r) { return stub->Pin(c, q, r); });
  }
  if (method == "Get") {
    v1::GetRequest req;
    if (auto s = Parse(*json, &req); !s.ok()) return s;
    auto ctx = client.NewContext();
    std::unique_ptr<grpc::ClientReader<v1::GetResponse>> reader(stub->Get(ctx.get(), req));
    v1::GetResponse msg;
    while (reader->Read(&msg)) Print(msg, out);
    return FromGrpc(reader->Finish());
  }
  if (method == "GetPredictor") {
    v1::GetPredictorRequest req;
    if (auto s = Parse(*json, &req); !s.ok()) return s;
    auto ctx = client.NewContext();
    std::unique_ptr<grpc::ClientReader<v1::PredictorChunk>> reader(
        stub->GetPredictor(ctx.get(), req));
    v1::PredictorChunk msg;
    while (reader->Read(&msg)) Print(msg, out);
    return FromGrpc(reader->Finish());
  }
  if (method == "Put") {
    absl::StatusOr<std::vector<std::string>> parts = SplitArray(*json);
    if (!parts.ok()) return parts.status();
    std::vector<v1::PutRequest> requests(parts->size());
    for (size_t i = 0; i < parts->size(); ++i) {
      if (auto s = Parse((*parts)[i], &requests[i]); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("element ", i, ": ", s.message()));
      }
    }
    auto ctx = client.NewContext();
    v1::PutResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer(stub->Put(ctx.get(), &resp));
    for (const v1::PutRequest& r : requests) {
      if (!writer->Write(r)) break;
    }
    writer->WritesDone();
    if (auto s = FromGrpc(writer->Finish()); !s.ok()) return s;
    Print(resp, out);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("METHOD: '", method_arg,
                   "' is not a kvtrie.v1.KVCache method (Lookup, Put, Get, Stats, Inspect, "
                   "Delete, Pin, GetPredictor)"));
}

}  // namespace kvtrie
