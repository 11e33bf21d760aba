// kvtrie-test-proxy: tests/failing_put_proxy.h as a process, for the Python client's retry tests
// (tests/python/test_client.py). Serves until killed.
//   --target=HOST:PORT      the real kvtrie-server
//   --put_failures=N        Puts failed before the rest are forwarded
//   --put_code=ABORTED      the failed Puts' status (ABORTED, UNAVAILABLE, INTERNAL)
//   --lookup_failures=N     Lookups answered UNAVAILABLE before the rest are forwarded
//   --port_file=FILE        where the port is written once it serves
#include <cstdio>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "tests/failing_put_proxy.h"

ABSL_FLAG(std::string, target, "", "the real kvtrie-server, HOST:PORT");
ABSL_FLAG(int, put_failures, 0, "Puts failed before the rest are forwarded");
ABSL_FLAG(std::string, put_code, "ABORTED",
          "status of the failed Puts: ABORTED, UNAVAILABLE, "
          "INTERNAL");
ABSL_FLAG(int, lookup_failures, 0, "Lookups answered UNAVAILABLE before the rest are forwarded");
ABSL_FLAG(std::string, port_file, "", "file the port is written to once the proxy serves");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  kvtrie::testing::FailingPutProxyOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  o.put_failures = absl::GetFlag(FLAGS_put_failures);
  o.lookup_failures = absl::GetFlag(FLAGS_lookup_failures);
  const std::string code = absl::GetFlag(FLAGS_put_code);
  if (code == "ABORTED") {
    o.put_code = grpc::StatusCode::ABORTED;
  } else if (code == "UNAVAILABLE") {
    o.put_code = grpc::StatusCode::UNAVAILABLE;
  } else if (code == "INTERNAL") {
    o.put_code = grpc::StatusCode::INTERNAL;
  } else {
    std::fprintf(stderr, "--put_code: %s is not ABORTED, UNAVAILABLE or INTERNAL\n", code.c_str());
    return 2;
  }
  auto proxy = kvtrie::testing::FailingPutProxy::Start(o);
  if (!proxy.ok()) {
    std::fprintf(stderr, "%s\n", proxy.status().ToString().c_str());
    return 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << (*proxy)->port() << "\n";
    std::rename(tmp.c_str(), port_file.c_str());
  }
  (*proxy)->Wait();
  return 0;
}
