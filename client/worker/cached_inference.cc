#include "client/worker/cached_inference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/worker/worker_ops.h"

namespace kvtrie::worker {
namespace {

// Put wants a real number per token: unknown (NaN) surprisal of reused tokens is sent as 0.
KvDump ForPut(KvDump kv) {
  for (float& s : kv.surprisal_bits) {
    if (std::isnan(s)) s = 0.0f;
  }
  return kv;
}

double Mean(const std::vector<float>& v, size_t begin, size_t end) {
  double sum = 0;
  for (size_t i = begin; i < end; ++i) sum += v[i];
  return end > begin ? sum / static_cast<double>(end - begin) : 0.0;
}

// RunWithCache over a Client or a ShardedClient (the same Lookup/Get/Put).
template <typename C>
absl::StatusOr<RunResult> RunWithCacheImpl(const LlamaModel& model, C& client,
                                           absl::string_view prompt, const RunOptions& options) {
  if (IsByteDType(options.kv_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_dtype: ", DTypeName(options.kv_dtype),
        ": the reference worker computes with fp16, bf16 or fp32 KV caches, not FP8 / uint8"));
  }
  RunResult r;
  r.prompt_tokens = model.tokenizer().Encode(prompt, /*bos=*/true, /*eos=*/false);
  const std::vector<uint32_t>& tokens = r.prompt_tokens;
  Sequence seq(&model, 0, options.kv_dtype);
  if (tokens.size() > seq.capacity()) {
    return absl::OutOfRangeError(
        absl::StrCat("prompt: ", tokens.size(), " tokens exceed the context of ", seq.capacity()));
  }

  absl::StatusOr<v1::LookupResponse> lookup = client.Lookup(model.model_id(), tokens);
  if (!lookup.ok()) return lookup.status();
  if (lookup->matched_tokens() > 0) {
    absl::StatusOr<KvDump> cached = client.Get(model.model_id(), tokens);
    if (!cached.ok()) return cached.status();
    const size_t m = cached->num_tokens();
    if (m > tokens.size() ||
        !std::equal(cached->token_ids.begin(), cached->token_ids.end(), tokens.begin())) {
      return absl::InternalError("Get returned KV for tokens that are not a prefix of the prompt");
    }
    if (m > 0) {
      if (absl::Status s = seq.LoadPrefix(*cached); !s.ok()) return s;
      if (absl::Status s = seq.RecomputeLastLogits(); !s.ok()) return s;
      r.reused_tokens = m;
      r.logits_only_passes = 1;
    }
  }
  const size_t before = seq.tokens_computed();
  const std::vector<uint32_t> rest(tokens.begin() + static_cast<std::ptrdiff_t>(r.reused_tokens),
                                   tokens.end());
  if (absl::Status s = seq.Extend(rest); !s.ok()) return s;
  r.computed_tokens = seq.tokens_computed() - before;
  r.prompt_surprisal_bits = seq.surprisal_bits();

  const uint32_t bt = options.put.block_tokens == 0 ? 16 : options.put.block_tokens;
  const size_t full_blocks = tokens.size() / bt;
  const size_t stored_blocks = r.reused_tokens / bt;
  if (full_blocks > stored_blocks) {
    PutOptions put = options.put;
    put.block_tokens = bt;
    put.first_block = static_cast<uint32_t>(stored_blocks);
    absl::StatusOr<v1::PutResponse> resp = client.Put(ForPut(seq.ToKvDump(options.kv_dtype)), put);
    if (!resp.ok()) return resp.status();
    r.stored_blocks = resp->blocks_stored();
    r.deduplicated_blocks = resp->blocks_deduplicated();
  }

  absl::StatusOr<std::vector<uint32_t>> gen = ContinueGreedy(model, seq, options.steps);
  if (!gen.ok()) return gen.status();
  r.generated = std::move(*gen);
  r.text = model.tokenizer().DecodeAll(seq.tokens());
  return r;
}

}  // namespace

absl::StatusOr<RunResult> RunWithCache(const LlamaModel& model, Client& client,
                                       absl::string_view prompt, const RunOptions& options) {
  return RunWithCacheImpl(model, client, prompt, options);
}

