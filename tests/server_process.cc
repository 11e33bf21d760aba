#include "tests/server_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace kvtrie::testing {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// fork + exec with stdout/stderr redirected to files; returns the child's pid.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& out_path,
            const std::string& err_path) {
  pid_t pid = fork();
  if (pid == 0) {
    // Append, so a restarted server's log follows the previous one's.
    if (!freopen(out_path.c_str(), "a", stdout)) _exit(126);
    if (out_path == err_path) {
      dup2(STDOUT_FILENO, STDERR_FILENO);
    } else if (!freopen(err_path.c_str(), "a", stderr)) {
      _exit(126);
    }
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return -1000;
}

}  // namespace

std::string BinaryPath(const std::string& name) {
  const char* dir = std::getenv("KVTRIE_SERVER_BINARY_DIR");
  return (std::filesystem::path(dir != nullptr && *dir != '\0' ? dir : KVTRIE_BINARY_DIR) / name)
      .string();
}

std::string FreshDir(const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / absl::StrCat("kvtrie_", getpid(), "_", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

int RunCommand(const std::vector<std::string>& argv, std::string* out, std::string* err) {
  static int counter = 0;
  const std::string base = FreshDir(absl::StrCat("cmd", counter++));
  const std::string o = base + "/out", e = base + "/err";
  pid_t pid = Spawn(argv, o, e);
  int status = 0;
  waitpid(pid, &status, 0);
  if (out) *out = Slurp(o);
  if (err) *err = Slurp(e);
  std::filesystem::remove_all(base);
  return DecodeWaitStatus(status);
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const std::string& data_dir, const std::vector<std::string>& extra_flags) {
  std::unique_ptr<ServerProcess> p(new ServerProcess());
  const std::string port_file = data_dir + ".port";
  std::filesystem::remove(port_file);
  p->log_path_ = data_dir + ".log";
  std::vector<std::string> argv = {BinaryPath("server/kvtrie-server"), "--listen=127.0.0.1:0",
                                   "--data_dir=" + data_dir, "--port_file=" + port_file,
                                   "--shutdown_grace_seconds=5"};
  // KVTRIE_SERVER_DROP_FLAGS: flags (comma-separated names) an older server does not know.
  const char* drop_env = std::getenv("KVTRIE_SERVER_DROP_FLAGS");
  const std::vector<std::string> drop = absl::StrSplit(drop_env ? drop_env : "", ',');
  for (const std::string& flag : extra_flags) {
    const std::string name =
        flag.substr(0, flag.find('=')).substr(flag.rfind("--", 0) == 0 ? 2 : 0);
    if (std::find(drop.begin(), drop.end(), name) == drop.end()) argv.push_back(flag);
  }
  p->pid_ = Spawn(argv, p->log_path_, p->log_path_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(p->pid_, &status, WNOHANG) == p->pid_) {
      p->pid_ = -1;
      return absl::InternalError(
          absl::StrCat("kvtrie-server exited with ", DecodeWaitStatus(status), ":\n", p->log()));
    }
    std::ifstream in(port_file);
    if (in >> p->port_ && p->port_ > 0) return p;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::InternalError("kvtrie-server did not serve within 30 s:\n" + p->log());
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) Kill();
}

std::string ServerProcess::log() const { return Slurp(log_path_); }

int ServerProcess::Wait() {
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return DecodeWaitStatus(status);
}

int ServerProcess::Stop() {
  if (pid_ <= 0) return -1000;
  kill(pid_, SIGTERM);
  return Wait();
}

void ServerProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  Wait();
}

}  // namespace kvtrie::testing
