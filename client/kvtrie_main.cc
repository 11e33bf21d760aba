// kvtrie: the command-line client of a kvtrie server.
//
//   kvtrie [--target=HOST:PORT] [--namespace=NS] COMMAND ARGS...
//
//   put DIR              store the KV dump in DIR (k.npy, v.npy, manifest.json)
//   get DIR OUT          fetch the longest stored prefix of DIR's token_ids into OUT/{k,v}.npy
//   lookup DIR           longest stored prefix of DIR's token_ids (no payload)
//   stats                server totals (or the namespace's, with --namespace)
//   inspect [NODE_ID]    one trie node (0 = the root) and its children; needs --model_id
//   delete DIR TOKENS    delete the stored prefix of DIR's first TOKENS tokens and its subtree;
//                        --erase: nothing of it stays on the server's disk (DeleteRequest.erase)
//   pin DIR TOKENS       pin (unpin DIR TOKENS: unpin) that prefix against eviction, for
//                        --pin_ttl_seconds (0 = until unpinned; --pin_extend_only: a lease
//                        that never shortens an existing pin); with --pin_replicas=2 over
//                        shards also on its second shard
//   call METHOD JSON     any kvtrie.v1.KVCache call from a JSON request (client/call_command.h)
//
// TLS and tenants: --tls_ca, --tls_cert, --tls_key, --token (client/client_flags.h).
// Puts are encoded here (raw, lossless, residual with --target_rel_rms, of the fast profile) and
// sent encoded; --encode_on_client=false sends them dense for the server to encode
// (client/client_flags.h).
// More than one server: --shards=NAME=HOST:PORT,... or --shards_dns=NAME, --all_shards
// (client/shard_flags.h).
//
// Output is JSON on stdout. Errors are one line on stderr and exit status 1 (2 for usage; 3 when
// `get` finds no stored prefix, so `kvtrie get ... && use OUT` is safe).
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/call_command.h"
#include "client/client.h"
#include "client/client_flags.h"
#include "client/proto_json.h"
#include "client/shard_flags.h"
#include "codec/kv_dump.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "server address HOST:PORT");
ABSL_FLAG(std::string, namespace, "", "namespace (isolation domain) of every call");
ABSL_FLAG(std::string, model_id, "",
          "model id; default: the manifest's model_file without extension");
ABSL_FLAG(std::string, encoding, "",
          "put: raw, lossless, residual, int8, kivi2 or turboquant; default: the server's");
ABSL_FLAG(double, target_rel_rms, 0, "put: relative RMS error target of lossy encodings");
ABSL_FLAG(uint32_t, bits, 0, "put: bit width of baselines that take one");
ABSL_FLAG(uint32_t, block_tokens, 16, "put: tokens per block");
ABSL_FLAG(uint32_t, layers_per_message, 0, "put: layers per PutBlock message (0 = all)");
ABSL_FLAG(std::string, profile, "",
          "put: coder of residual and lossless: fast (the default: encoded here, see "
          "--encode_on_client) or compact (~15 % fewer bits, ~10x slower; the server encodes it)");
ABSL_FLAG(std::string, mode, "reconstructed", "get: reconstructed or residual");
ABSL_FLAG(std::string, layers, "",
          "get: BEGIN:END fetches only layers [BEGIN, END) of each block (reconstructed mode; OUT "
          "then holds END - BEGIN layers); empty = all");
ABSL_FLAG(bool, verbose, false, "put: print every block's result");
ABSL_FLAG(int, timeout_seconds, 60, "deadline of each call");
ABSL_FLAG(int, pin_ttl_seconds, 0, "pin: the pin's time to live (0 = until unpinned)");
ABSL_FLAG(bool, pin_extend_only, false,
          "pin: a lease that never shortens the node's pin (PinRequest.extend_only)");
ABSL_FLAG(bool, erase, false,
          "delete: erase (nothing of the deleted blocks stays on the server's disk; "
          "DeleteRequest.erase)");

