// server/fuzz/put_stream_fuzzer.cc
//
// libFuzzer target for the Put stream state machine: arbitrary PutRequest sequences through the
// real KvCacheService (a gRPC server on a loopback port in this process, real KvStore over
// RocksDB on an in-memory Env, trie/memory_env.h) that lives for the whole run, so later inputs
// meet what earlier ones stored. Speed (issue 18): 24 inputs/s before, when the store wrote to a
// disk folder and the channel was Server::InProcessChannel, whose calls that ended in an error
// stayed alive (~30 KB each; RSS grew ~1 GB a minute and every per-input leak check scanned it
// all; a real server over TCP keeps none). Checks, besides "never a crash, leak or UB" (ASan +
// UBSan): every error has a message that starts with a field ("header: ...", "kv: ..."); an
// acknowledged Put can be read back, all of it.
//
// Input: records of [u8 kind][u16 length][length bytes]; kind % 4 = 0: a serialized PutRequest
// as is; 1: a PutHeader built from the bytes (small geometry, token ids, encoding); 2: a PutBlock
// (index, layer range, kv bytes; sent as `encoded` when bit 7 of the layer_begin byte is set);
// 3: a PutCommit. Seeds in server/fuzz/put_stream_corpus.
// Build and run: see tests/run_sanitizers.sh and bench/fuzz_long.sh.
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kvtrie/v1/kvtrie.grpc.pb.h"
#include "server/kvcache_service.h"
#include "trie/kv_store.h"
#include "trie/memory_env.h"

namespace {

using kvtrie::v1::PutRequest;

struct Harness {
  Harness() {
    dir =
        std::filesystem::temp_directory_path() / ("kvtrie_put_fuzz_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    env = kvtrie::NewMemoryEnv();
    kvtrie::StoreOptions o;
    o.data_dir = dir.string();  // a name inside `env`; the real folder it creates stays empty
    o.env = env.get();
    o.max_put_bytes = 1 << 20;
    o.max_inflight_put_bytes = 4 << 20;
    o.memory_bytes = 4 << 20;
    o.disk_bytes = 64 << 20;  // a long run evicts instead of filling the disk
    o.background = false;
    store = *kvtrie::KvStore::Open(o);
    std::filesystem::remove_all(dir);
    kvtrie::ServiceOptions so;
    so.max_tokens = 4096;
    so.put_limits.max_concurrent_streams = 8;
    so.put_limits.max_inflight_bytes_per_namespace = 2 << 20;
    service = std::make_unique<kvtrie::KvCacheService>(store.get(), so);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    stub = kvtrie::v1::KVCache::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                            grpc::InsecureChannelCredentials()));
  }
  std::filesystem::path dir;
  std::shared_ptr<rocksdb::Env> env;  // outlives the store (neither is ever destroyed)
  std::unique_ptr<kvtrie::KvStore> store;
  std::unique_ptr<kvtrie::KvCacheService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<kvtrie::v1::KVCache::Stub> stub;
};

Harness& H() {
  static Harness* h = new Harness();  // lives for the process (libFuzzer never returns)
  return *h;
}

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool empty() const { return n_ == 0; }
  uint8_t U8() { return n_ ? (--n_, *p_++) : 0; }
  uint16_t U16() { return static_cast<uint16_t>(U8() | (U8() << 8)); }
  std::string Bytes(size_t n) {
    n = std::min(n, n_);
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    n_ -= n;
    return s;
  }

 private:
  const uint8_t* p_;
  size_t n_;
};