absl::StatusOr<RunResult> RunWithCache(const LlamaModel& model, ShardedClient& client,
                                       absl::string_view prompt, const RunOptions& options) {
  return RunWithCacheImpl(model, client, prompt, options);
}

absl::StatusOr<RunResult> RunWithoutCache(const LlamaModel& model, absl::string_view prompt,
                                          const RunOptions& options) {
  if (IsByteDType(options.kv_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_dtype: ", DTypeName(options.kv_dtype),
        ": the reference worker computes with fp16, bf16 or fp32 KV caches, not FP8 / uint8"));
  }
  RunResult r;
  r.prompt_tokens = model.tokenizer().Encode(prompt, /*bos=*/true, /*eos=*/false);
  Sequence seq(&model, 0, options.kv_dtype);
  if (absl::Status s = seq.Extend(r.prompt_tokens); !s.ok()) return s;
  r.computed_tokens = seq.tokens_computed();
  r.prompt_surprisal_bits = seq.surprisal_bits();
  absl::StatusOr<std::vector<uint32_t>> gen = ContinueGreedy(model, seq, options.steps);
  if (!gen.ok()) return gen.status();
  r.generated = std::move(*gen);
  r.text = model.tokenizer().DecodeAll(seq.tokens());
  return r;
}

absl::StatusOr<EvalSetting> ParseEvalSetting(absl::string_view text) {
  EvalSetting s;
  s.name = std::string(text);
  absl::string_view name = text;
  if (size_t slash = name.find('/'); slash != absl::string_view::npos) {
    if (!absl::SimpleAtoi(name.substr(slash + 1), &s.bits)) {
      return absl::InvalidArgumentError(absl::StrCat("setting ", text, ": bad bit width"));
    }
    name = name.substr(0, slash);
  }
  if (size_t at = name.find('@'); at != absl::string_view::npos) {
    if (!absl::SimpleAtod(name.substr(at + 1), &s.target_rel_rms) || s.target_rel_rms < 0) {
      return absl::InvalidArgumentError(absl::StrCat("setting ", text, ": bad target rel RMS"));
    }
    name = name.substr(0, at);
  }
  static const std::pair<const char*, v1::Encoding> kNames[] = {
      {"raw", v1::ENCODING_RAW},           {"lossless", v1::ENCODING_LOSSLESS},
      {"residual", v1::ENCODING_RESIDUAL}, {"int8", v1::ENCODING_INT8},
      {"kivi2", v1::ENCODING_KIVI2},       {"turboquant", v1::ENCODING_TURBOQUANT}};
  for (const auto& [n, e] : kNames) {
    if (name == n) {
      s.encoding = e;
      return s;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "setting ", text, ": encoding must be raw, lossless, residual, int8, kivi2 or turboquant"));
}

std::vector<EvalWindow> MakeWindows(const std::vector<uint32_t>& tokens, size_t context,
                                    size_t continuation, size_t max_windows) {
  std::vector<EvalWindow> out;
  if (tokens.empty() || context == 0) return out;
  const size_t text_per_window = context - 1 + continuation;  // BOS is added per window
  for (size_t start = 1; start + text_per_window <= tokens.size() && out.size() < max_windows;
       start += text_per_window) {
    EvalWindow w;
    w.tokens.push_back(tokens[0]);
    w.tokens.insert(w.tokens.end(), tokens.begin() + static_cast<std::ptrdiff_t>(start),
                    tokens.begin() + static_cast<std::ptrdiff_t>(start + text_per_window));
    w.context = context;
    out.push_back(std::move(w));
  }
  return out;
}

