// client/worker/worker_commands.h
//
// The kvtrie-worker subcommands that talk to a kvtrie server (`run`, `eval`). Built only when
// the client library (kvtrie_client) exists; otherwise a stub reports them as unavailable.
#ifndef KVTRIE_CLIENT_WORKER_WORKER_COMMANDS_H_
#define KVTRIE_CLIENT_WORKER_WORKER_COMMANDS_H_

#include <string>

#include "client/worker/llama_model.h"

namespace kvtrie::worker {

// If `command` is one of the server subcommands, runs it (reading its absl flags), stores the
// exit code in *rc and returns true; returns false for other commands.
bool RunServerCommand(const std::string& command, const LlamaModel& model, int* rc);

}  // namespace kvtrie::worker

#endif  // KVTRIE_CLIENT_WORKER_WORKER_COMMANDS_H_