PutRequest HeaderFrom(Reader r) {
  PutRequest req;
  auto* h = req.mutable_header();
  h->set_namespace_(std::string(1, static_cast<char>('a' + r.U8() % 3)));
  auto* m = h->mutable_model();
  m->set_model_id("m" + std::to_string(r.U8() % 3));
  m->set_num_layers(r.U8() % 4);
  m->set_num_kv_heads(r.U8() % 3);
  m->set_head_dim(r.U8() % 9);
  m->set_dtype(static_cast<kvtrie::v1::DType>(r.U8() % 5));
  m->set_block_tokens(r.U8() % 9);
  h->mutable_encoding()->set_encoding(static_cast<kvtrie::v1::Encoding>(r.U8() % 8));
  h->mutable_encoding()->set_target_rel_rms(r.U8() / 256.0);
  const int tokens = r.U8();
  for (int i = 0; i < tokens; ++i) h->add_token_ids(r.U8() % 8);
  if (r.U8() & 1) {
    for (int i = 0; i < tokens; ++i) h->add_surprisal_bits(r.U8() / 16.0f);
  }
  return req;
}

PutRequest BlockFrom(Reader r) {
  PutRequest req;
  auto* b = req.mutable_block();
  b->set_block_index(r.U8() % 40);
  const uint8_t layer_begin = r.U8();
  b->set_layer_begin(layer_begin % 5);
  b->set_layer_end(r.U8() % 5);
  const size_t fill = r.U16() % 4096;
  std::string kv = r.Bytes(fill);
  kv.resize(fill, static_cast<char>(0x3c));  // fp16/bf16 ~1 where the input ran out
  if (layer_begin & 0x80) {
    b->set_encoded(kv);  // an encoded block (PutBlock.encoded, codec/block_verify.h)
  } else {
    b->set_kv(kv);
  }
  return req;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Harness& h = H();
  Reader in(data, size);
  std::vector<PutRequest> messages;
  while (!in.empty() && messages.size() < 64) {
    const uint8_t kind = in.U8();
    const std::string body = in.Bytes(in.U16());
    Reader r(reinterpret_cast<const uint8_t*>(body.data()), body.size());
    PutRequest req;
    switch (kind % 4) {
      case 0:
        if (!req.ParseFromString(body)) continue;
        break;
      case 1:
        req = HeaderFrom(r);
        break;
      case 2:
        req = BlockFrom(r);
        break;
      case 3:
        req.mutable_commit();
        break;
    }
    messages.push_back(std::move(req));
  }
  kvtrie::v1::PutResponse resp;
  grpc::Status status;
  {
    grpc::ClientContext ctx;
    auto writer = h.stub->Put(&ctx, &resp);
    for (const PutRequest& m : messages) {
      if (!writer->Write(m)) break;
    }
    writer->WritesDone();
    status = writer->Finish();
  }
  if (!status.ok()) {
    // Every refusal says which field (or call) it is about.
    if (status.error_message().find(": ") == std::string::npos) {
      fprintf(stderr, "status without a field: %d %s\n", status.error_code(),
              status.error_message().c_str());
      abort();
    }
    return 0;
  }
  // Acknowledged: the whole stored prefix reads back.
  const kvtrie::v1::PutHeader* header = nullptr;
  for (const PutRequest& m : messages) {
    if (m.has_header()) {
      header = &m.header();
      break;
    }
  }
  if (header == nullptr) abort();  // OK without a header
  std::vector<uint32_t> tokens(header->token_ids().begin(), header->token_ids().end());
  for (const PutRequest& m : messages) {
    if (m.has_tokens())
      tokens.insert(tokens.end(), m.tokens().token_ids().begin(), m.tokens().token_ids().end());
  }
  kvtrie::v1::GetRequest get;
  get.set_namespace_(header->namespace_());
  get.set_model_id(header->model().model_id());
  get.mutable_token_ids()->Add(tokens.begin(), tokens.end());
  grpc::ClientContext ctx;
  auto reader = h.stub->Get(&ctx, get);
  kvtrie::v1::GetResponse msg;
  uint32_t matched = 0;
  if (reader->Read(&msg) && msg.has_header()) matched = msg.header().matched_tokens();
  while (reader->Read(&msg)) {
  }
  grpc::Status gs = reader->Finish();
  if (!gs.ok() || matched < resp.stored_tokens()) {
    fprintf(stderr, "acknowledged %u tokens, Get matched %u (%s)\n", resp.stored_tokens(), matched,
            gs.error_message().c_str());
    abort();
  }
  return 0;
}
