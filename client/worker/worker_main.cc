// kvtrie-worker — the reference inference worker (a real Llama model on CPU).
//
//   kvtrie-worker dump --text_file=F --out=DIR [--max_tokens=512] [--max_chars=3000]
//   kvtrie-worker generate [--prompt=TEXT] [--steps=N]
//
// --model defaults to $KVTRIE_MODEL, else ../shared/data/stories260K/stories260K.gguf next to the
// source tree.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/worker/llama_model.h"
#include "client/worker/worker_commands.h"
#include "client/worker/worker_ops.h"

ABSL_FLAG(std::string, model, "",
          "GGUF model (default: $KVTRIE_MODEL, else the shared stories260K)");
ABSL_FLAG(std::string, text_file, "", "dump/eval: input text file");
ABSL_FLAG(std::string, out, "", "dump: output folder");
ABSL_FLAG(int, max_tokens, 512, "dump: at most this many tokens (BOS included)");
ABSL_FLAG(int, max_chars, 3000, "dump: the first this many characters of the text");
ABSL_FLAG(std::string, prompt, "", "generate/run: prompt text");
ABSL_FLAG(int, steps, 64, "generate/run: tokens to generate");

namespace kvtrie::worker {
namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvtrie-worker: %s\n", s.ToString().c_str());
  return 1;
}

int Dump(const LlamaModel& model) {
  const std::string text_file = absl::GetFlag(FLAGS_text_file);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (text_file.empty() || out.empty()) {
    return Fail(absl::InvalidArgumentError("dump: --text_file and --out are required"));
  }
  absl::StatusOr<std::string> text = ReadTextFile(text_file);
  if (!text.ok()) return Fail(text.status());
  absl::StatusOr<KvDump> dump =
      DumpText(model, *text, absl::GetFlag(FLAGS_max_tokens), absl::GetFlag(FLAGS_max_chars));
  if (!dump.ok()) return Fail(dump.status());
  if (absl::Status s = WriteKvDump(out, *dump); !s.ok()) return Fail(s);
  double sum = 0;
  for (size_t i = 1; i < dump->surprisal_bits.size(); ++i) sum += dump->surprisal_bits[i];
  const size_t scored = dump->num_tokens() > 1 ? dump->num_tokens() - 1 : 1;
  std::printf("wrote %s: %zu tokens, mean surprisal %.3f bits\n", out.c_str(), dump->num_tokens(),
              sum / static_cast<double>(scored));
  return 0;
}

int Generate(const LlamaModel& model) {
  absl::StatusOr<Generation> g =
      GenerateGreedy(model, absl::GetFlag(FLAGS_prompt), absl::GetFlag(FLAGS_steps));
  if (!g.ok()) return Fail(g.status());
  std::printf("%s\n", g->text.c_str());
  return 0;
}

}  // namespace
}  // namespace kvtrie::worker

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "kvtrie-worker <dump|generate|run|eval> [flags]\n"
      "  dump --text_file=F --out=DIR [--max_tokens=512] [--max_chars=3000]\n"
      "  generate [--prompt=TEXT] [--steps=N]\n"
      "  run --target=HOST:PORT --prompt=TEXT [--steps=N] [--encoding=lossless]\n"
      "      [--shards=NAME=HOST:PORT,... | --shards_dns=NAME: the prompt's owner shard]\n"
      "      [--encode_on_client=false: send the KV dense, the server encodes]\n"
      "  eval --target=HOST:PORT --text_file=F [--context=N] [--continuation=N]");
  absl::FlagsUsageConfig usage;  // --help lists the worker's own flags
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "client/worker/") ||
           absl::StrContains(file, "client_flags.cc") || absl::StrContains(file, "shard_flags.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
    return 2;
  }
  const std::string command = args[1];
  std::string path = absl::GetFlag(FLAGS_model);
  if (path.empty()) path = kvtrie::worker::DefaultModelPath(KVTRIE_SOURCE_DIR);
  absl::StatusOr<std::unique_ptr<kvtrie::worker::LlamaModel>> model =
      kvtrie::worker::LlamaModel::Load(path);
  if (!model.ok()) return kvtrie::worker::Fail(model.status());
  if (command == "dump") return kvtrie::worker::Dump(**model);
  if (command == "generate") return kvtrie::worker::Generate(**model);
  if (int rc = 0; kvtrie::worker::RunServerCommand(command, **model, &rc)) return rc;
  std::fprintf(stderr, "kvtrie-worker: unknown command \"%s\"\n%s\n", command.c_str(),
               absl::ProgramUsageMessage().data());
  return 2;
}
