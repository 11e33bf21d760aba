// bench/client_bench — the C++ client's (kvtrie::Client) Put and Get throughput for one dump
// folder, the baseline that bench/python_bench.py runs beside the Python client in the same run.
// Reads the dump once, then per repeat: Put into a fresh namespace `<namespace>-<rep>`, Get it
// back, Delete it. Prints one line per repeat: `put_s=<s> get_s=<s> put_cpu=<s> get_cpu=<s> ...`
// (wall seconds, and CPU seconds of this client process: the caller's thread and gRPC's).
//
//   client_bench --target=127.0.0.1:PORT --dump=DIR --encoding=raw --mode=reconstructed --reps=1
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "client/client.h"
#include "codec/kv_dump.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "kvtrie server HOST:PORT");
ABSL_FLAG(std::string, dump, "", "KV dump folder (k.npy, v.npy, manifest.json)");
ABSL_FLAG(std::string, model_id, "bench", "model_id of the Puts");
ABSL_FLAG(std::string, ns, "bench-cpp", "namespace prefix; repeat i uses <ns>-<i>");
ABSL_FLAG(std::string, encoding, "raw", "raw | lossless | residual | ...");
ABSL_FLAG(std::string, mode, "reconstructed", "Get mode: reconstructed | residual");
ABSL_FLAG(int, reps, 1, "repeats");
ABSL_FLAG(int, first_rep, 0, "index of the first repeat (namespace suffix)");

namespace {

// CPU seconds of this process so far (every thread: the caller's and gRPC's).
double CpuSeconds() {
  rusage r;
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_stime.tv_sec + 1e-6 * (r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "client_bench: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using kvtrie::v1::Encoding;
  using kvtrie::v1::GetMode;
  absl::StatusOr<kvtrie::KvDump> kv = kvtrie::ReadKvDump(absl::GetFlag(FLAGS_dump));
  if (!kv.ok()) return Fail("dump", kv.status());
  kv->model_id = absl::GetFlag(FLAGS_model_id);
  Encoding enc;
  if (!kvtrie::v1::Encoding_Parse(
          "ENCODING_" + absl::AsciiStrToUpper(absl::GetFlag(FLAGS_encoding)), &enc)) {
    return Fail("encoding", absl::InvalidArgumentError(absl::GetFlag(FLAGS_encoding)));
  }
  GetMode mode;
  if (!kvtrie::v1::GetMode_Parse("GET_MODE_" + absl::AsciiStrToUpper(absl::GetFlag(FLAGS_mode)),
                                 &mode)) {
    return Fail("mode", absl::InvalidArgumentError(absl::GetFlag(FLAGS_mode)));
  }
  for (int rep = absl::GetFlag(FLAGS_first_rep);
       rep < absl::GetFlag(FLAGS_first_rep) + absl::GetFlag(FLAGS_reps); ++rep) {
    kvtrie::ClientOptions o;
    o.target = absl::GetFlag(FLAGS_target);
    o.ns = absl::GetFlag(FLAGS_ns) + "-" + std::to_string(rep);
    o.timeout = absl::Seconds(600);
    std::unique_ptr<kvtrie::Client> c = kvtrie::Client::Create(o);
    kvtrie::PutOptions po;
    po.encoding = enc;
    double cpu0 = CpuSeconds();
    auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<kvtrie::v1::PutResponse> put = c->Put(*kv, po);
    const double put_s = Seconds(t0);
    const double put_cpu = CpuSeconds() - cpu0;
    if (!put.ok()) return Fail("put", put.status());
    kvtrie::GetOptions go;
    go.mode = mode;
    cpu0 = CpuSeconds();
    t0 = std::chrono::steady_clock::now();
    absl::StatusOr<kvtrie::KvDump> got = c->Get(kv->model_id, kv->token_ids, go);
    const double get_s = Seconds(t0);
    const double get_cpu = CpuSeconds() - cpu0;
    if (!got.ok()) return Fail("get", got.status());
    if (got->k != kv->k && enc != kvtrie::v1::ENCODING_RESIDUAL) {
      return Fail("get", absl::DataLossError("K differs from what was put"));
    }
    std::printf("put_s=%.6f get_s=%.6f put_cpu=%.6f get_cpu=%.6f bytes=%zu tokens=%zu\n", put_s,
                get_s, put_cpu, get_cpu, kv->k.size() + kv->v.size(), got->num_tokens());
    std::fflush(stdout);
    if (auto d = c->Delete(kv->model_id, absl::MakeConstSpan(kv->token_ids).subspan(0, 16));
        !d.ok()) {
      return Fail("delete", d.status());
    }
  }
  return 0;
}
