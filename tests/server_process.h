// tests/server_process.h
//
// Starts the real `kvtrie-server` binary as a child process on a free loopback port, for
// end-to-end tests. The server gets --listen=127.0.0.1:0 and reports its port through
// --port_file; Start waits (up to 30 s) until it serves. Its log goes to `<data_dir>.log`.
// To run the end-to-end tests against an older build (bench/issue12_before_after.sh):
// KVTRIE_SERVER_BINARY_DIR names that build's folder (see BinaryPath), and
// KVTRIE_SERVER_DROP_FLAGS (comma-separated flag names, e.g. "put_idle_timeout_seconds") leaves
// out the extra flags it does not know.
#ifndef KVTRIE_TESTS_SERVER_PROCESS_H_
#define KVTRIE_TESTS_SERVER_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtrie::testing {

class ServerProcess {
 public:
  // Starts kvtrie-server with --data_dir=`data_dir` and `extra_flags` ("--sync", ...).
  // Errors: INTERNAL with the server's log if it exits or does not serve within 30 s.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::string& data_dir, const std::vector<std::string>& extra_flags = {});
  ~ServerProcess();  // SIGKILL if still running
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  int port() const { return port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }
  std::string log() const;  // the server's stdout+stderr so far

  // SIGTERM, then waits for exit. Returns the exit status (0 for a clean shutdown), or -signal.
  int Stop();
  // SIGKILL, then waits.
  void Kill();

 private:
  ServerProcess() = default;
  int Wait();
  pid_t pid_ = -1;
  int port_ = 0;
  std::string log_path_;
};

// Path of a binary of this build: "kvtrie-server", "kvtrie", "kvtrie-worker". The environment
// variable KVTRIE_SERVER_BINARY_DIR, when set and non-empty, replaces this build's folder (to run
// the end-to-end tests against another build's binaries, e.g. an old commit's; see
// bench/issue12_before_after.md).
std::string BinaryPath(const std::string& name);

// Runs `argv` (argv[0] a path), returns its exit status and writes stdout to *out and stderr to
// *err (either may be null).
int RunCommand(const std::vector<std::string>& argv, std::string* out, std::string* err);

// A fresh empty folder under the test temp dir, unique to this process and `name`.
std::string FreshDir(const std::string& name);

}  // namespace kvtrie::testing

#endif  // KVTRIE_TESTS_SERVER_PROCESS_H_
