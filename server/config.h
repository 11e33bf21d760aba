// server/config.h
//
// The optional config file (--config=FILE) and the log set-up.
//
// A config file holds the same settings as the flags, one per line, `name = value` (the flag's
// name without dashes; blank lines and lines starting with '#' are ignored; the value may be
// wrapped in double quotes). Flags given on the command line override the file: the file's
// settings are placed before the command line's flags, and the last one given wins.
//   # /etc/kvtrie/kvtrie.conf
//   listen = 0.0.0.0:50051
//   memory_bytes = 8GiB
// Errors name the file and line: "kvtrie.conf:3: unknown setting 'memroy_bytes'".
#ifndef KVTRIE_SERVER_CONFIG_H_
#define KVTRIE_SERVER_CONFIG_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtrie {

// (name, value) pairs of a config file's text; `source` names it in errors. Only the syntax is
// checked here (ExpandConfigFile also checks that each name is a flag).
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseConfigText(
    absl::string_view text, absl::string_view source);

// argv with the settings of the file named by --config=FILE (or `--config FILE`) inserted right
// after argv[0]. Unchanged when there is no --config. Errors: the file cannot be read, a syntax
// error, a name that is not a flag of this binary, `config` inside a config file.
absl::StatusOr<std::vector<std::string>> ExpandConfigFile(int argc, char** argv);

// True for flags whose values are secrets (names ending in token, secret, password).
bool IsSecretFlag(absl::string_view name);

// "name=value ..." of every flag defined in a file for which `in_file` is true, sorted by name,
// secret values as "<redacted>".
std::string EffectiveConfig(absl::FunctionRef<bool(absl::string_view file)> in_file);

// Installs the default spdlog logger on stderr: `format` "text" (the usual lines) or "json" (one
// JSON object a line: time, level, logger, pid, thread, msg — msg JSON-escaped). Errors:
// INVALID_ARGUMENT naming --log_format or --log_level.
absl::Status SetUpLogging(const std::string& format, const std::string& level);

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_CONFIG_H_
