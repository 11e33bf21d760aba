// Stub of client/worker/worker_commands.h used while the client library is not built.
#include <cstdio>

#include "client/worker/worker_commands.h"

namespace kvtrie::worker {

bool RunServerCommand(const std::string& command, const LlamaModel& model, int* rc) {
  if (command != "run" && command != "eval") return false;
  std::fprintf(stderr, "kvtrie-worker: %s needs the kvtrie client library (not built)\n",
               command.c_str());
  *rc = 1;
  return true;
}

}  // namespace kvtrie::worker
