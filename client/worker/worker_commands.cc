// kvtrie-worker run / eval: the subcommands that talk to a kvtrie server.
#include "client/worker/worker_commands.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/client_flags.h"
#include "client/shard_flags.h"
#include "client/worker/cached_inference.h"
#include "client/worker/worker_ops.h"

ABSL_DECLARE_FLAG(std::string, prompt);
ABSL_DECLARE_FLAG(int, steps);
ABSL_DECLARE_FLAG(std::string, text_file);

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "run/eval: kvtrie server HOST:PORT (run: or --shards / --shards_dns)");
ABSL_FLAG(std::string, ns, "", "run: namespace; eval: namespace prefix (default: unique per run)");
ABSL_FLAG(std::string, encoding, "lossless",
          "run: how new blocks are stored, NAME[@REL_RMS][/BITS] (see --settings)");
ABSL_FLAG(std::string, settings, "lossless,int8,kivi2,turboquant/4,residual@0.05,residual@0.02",
          "eval: comma-separated codec settings NAME[@REL_RMS][/BITS]; NAME: raw, lossless, "
          "residual, int8, kivi2, turboquant");
ABSL_FLAG(int, context, 256, "eval: context tokens per window (BOS included; multiple of 16)");
ABSL_FLAG(int, continuation, 128, "eval: continuation tokens scored per window");
ABSL_FLAG(int, max_windows, 64, "eval: at most this many windows of the text");

namespace kvtrie::worker {
namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvtrie-worker: %s\n", s.ToString().c_str());
  return 1;
}

int Run(const LlamaModel& model) {
  absl::StatusOr<EvalSetting> setting = ParseEvalSetting(absl::GetFlag(FLAGS_encoding));
  if (!setting.ok()) return Fail(setting.status());
  ClientOptions co;
  co.target = absl::GetFlag(FLAGS_target);
  if (absl::Status s = ApplyClientFlags(&co); !s.ok()) return Fail(s);
  co.ns = absl::GetFlag(FLAGS_ns);
  RunOptions options;
  options.steps = static_cast<size_t>(std::max(0, absl::GetFlag(FLAGS_steps)));
  options.put.encoding = setting->encoding;
  options.put.target_rel_rms = setting->target_rel_rms;
  options.put.bits = setting->bits;
  ApplyPutFlags(&options.put);  // --encode_on_client
  absl::StatusOr<RunResult> r;
  std::string lost;
  if (ShardFlagsGiven()) {  // --shards / --shards_dns: the prompt's owner shard, a lost one misses
    absl::StatusOr<std::unique_ptr<ShardedClient>> sharded = ShardedClientFromFlags(co);
    if (!sharded.ok()) return Fail(sharded.status());
    r = RunWithCache(model, **sharded, absl::GetFlag(FLAGS_prompt), options);
    if (r.ok()) {
      const std::vector<uint32_t>& t = r->prompt_tokens;
      const ShardedClient::Counters c = (*sharded)->counters();
      std::printf("shard: %s (%lu calls lost to a down shard, %lu puts skipped)\n",
                  (*sharded)->OwnerOf(model.model_id(), t).name.c_str(),
                  static_cast<unsigned long>(c.lost_calls),
                  static_cast<unsigned long>(c.puts_skipped));
    }
  } else {
    std::unique_ptr<Client> client = Client::Create(co);
    r = RunWithCache(model, *client, absl::GetFlag(FLAGS_prompt), options);
  }
  if (!r.ok()) return Fail(r.status());
  std::printf(
      "prompt: %zu tokens; reused %zu from kvtrie, computed %zu (+%zu logits-only pass); "
      "stored %zu new blocks (%zu deduplicated)\n",
      r->prompt_tokens.size(), r->reused_tokens, r->computed_tokens, r->logits_only_passes,
      r->stored_blocks, r->deduplicated_blocks);
  std::printf("%s\n", r->text.c_str());
  return 0;
}

double Stddev(const std::vector<double>& v) {
  if (v.size() < 2) return 0;
  double mean = 0, ss = 0;
  for (double x : v) mean += x;
  mean /= static_cast<double>(v.size());
  for (double x : v) ss += (x - mean) * (x - mean);
  return std::sqrt(ss / static_cast<double>(v.size() - 1));
}

int Eval(const LlamaModel& model) {
  const std::string text_file = absl::GetFlag(FLAGS_text_file);
  if (text_file.empty()) return Fail(absl::InvalidArgumentError("eval: --text_file is required"));
  absl::StatusOr<std::string> text = ReadTextFile(text_file);
  if (!text.ok()) return Fail(text.status());
  std::vector<EvalSetting> settings;
  for (absl::string_view s :
       absl::StrSplit(absl::GetFlag(FLAGS_settings), ',', absl::SkipWhitespace())) {
    absl::StatusOr<EvalSetting> setting = ParseEvalSetting(s);
    if (!setting.ok()) return Fail(setting.status());
    PutOptions put;
    ApplyPutFlags(&put);  // --encode_on_client
    setting->encode_on_client = put.encode_on_client;
    setting->learned_lossless = put.learned_lossless;
    settings.push_back(*setting);
  }
  // The whole text (not --max_chars): windows are cut from it in order.
  const std::vector<uint32_t> tokens = model.tokenizer().Encode(*text, true, false);
  const std::vector<EvalWindow> windows =
      MakeWindows(tokens, absl::GetFlag(FLAGS_context), absl::GetFlag(FLAGS_continuation),
                  absl::GetFlag(FLAGS_max_windows));
  if (windows.empty()) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "eval: ", text_file, " has ", tokens.size(), " tokens, too few for one window of ",
        absl::GetFlag(FLAGS_context), " + ", absl::GetFlag(FLAGS_continuation))));
  }
  ClientOptions co;
  co.target = absl::GetFlag(FLAGS_target);
  if (absl::Status s = ApplyClientFlags(&co); !s.ok()) return Fail(s);
  std::string ns = absl::GetFlag(FLAGS_ns);
  if (ns.empty()) ns = absl::StrCat("eval-", getpid(), "-", std::time(nullptr), "-");
  absl::StatusOr<std::vector<EvalRow>> rows = EvalRoundTrip(model, co, ns, windows, settings, 16);
  if (!rows.ok()) return Fail(rows.status());
  std::printf("%s: %zu windows x (%d context + %d continuation tokens)\n", text_file.c_str(),
              windows.size(), absl::GetFlag(FLAGS_context), absl::GetFlag(FLAGS_continuation));
  std::printf(
      "| setting | bits/component | ratio vs fp16 | rel RMS K | rel RMS V | NLL bits/token "
      "| baseline | ΔNLL %% | window ΔNLL sd %% |\n|---|---|---|---|---|---|---|---|---|\n");
  for (const EvalRow& r : *rows) {
    std::printf("| %s | %.3f | %.2fx | %.4f | %.4f | %.4f | %.4f | %+.3f | %.3f |\n",
                r.setting.c_str(), r.bits_per_component, r.ratio_vs_fp16, r.rel_rms_k, r.rel_rms_v,
                r.nll_bits, r.baseline_nll_bits, r.delta_nll_pct, Stddev(r.window_delta_pct));
  }
  return 0;
}

}  // namespace

bool RunServerCommand(const std::string& command, const LlamaModel& model, int* rc) {
  if (command == "run") {
    *rc = Run(model);
    return true;
  }
  if (command == "eval") {
    *rc = Eval(model);
    return true;
  }
  return false;
}

}  // namespace kvtrie::worker