absl::StatusOr<std::vector<EvalRow>> EvalRoundTrip(const LlamaModel& model,
                                                   const ClientOptions& client_options,
                                                   const std::string& ns_prefix,
                                                   const std::vector<EvalWindow>& windows,
                                                   const std::vector<EvalSetting>& settings,
                                                   uint32_t block_tokens) {
  // The model's own KV: one fp16-KV pass per window gives the baseline NLL and the context KV.
  std::vector<KvDump> contexts;
  std::vector<double> baseline_sum(windows.size());
  for (size_t w = 0; w < windows.size(); ++w) {
    const EvalWindow& win = windows[w];
    if (win.context == 0 || win.context >= win.tokens.size() || win.context % block_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("window ", w, ": context ", win.context,
                                                     " must be a multiple of ", block_tokens,
                                                     " below ", win.tokens.size(), " tokens"));
    }
    Sequence seq(&model, win.tokens.size(), DType::kFp16);
    if (absl::Status s = seq.Extend(win.tokens); !s.ok()) return s;
    baseline_sum[w] = Mean(seq.surprisal_bits(), win.context, win.tokens.size()) *
                      static_cast<double>(win.tokens.size() - win.context);
    contexts.push_back(ForPut(seq.ToKvDump(DType::kFp16, win.context)));
  }

  std::vector<EvalRow> rows;
  for (const EvalSetting& setting : settings) {
    ClientOptions co = client_options;
    co.ns = absl::StrCat(ns_prefix, setting.name);
    std::unique_ptr<Client> client = Client::Create(co);
    EvalRow row;
    row.setting = setting.name;
    double logical = 0, stored = 0, rms_k = 0, rms_v = 0, nll_sum = 0, base_sum = 0;
    size_t blocks = 0;
    for (size_t w = 0; w < windows.size(); ++w) {
      const EvalWindow& win = windows[w];
      PutOptions put;
      put.encoding = setting.encoding;
      put.target_rel_rms = setting.target_rel_rms;
      put.bits = setting.bits;
      put.block_tokens = block_tokens;
      put.encode_on_client = setting.encode_on_client;
      put.learned_lossless = setting.learned_lossless;
      absl::StatusOr<v1::PutResponse> resp = client->Put(contexts[w], put);
      if (!resp.ok()) return resp.status();
      for (const v1::BlockResult& b : resp->blocks()) {
        if (b.disposition() == v1::BLOCK_DEDUPLICATED) continue;
        logical += static_cast<double>(b.bytes_logical());
        stored += static_cast<double>(b.bytes_stored());
        rms_k += b.rel_rms_error_k();
        rms_v += b.rel_rms_error_v();
        ++blocks;
      }
      const std::vector<uint32_t> ctx(
          win.tokens.begin(), win.tokens.begin() + static_cast<std::ptrdiff_t>(win.context));
      absl::StatusOr<KvDump> got = client->Get(model.model_id(), ctx);
      if (!got.ok()) return got.status();
      if (got->num_tokens() != win.context) {
        return absl::InternalError(absl::StrCat("setting ", setting.name, " window ", w, ": Get ",
                                                "returned ", got->num_tokens(), " of ", win.context,
                                                " context tokens"));
      }
      Sequence seq(&model, win.tokens.size(), DType::kFp16);
      if (absl::Status s = seq.LoadPrefix(*got); !s.ok()) return s;
      if (absl::Status s = seq.RecomputeLastLogits(); !s.ok()) return s;
      const std::vector<uint32_t> cont(
          win.tokens.begin() + static_cast<std::ptrdiff_t>(win.context), win.tokens.end());
      if (absl::Status s = seq.Extend(cont); !s.ok()) return s;
      const double n = static_cast<double>(cont.size());
      const double nll = Mean(seq.surprisal_bits(), win.context, win.tokens.size()) * n;
      nll_sum += nll;
      base_sum += baseline_sum[w];
      row.window_delta_pct.push_back(100.0 * (nll - baseline_sum[w]) / baseline_sum[w]);
      row.window_nll_sum.push_back(nll);
      row.window_baseline_sum.push_back(baseline_sum[w]);
      row.continuation_tokens += cont.size();
      ++row.windows;
    }
    if (stored > 0) {
      row.bits_per_component = 16.0 * stored / logical;  // logical bytes are fp16
      row.ratio_vs_fp16 = logical / stored;
    }
    if (blocks > 0) {
      row.rel_rms_k = rms_k / static_cast<double>(blocks);
      row.rel_rms_v = rms_v / static_cast<double>(blocks);
    }
    const double tokens = static_cast<double>(std::max<size_t>(row.continuation_tokens, 1));
    row.nll_bits = nll_sum / tokens;
    row.baseline_nll_bits = base_sum / tokens;
    row.delta_nll_pct = 100.0 * (nll_sum - base_sum) / base_sum;
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace kvtrie::worker
