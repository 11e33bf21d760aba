// bench/worker_bench — ΔNLL vs bits/component for kvtrie's codec settings and the per-vector
// baselines, on real KV caches of a real model over several real texts (issue 6).
//
// For every text, windows of BOS + (context - 1) text tokens + continuation tokens are cut in
// order; for each setting the context KV (fp16) goes through a kvtrie server (Put, then Get
// RECONSTRUCTED) and the continuation is scored from it. ΔNLL % = 100 * (NLL from round-tripped
// KV - NLL from the model's own KV) / the latter, pooled over all continuation tokens; the spread
// is the standard deviation over windows and the standard error of the pooled mean.
//
//   kvtrie-server --listen=127.0.0.1:0 --port_file=/tmp/p --data_dir=$(mktemp -d) &
//   worker_bench --target=127.0.0.1:$(cat /tmp/p) --csv=worker_bench.csv --svg=worker_bench.svg
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/worker/cached_inference.h"
#include "client/worker/worker_ops.h"

ABSL_FLAG(std::string, model, "", "GGUF model (default: $KVTRIE_MODEL, else shared stories260K)");
ABSL_FLAG(std::string, target, "127.0.0.1:50051", "kvtrie server HOST:PORT");
ABSL_FLAG(
    std::string, texts,
    "/usr/share/common-licenses/GPL-3,/usr/share/common-licenses/Apache-2.0,"
    "/usr/share/common-licenses/MPL-2.0,/usr/share/common-licenses/GFDL-1.3,"
    "/usr/share/common-licenses/Artistic,/usr/share/common-licenses/LGPL-2.1," KVTRIE_SOURCE_DIR
    "/../shared/data/texts/genesis_1-3.txt",
    "comma-separated text files");
ABSL_FLAG(std::string, settings,
          "lossless,int8,kivi2,turboquant/2,turboquant/3,turboquant/4,residual@0.01,"
          "residual@0.02,residual@0.05,residual@0.1,residual@0.2,residual@0.3",
          "codec settings NAME[@REL_RMS][/BITS]");
ABSL_FLAG(int, context, 256, "context tokens per window (BOS included; multiple of 16)");
ABSL_FLAG(int, continuation, 128, "continuation tokens scored per window");
ABSL_FLAG(int, windows_per_text, 8, "at most this many windows per text");
ABSL_FLAG(std::string, csv, "", "write per-setting rows here");
ABSL_FLAG(std::string, svg, "", "write a ΔNLL vs bits/component plot here");