namespace kvtrie {
namespace {

int Fail(const absl::Status& s) {
  std::cerr << "kvtrie: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << "\n";
  return 1;
}

int Usage(const std::string& why) {
  std::cerr << "kvtrie: " << why << " (see kvtrie --help)\n";
  return 2;
}

void Print(const nlohmann::json& j) { std::cout << j.dump(2) << std::endl; }

std::string ModelId(const KvDump& d) {
  const std::string flag = absl::GetFlag(FLAGS_model_id);
  return flag.empty() ? d.model_id : flag;
}

absl::StatusOr<v1::Encoding> ParseEncoding(const std::string& name) {
  if (name.empty()) return v1::ENCODING_UNSPECIFIED;
  v1::Encoding e;
  std::string upper = "ENCODING_";
  for (char c : name) upper.push_back(static_cast<char>(std::toupper(c)));
  if (v1::Encoding_Parse(upper, &e) && e != v1::ENCODING_UNSPECIFIED) return e;
  return absl::InvalidArgumentError(absl::StrCat("--encoding: unknown '", name, "'"));
}

int Run(const std::vector<char*>& args) {
  if (args.size() < 2) return Usage("missing COMMAND");
  const std::string cmd = args[1];
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.ns = absl::GetFlag(FLAGS_namespace);
  if (absl::GetFlag(FLAGS_timeout_seconds) <= 0) return Usage("--timeout_seconds: must be > 0");
  options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_seconds));
  if (absl::Status s = ApplyClientFlags(&options); !s.ok()) return Fail(s);
  std::unique_ptr<Client> client = Client::Create(options);
  // --shards / --shards_dns: each prefix's calls go to its owner shard (client/shard_flags.h).
  std::unique_ptr<ShardedClient> sharded;
  if (ShardFlagsGiven()) {
    if (cmd == "call") return Usage("call: not with --shards; give one shard's --target");
    absl::StatusOr<std::unique_ptr<ShardedClient>> s = ShardedClientFromFlags(options);
    if (!s.ok()) return Fail(s.status());
    sharded = *std::move(s);
  }

  if (cmd == "call") {
    if (args.size() != 4) return Usage("usage: kvtrie call METHOD JSON (JSON: text, - or @FILE)");
    if (absl::Status s = CallMethod(*client, args[2], args[3], std::cout); !s.ok()) return Fail(s);
    return 0;
  }

