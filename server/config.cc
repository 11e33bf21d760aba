#include "server/config.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace kvtrie {
namespace {

// spdlog flag %* : the message, escaped for a JSON string.
class JsonMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    static const char kHex[] = "0123456789abcdef";
    for (char c : msg.payload) {
      switch (c) {
        case '"':
          dest.append(std::string_view("\\\""));
          break;
        case '\\':
          dest.append(std::string_view("\\\\"));
          break;
        case '\n':
          dest.append(std::string_view("\\n"));
          break;
        case '\r':
          dest.append(std::string_view("\\r"));
          break;
        case '\t':
          dest.append(std::string_view("\\t"));
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            const char esc[] = {'\\', 'u', '0', '0', kHex[(c >> 4) & 0xf], kHex[c & 0xf]};
            dest.append(esc, esc + sizeof(esc));
          } else {
            dest.push_back(c);
          }
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

}  // namespace

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseConfigText(
    absl::string_view text, absl::string_view source) {
  std::vector<std::pair<std::string, std::string>> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ":", line_no, ": expected 'name = value', got '", line, "'"));
    }
    std::string name(absl::StripAsciiWhitespace(line.substr(0, eq)));
    absl::string_view value = absl::StripAsciiWhitespace(line.substr(eq + 1));
    if (absl::StartsWith(name, "--")) name = name.substr(2);
    if (name.empty() ||
        name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ":", line_no, ": '", name, "' is not a setting name"));
    }
    if (value.size() >= 2 && value.front() == '"' && value.back() == '"') {
      value = value.substr(1, value.size() - 2);
    }
    out.emplace_back(std::move(name), std::string(value));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> ExpandConfigFile(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  std::string path;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--") break;
    for (const char* prefix : {"--config=", "-config="}) {
      if (absl::StartsWith(args[i], prefix)) path = args[i].substr(std::strlen(prefix));
    }
    if ((args[i] == "--config" || args[i] == "-config") && i + 1 < args.size()) path = args[i + 1];
  }
  if (path.empty()) return args;
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--config: cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> settings =
      ParseConfigText(text.str(), path);
  if (!settings.ok()) return settings.status();
  std::vector<std::string> from_file;
  for (const auto& [name, value] : *settings) {
    if (name == "config") {
      return absl::InvalidArgumentError(absl::StrCat(path, ": 'config' cannot be set in a config"));
    }
    if (absl::FindCommandLineFlag(name) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": unknown setting '", name, "' (not a flag of ", args[0], ")"));
    }
    from_file.push_back(absl::StrCat("--", name, "=", value));
  }
  args.insert(args.begin() + 1, from_file.begin(), from_file.end());
  return args;
}

bool IsSecretFlag(absl::string_view name) {
  for (const char* suffix : {"token", "secret", "password"}) {
    if (absl::EndsWith(name, suffix)) return true;
  }
  return false;
}

std::string EffectiveConfig(absl::FunctionRef<bool(absl::string_view file)> in_file) {
  std::vector<std::string> parts;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!in_file(flag->Filename())) continue;
    parts.push_back(absl::StrCat(
        name, "=",
        IsSecretFlag(name) && !flag->CurrentValue().empty() ? "<redacted>" : flag->CurrentValue()));
  }
  std::sort(parts.begin(), parts.end());
  return absl::StrJoin(parts, " ");
}

absl::Status SetUpLogging(const std::string& format, const std::string& level) {
  const spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log_level: '", level, "' is not trace, debug, info, warn, error, critical or off"));
  }
  if (format == "json") {
    auto logger = spdlog::stderr_logger_mt("kvtrie");
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%f%z","level":"%l","logger":"%n","pid":%P,"thread":%t,)"
        R"("msg":"%*"})");
    logger->set_formatter(std::move(formatter));
    spdlog::set_default_logger(logger);
  } else if (format == "text") {
    spdlog::set_default_logger(spdlog::stderr_color_mt("kvtrie"));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_format: '", format, "' is not text or json"));
  }
  spdlog::set_level(lvl);
  return absl::OkStatus();
}

}  // namespace kvtrie