namespace kvtrie::worker {
namespace {

struct Stats {
  double mean = 0, sd = 0, se = 0;
};
Stats Spread(const std::vector<double>& v) {
  Stats s;
  if (v.empty()) return s;
  for (double x : v) s.mean += x;
  s.mean /= static_cast<double>(v.size());
  if (v.size() > 1) {
    double ss = 0;
    for (double x : v) ss += (x - s.mean) * (x - s.mean);
    s.sd = std::sqrt(ss / static_cast<double>(v.size() - 1));
    s.se = s.sd / std::sqrt(static_cast<double>(v.size()));
  }
  return s;
}

// A scatter plot of ΔNLL % (y) against bits/component (x), one labelled point per setting with
// a ±2 standard-error bar.
void WriteSvg(const std::string& path, const std::vector<EvalRow>& rows,
              const std::vector<Stats>& spread) {
  const double W = 760, H = 460, L = 70, R = 20, T = 30, B = 50;
  double ymin = -1, ymax = 1;
  for (size_t i = 0; i < rows.size(); ++i) {
    ymin = std::min(ymin, rows[i].delta_nll_pct - 2 * spread[i].se);
    ymax = std::max(ymax, rows[i].delta_nll_pct + 2 * spread[i].se);
  }
  const double xmax = 16;
  auto X = [&](double b) { return L + (W - L - R) * b / xmax; };
  auto Y = [&](double d) { return T + (H - T - B) * (ymax - d) / (ymax - ymin); };
  std::ofstream o(path);
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
    << "' font-family='sans-serif' font-size='11'>\n<rect width='100%' height='100%' "
       "fill='white'/>\n";
  o << "<line x1='" << L << "' y1='" << Y(0) << "' x2='" << W - R << "' y2='" << Y(0)
    << "' stroke='#888'/>\n";
  o << "<line x1='" << L << "' y1='" << Y(1) << "' x2='" << W - R << "' y2='" << Y(1)
    << "' stroke='#d66' stroke-dasharray='4 3'/><text x='" << W - R - 90 << "' y='" << Y(1) - 4
    << "' fill='#d66'>ΔNLL = 1 %</text>\n";
  o << "<line x1='" << X(2) << "' y1='" << T << "' x2='" << X(2) << "' y2='" << H - B
    << "' stroke='#6a6' stroke-dasharray='4 3'/><text x='" << X(2) + 4 << "' y='" << T + 12
    << "' fill='#6a6'>8x (2 bits)</text>\n";
  for (int b = 0; b <= 16; b += 2) {
    o << "<text x='" << X(b) - 4 << "' y='" << H - B + 16 << "'>" << b << "</text>\n";
  }
  for (int k = 0; k <= 4; ++k) {
    const double d = ymin + (ymax - ymin) * k / 4;
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.2f", d);
    o << "<text x='8' y='" << Y(d) + 4 << "'>" << buf << "</text>\n";
  }
  o << "<text x='" << W / 2 - 60 << "' y='" << H - 12 << "'>bits per K/V component</text>\n";
  o << "<text x='12' y='" << T - 10 << "'>ΔNLL % (±2 s.e.)</text>\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const double x = X(rows[i].bits_per_component), y = Y(rows[i].delta_nll_pct);
    const bool ours = rows[i].setting.rfind("residual", 0) == 0;
    o << "<line x1='" << x << "' y1='" << Y(rows[i].delta_nll_pct - 2 * spread[i].se) << "' x2='"
      << x << "' y2='" << Y(rows[i].delta_nll_pct + 2 * spread[i].se)
      << "' stroke='#999'/>\n<circle cx='" << x << "' cy='" << y << "' r='4' fill='"
      << (ours ? "#1f77b4" : "#ff7f0e") << "'/>\n<text x='" << x + 6 << "' y='" << y - 4 << "'>"
      << rows[i].setting << "</text>\n";
  }
  o << "</svg>\n";
}

int Main() {
  std::string path = absl::GetFlag(FLAGS_model);
  if (path.empty()) path = DefaultModelPath(KVTRIE_SOURCE_DIR);
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(path);
  if (!model.ok()) {
    std::fprintf(stderr, "worker_bench: %s\n", model.status().ToString().c_str());
    return 1;
  }
  std::vector<EvalWindow> windows;
  std::vector<std::pair<std::string, size_t>> text_windows;  // (text, windows)
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_texts), ',', absl::SkipEmpty())) {
    absl::StatusOr<std::string> text = ReadTextFile(std::string(f));
    if (!text.ok()) {
      std::fprintf(stderr, "worker_bench: skipping %s\n", text.status().ToString().c_str());
      continue;
    }
    std::vector<EvalWindow> w =
        MakeWindows((*model)->tokenizer().Encode(*text, true, false), absl::GetFlag(FLAGS_context),
                    absl::GetFlag(FLAGS_continuation), absl::GetFlag(FLAGS_windows_per_text));
    text_windows.emplace_back(std::string(f), w.size());
    windows.insert(windows.end(), w.begin(), w.end());
  }
  std::vector<EvalSetting> settings;
  for (absl::string_view s :
       absl::StrSplit(absl::GetFlag(FLAGS_settings), ',', absl::SkipEmpty())) {
    absl::StatusOr<EvalSetting> setting = ParseEvalSetting(s);
    if (!setting.ok()) {
      std::fprintf(stderr, "worker_bench: %s\n", setting.status().ToString().c_str());
      return 1;
    }
    settings.push_back(*setting);
  }
  ClientOptions co;
  co.target = absl::GetFlag(FLAGS_target);
  const std::string ns = absl::StrCat("bench-", getpid(), "-", std::time(nullptr), "-");
  absl::StatusOr<std::vector<EvalRow>> rows = EvalRoundTrip(**model, co, ns, windows, settings, 16);
  if (!rows.ok()) {
    std::fprintf(stderr, "worker_bench: %s\n", rows.status().ToString().c_str());
    return 1;
  }

  size_t cont = 0;
  for (const EvalWindow& w : windows) cont += w.tokens.size() - w.context;
  std::printf(
      "model %s; %zu windows x (%d context + %d continuation) = %zu continuation tokens "
      "over %zu texts:\n",
      (*model)->model_id().c_str(), windows.size(), absl::GetFlag(FLAGS_context),
      absl::GetFlag(FLAGS_continuation), cont, text_windows.size());
  for (const auto& [f, n] : text_windows) std::printf("  %s: %zu windows\n", f.c_str(), n);
  std::printf(
      "\n| setting | bits/comp | ratio vs fp16 | rel RMS K | rel RMS V | NLL bits/token "
      "| ΔNLL %% | s.e. %% | window sd %% | worst text ΔNLL %% |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<Stats> spread;
  std::ofstream csv;
  if (!absl::GetFlag(FLAGS_csv).empty()) {
    csv.open(absl::GetFlag(FLAGS_csv));
    csv << "setting,bits_per_component,ratio_vs_fp16,rel_rms_k,rel_rms_v,nll_bits,baseline_nll_"
           "bits,delta_nll_pct,se_pct,window_sd_pct,windows,continuation_tokens\n";
  }
  for (const EvalRow& r : *rows) {
    Stats s = Spread(r.window_delta_pct);
    spread.push_back(s);
    // Per text pooled ΔNLL, to show the worst one.
    double worst = 0;
    size_t w0 = 0;
    for (const auto& [f, n] : text_windows) {
      double a = 0, b = 0;
      for (size_t i = w0; i < w0 + n; ++i) {
        a += r.window_nll_sum[i];
        b += r.window_baseline_sum[i];
      }
      w0 += n;
      if (b > 0 && std::fabs(100 * (a - b) / b) > std::fabs(worst)) worst = 100 * (a - b) / b;
    }
    std::printf("| %s | %.3f | %.2fx | %.4f | %.4f | %.4f | %+.3f | %.3f | %.3f | %+.3f |\n",
                r.setting.c_str(), r.bits_per_component, r.ratio_vs_fp16, r.rel_rms_k, r.rel_rms_v,
                r.nll_bits, r.delta_nll_pct, s.se, s.sd, worst);
    if (csv.is_open()) {
      csv << r.setting << ',' << r.bits_per_component << ',' << r.ratio_vs_fp16 << ','
          << r.rel_rms_k << ',' << r.rel_rms_v << ',' << r.nll_bits << ',' << r.baseline_nll_bits
          << ',' << r.delta_nll_pct << ',' << s.se << ',' << s.sd << ',' << r.windows << ','
          << r.continuation_tokens << '\n';
    }
  }
  if (!rows->empty())
    std::printf("\nbaseline NLL (model's own fp16 KV): %.4f bits/token\n",
                rows->front().baseline_nll_bits);
  if (!absl::GetFlag(FLAGS_svg).empty()) WriteSvg(absl::GetFlag(FLAGS_svg), *rows, spread);
  return 0;
}

}  // namespace
}  // namespace kvtrie::worker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvtrie::worker::Main();
}