  if (cmd == "put") {
    if (args.size() != 3) return Usage("usage: kvtrie put DIR");
    absl::StatusOr<KvDump> d = ReadKvDump(args[2]);
    if (!d.ok()) return Fail(d.status());
    d->model_id = ModelId(*d);
    PutOptions put;
    absl::StatusOr<v1::Encoding> enc = ParseEncoding(absl::GetFlag(FLAGS_encoding));
    if (!enc.ok()) return Fail(enc.status());
    put.encoding = *enc;
    put.target_rel_rms = absl::GetFlag(FLAGS_target_rel_rms);
    put.bits = absl::GetFlag(FLAGS_bits);
    put.block_tokens = absl::GetFlag(FLAGS_block_tokens);
    put.layers_per_message = absl::GetFlag(FLAGS_layers_per_message);
    if (const std::string p = absl::GetFlag(FLAGS_profile); p == "fast") {
      put.profile = v1::EncodingSpec::PROFILE_FAST;
    } else if (p == "compact") {
      put.profile = v1::EncodingSpec::PROFILE_COMPACT;
    } else if (!p.empty()) {
      return Usage("--profile: '" + p + "'; use fast or compact");
    }
    ApplyPutFlags(&put);
    absl::StatusOr<v1::PutResponse> r = sharded ? sharded->Put(*d, put) : client->Put(*d, put);
    if (!r.ok()) return Fail(r.status());
    if (absl::GetFlag(FLAGS_verbose)) {
      Print(ProtoToJson(*r));
      return 0;
    }
    uint64_t logical = 0, stored = 0;
    for (const auto& b : r->blocks()) {
      logical += b.bytes_logical();
      stored += b.bytes_stored();
    }
    Print({{"stored_tokens", r->stored_tokens()},
           {"tail_tokens_ignored", r->tail_tokens_ignored()},
           {"blocks_stored", r->blocks_stored()},
           {"blocks_deduplicated", r->blocks_deduplicated()},
           {"bytes_logical", logical},
           {"bytes_stored_new", stored}});
    return 0;
  }
  if (cmd == "get") {
    if (args.size() != 4) return Usage("usage: kvtrie get DIR OUT");
    absl::StatusOr<KvDump> d = ReadKvManifest(args[2]);
    if (!d.ok()) return Fail(d.status());
    GetOptions get;
    const std::string mode = absl::GetFlag(FLAGS_mode);
    if (mode == "residual") {
      get.mode = v1::GET_MODE_RESIDUAL;
    } else if (mode != "reconstructed") {
      return Usage("--mode: reconstructed or residual");
    }
    if (const std::string layers = absl::GetFlag(FLAGS_layers); !layers.empty()) {
      const size_t colon = layers.find(':');
      if (colon == std::string::npos ||
          !absl::SimpleAtoi(layers.substr(0, colon), &get.layer_begin) ||
          !absl::SimpleAtoi(layers.substr(colon + 1), &get.layer_end)) {
        return Usage("--layers: BEGIN:END, e.g. 0:4");
      }
    }
    absl::StatusOr<KvDump> kv = sharded ? sharded->Get(ModelId(*d), d->token_ids, get)
                                        : client->Get(ModelId(*d), d->token_ids, get);
    if (!kv.ok()) return Fail(kv.status());
    if (kv->token_ids.empty()) {
      Print({{"matched_tokens", 0}});
      std::cerr << "kvtrie: no stored prefix of " << args[2] << "'s token_ids; " << args[3]
                << " not written\n";
      return 3;
    }
    for (size_t i = 0; i < kv->token_ids.size(); ++i) kv->surprisal_bits[i] = d->surprisal_bits[i];
    if (auto s = WriteKvDump(args[3], *kv); !s.ok()) return Fail(s);
    Print({{"matched_tokens", kv->token_ids.size()}, {"out", args[3]}});
    return 0;
  }
  if (cmd == "lookup") {
    if (args.size() != 3) return Usage("usage: kvtrie lookup DIR");
    absl::StatusOr<KvDump> d = ReadKvManifest(args[2]);
    if (!d.ok()) return Fail(d.status());
    absl::StatusOr<v1::LookupResponse> r = sharded ? sharded->Lookup(ModelId(*d), d->token_ids)
                                                   : client->Lookup(ModelId(*d), d->token_ids);
    if (!r.ok()) return Fail(r.status());
    Print(ProtoToJson(*r));
    return 0;
  }
  if (cmd == "stats" && sharded) {
    absl::StatusOr<nlohmann::json> j = ShardedStatsJson(*sharded);
    if (!j.ok()) return Fail(j.status());
    Print(*j);
    return 0;
  }
  if (cmd == "stats") {
    absl::StatusOr<v1::StatsResponse> r = client->Stats();
    if (!r.ok()) return Fail(r.status());
    // Only the histogram buckets that count something (the server sends all 48).
    for (auto* h :
         {r->mutable_path_surprisal_histogram(), r->mutable_branch_distance_histogram()}) {
      google::protobuf::RepeatedPtrField<v1::HistogramBucket> kept;
      for (const v1::HistogramBucket& b : *h) {
        if (b.count() != 0) *kept.Add() = b;
      }
      h->Swap(&kept);
    }
    Print(ProtoToJson(*r));
    return 0;
  }
  if (cmd == "inspect") {
    uint64_t node = 0;
    if (args.size() > 3 || (args.size() == 3 && !absl::SimpleAtoi(args[2], &node))) {
      return Usage("usage: kvtrie inspect [NODE_ID] --model_id=ID");
    }
    if (absl::GetFlag(FLAGS_model_id).empty()) return Usage("inspect needs --model_id");
    if (sharded) {
      Print(ShardedInspectJson(*sharded, absl::GetFlag(FLAGS_model_id), node));
      return 0;
    }
    absl::StatusOr<v1::InspectResponse> r = client->Inspect(absl::GetFlag(FLAGS_model_id), node);
    if (!r.ok()) return Fail(r.status());
    Print(ProtoToJson(*r));
    return 0;
  }
  if (cmd == "delete") {
    size_t n = 0;
    if (args.size() != 4 || !absl::SimpleAtoi(args[3], &n)) {
      return Usage("usage: kvtrie delete DIR TOKENS");
    }
    absl::StatusOr<KvDump> d = ReadKvManifest(args[2]);
    if (!d.ok()) return Fail(d.status());
    if (n > d->token_ids.size()) return Usage("TOKENS is more than the manifest holds");
    const auto prefix = absl::MakeSpan(d->token_ids).subspan(0, n);
    const bool erase = absl::GetFlag(FLAGS_erase);
    absl::StatusOr<v1::DeleteResponse> r = sharded ? sharded->Delete(ModelId(*d), prefix, erase)
                                                   : client->Delete(ModelId(*d), prefix, erase);
    if (!r.ok()) return Fail(r.status());
    Print(ProtoToJson(*r));
    return 0;
  }
  if (cmd == "pin" || cmd == "unpin") {
    size_t n = 0;
    if (args.size() != 4 || !absl::SimpleAtoi(args[3], &n)) {
      return Usage("usage: kvtrie " + cmd + " DIR TOKENS");
    }
    absl::StatusOr<KvDump> d = ReadKvManifest(args[2]);
    if (!d.ok()) return Fail(d.status());
    if (n > d->token_ids.size()) return Usage("TOKENS is more than the manifest holds");
    const auto prefix = absl::MakeSpan(d->token_ids).subspan(0, n);
    const int ttl = absl::GetFlag(FLAGS_pin_ttl_seconds);
    if (ttl < 0) return Usage("--pin_ttl_seconds: must be >= 0");
    const bool unpin = cmd == "unpin";
    const bool extend_only = absl::GetFlag(FLAGS_pin_extend_only);
    absl::StatusOr<v1::PinResponse> r =
        sharded ? sharded->Pin(ModelId(*d), prefix, static_cast<uint64_t>(ttl), unpin, extend_only)
                : client->Pin(ModelId(*d), prefix, static_cast<uint64_t>(ttl), unpin, extend_only);
    if (!r.ok()) return Fail(r.status());
    nlohmann::json out = ProtoToJson(*r);
    if (sharded) {
      out["replica_copies"] = sharded->counters().replica_copies;
      out["replica_failures"] = sharded->counters().replica_failures;
    }
    Print(out);
    return 0;
  }
  return Usage("unknown command '" + cmd + "'");
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "command-line client of a kvtrie server.\n"
      "  kvtrie [--target=HOST:PORT] [--namespace=NS] COMMAND ARGS...\n"
      "  put DIR | get DIR OUT | lookup DIR | stats | inspect [NODE_ID] --model_id=ID |"
      " delete DIR TOKENS | pin DIR TOKENS | unpin DIR TOKENS | call METHOD JSON\n"
      "  DIR is a KV dump folder: k.npy, v.npy, manifest.json (see shared/data/README.md)");
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "client/kvtrie_main.cc") ||
           absl::StrContains(file, "client/client_flags.cc") ||
           absl::StrContains(file, "client/shard_flags.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  return kvtrie::Run(absl::ParseCommandLine(argc, argv));
}
