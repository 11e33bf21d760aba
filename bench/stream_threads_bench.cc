// bench/stream_threads_bench.cc
//
// Server threads under many open streams (issue 10, callback API). Starts kvtrie-server
// (tests/server_process.h, default flags but --codec_threads) and, for each N of --streams:
// opens N Put streams that send a header and one block and then stall, or N Gets of a 16 MiB
// RAW prefix whose clients read the header and then stop; reads the server's thread count
// (/proc/PID/status) and times one other client's Put + Get (Put streams) or Get (Gets) while
// they are open. --before_dir=DIR runs the same rows on the server of another build
// (KVTRIE_SERVER_BINARY_DIR), interleaved, --repeats times; medians.
//
//   stream_threads_bench [--streams=16,64] [--repeats=3] [--codec_threads=2] [--before_dir=DIR]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "tests/hostile_testing.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A RAW prefix of `blocks` blocks of 256 KiB (4 layers, 8 heads, head_dim 128), random bits.
KvDump RawPrefix(int blocks, uint32_t first_token) {
  KvDump d;
  d.model_id = "bench";
  d.num_layers = 4;
  d.num_kv_heads = 8;
  d.head_dim = 128;
  const size_t tokens = 16 * static_cast<size_t>(blocks);
  for (size_t t = 0; t < tokens; ++t) d.token_ids.push_back(first_token + static_cast<uint32_t>(t));
  d.surprisal_bits.assign(tokens, 1.0f);
  const size_t n = size_t{4} * 8 * tokens * 128 * 2;
  std::mt19937 rng(first_token);
  d.k.resize(n);
  d.v.resize(n);
  for (auto& b : d.k) b = static_cast<uint8_t>(rng());
  for (auto& b : d.v) b = static_cast<uint8_t>(rng());
  return d;
}

struct Row {
  std::vector<double> threads, seconds;
  int failures = 0;
};

struct OpenPut {
  OpenPut(v1::KVCache::Stub* stub, const KvDump& d) {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    writer = stub->Put(&ctx, &resp);
    v1::PutHeader h = testing::HeaderOf(d, "", -1, v1::ENCODING_RAW);
    h.mutable_model()->set_block_tokens(16);
    writer->Write(testing::Msg(h));
    v1::PutBlock b;
    b.set_block_index(0);
    b.set_kv(std::string(d.k.size() * 2 / (d.token_ids.size() / 16), '\0'));
    writer->Write(testing::Msg(b));
  }
  ~OpenPut() {
    ctx.TryCancel();
    writer->Finish();
  }
  grpc::ClientContext ctx;
  v1::PutResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer;
};

struct OpenGet {
  OpenGet(v1::KVCache::Stub* stub, const v1::GetRequest& request) {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    reader = stub->Get(&ctx, request);
    v1::GetResponse first;
    reader->Read(&first);
  }
  ~OpenGet() {
    ctx.TryCancel();
    reader->Finish();
  }
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::GetResponse>> reader;
};

void RunOnce(const std::string& label, const std::vector<int>& streams, int codec_threads, int rep,
             std::map<std::string, Row>* rows) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           absl::StrCat("stream_threads_", getpid(), "_", label, rep))
                              .string();
  std::filesystem::remove_all(dir);
  auto server = testing::ServerProcess::Start(
      dir, {absl::StrCat("--codec_threads=", codec_threads), "--put_idle_timeout_seconds=0"});
  if (!server.ok()) {
    std::fprintf(stderr, "%s: %s\n", label.c_str(), std::string(server.status().message()).c_str());
    std::exit(1);
  }
  auto client = Client::Create({.target = (*server)->target(), .ns = ""});
  PutOptions raw;
  raw.encoding = v1::ENCODING_RAW;
  const KvDump big = RawPrefix(64, 1);
  if (!client->Put(big, raw).ok()) std::exit(1);
  const pid_t pid = (*server)->pid();
  (*rows)[absl::StrCat(label, " | idle | 0")].threads.push_back(testing::ThreadCount(pid));
  uint32_t next = 1000000;
  for (int n : streams) {
    {  // Put streams
      std::vector<std::unique_ptr<OpenPut>> open;
      for (int i = 0; i < n; ++i)
        open.push_back(std::make_unique<OpenPut>(client->stub(), RawPrefix(2, next += 100)));
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      Row& row = (*rows)[absl::StrCat(label, " | stalled Put streams | ", n)];
      row.threads.push_back(testing::ThreadCount(pid));
      const auto t0 = Clock::now();
      auto other = Client::Create({.target = (*server)->target(), .ns = ""});
      const KvDump d = RawPrefix(4, next += 100);
      bool ok = other->Put(d, raw).ok() && other->Get(d.model_id, d.token_ids).ok();
      row.seconds.push_back(Since(t0));
      row.failures += !ok;
    }
    {  // Gets not read
      v1::GetRequest request;
      request.set_model_id(big.model_id);
      request.mutable_token_ids()->Add(big.token_ids.begin(), big.token_ids.end());
      std::vector<std::unique_ptr<OpenGet>> open;
      for (int i = 0; i < n; ++i)
        open.push_back(std::make_unique<OpenGet>(client->stub(), request));
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      Row& row = (*rows)[absl::StrCat(label, " | Gets not read | ", n)];
      row.threads.push_back(testing::ThreadCount(pid));
      const auto t0 = Clock::now();
      auto other = Client::Create({.target = (*server)->target(), .ns = ""});
      absl::StatusOr<KvDump> got = other->Get(big.model_id, big.token_ids);
      row.seconds.push_back(Since(t0));
      row.failures += !got.ok() || got->k != big.k;
    }
  }
  (*server)->Stop();
  std::filesystem::remove_all(dir);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) {
  std::vector<int> streams = {16, 64};
  int repeats = 3, codec_threads = 2;
  std::string before_dir;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      return a.rfind(flag, 0) == 0 ? argv[i] + std::strlen(flag) : nullptr;
    };
    if (const char* v = value("--streams=")) {
      streams.clear();
      for (absl::string_view s : absl::StrSplit(v, ','))
        streams.push_back(std::stoi(std::string(s)));
    } else if (const char* v = value("--repeats=")) {
      repeats = std::stoi(v);
    } else if (const char* v = value("--codec_threads=")) {
      codec_threads = std::stoi(v);
    } else if (const char* v = value("--before_dir=")) {
      before_dir = v;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  const char* env = std::getenv("KVTRIE_SERVER_BINARY_DIR");
  const std::string after_dir = env != nullptr ? env : "";
  std::map<std::string, kvtrie::Row> rows;
  for (int rep = 0; rep < repeats; ++rep) {
    kvtrie::RunOnce("this build", streams, codec_threads, rep, &rows);
    if (!before_dir.empty()) {
      setenv("KVTRIE_SERVER_BINARY_DIR", before_dir.c_str(), 1);
      kvtrie::RunOnce("before", streams, codec_threads, rep, &rows);
      setenv("KVTRIE_SERVER_BINARY_DIR", after_dir.c_str(), 1);
    }
  }
  std::printf(
      "| server | open streams | N | server threads (median) | other client's call, s (median) | "
      "failed calls |\n|---|---|---|---|---|---|\n");
  for (const auto& [key, row] : rows) {
    std::printf("| %s | %.0f | %s | %d/%d |\n", key.c_str(), kvtrie::Median(row.threads),
                row.seconds.empty() ? "" : absl::StrCat(kvtrie::Median(row.seconds)).c_str(),
                row.failures, static_cast<int>(row.seconds.size()));
  }
  return 0;
}
