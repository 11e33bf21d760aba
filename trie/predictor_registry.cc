// PredictorRegistry and LearnQueue (trie/predictor_registry.h).
#include "trie/predictor_registry.h"

#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "trie/error_reason.h"

namespace kvtrie {

PredictorRegistry::PredictorRegistry(const BlockGeometry& geometry, const PredictorOptions& options,
                                     Loader loader)
    : geometry_(geometry), options_(options), loader_(std::move(loader)) {}

void PredictorRegistry::SetStateLocked(Version* v, std::shared_ptr<const PredictorState> state) {
  v->description = state->Describe();
  v->memory_bytes = state->memory_bytes();
  v->last_use = ++uses_;
  v->state = std::move(state);
}

void PredictorRegistry::TrimResidentLocked() {
  std::vector<std::pair<uint64_t, uint32_t>> resident;  // (last use, version)
  for (const auto& [version, v] : versions_) {
    if (v.state && version != latest_) resident.emplace_back(v.last_use, version);
  }
  if (resident.size() <= options_.resident_versions) return;
  std::sort(resident.begin(), resident.end());
  for (size_t i = 0; i + options_.resident_versions < resident.size(); ++i) {
    versions_.at(resident[i].second).state.reset();  // readers holding it keep their copy
  }
}

void PredictorRegistry::RecoverVersion(uint32_t version,
                                       absl::StatusOr<std::shared_ptr<const PredictorState>> state,
                                       uint64_t state_bytes, uint64_t tokens_learned) {
  absl::MutexLock lock(&mu_);
  Version& v = versions_[version];
  v.state_bytes = state_bytes;
  v.tokens_learned = tokens_learned;
  if (state.ok()) {
    SetStateLocked(&v, *std::move(state));
    latest_ = std::max(latest_, version);
  } else {
    v.error = state.status();
  }
  max_version_ = std::max(max_version_, version);
  TrimResidentLocked();
}

void PredictorRegistry::AddDependent(uint32_t version, int sign) {
  if (version == 0) return;
  absl::MutexLock lock(&mu_);
  auto it = versions_.find(version);
  if (it == versions_.end()) return;
  if (sign > 0) {
    ++it->second.dependents;
  } else if (it->second.dependents > 0) {
    --it->second.dependents;
  }
}

void PredictorRegistry::AddBytesSaved(uint32_t version, double bytes) {
  if (version == 0 || !(bytes > 0)) return;
  absl::MutexLock lock(&mu_);
  auto it = versions_.find(version);
  if (it == versions_.end()) return;
  it->second.bytes_saved += bytes;
  bytes_saved_ += bytes;
}

bool PredictorRegistry::HasVersion(uint32_t version) const {
  absl::MutexLock lock(&mu_);
  return versions_.contains(version);
}

std::shared_ptr<const PredictorState> PredictorRegistry::AcquireLatest() {
  if (!options_.learn) return nullptr;
  absl::MutexLock lock(&mu_);
  if (latest_ == 0) return nullptr;
  Version& v = versions_.at(latest_);
  ++v.pending;
  return v.state;
}

void PredictorRegistry::Release(uint32_t version) {
  if (version == 0) return;
  absl::MutexLock lock(&mu_);
  auto it = versions_.find(version);
  if (it != versions_.end() && it->second.pending > 0) --it->second.pending;
}

uint32_t PredictorRegistry::latest_version() const {
  absl::MutexLock lock(&mu_);
  return latest_;
}

absl::StatusOr<std::shared_ptr<const PredictorState>> PredictorRegistry::AcquireVersion(
    uint32_t version) {
  auto not_kept = [&] {
    return WithErrorReason(
        absl::FailedPreconditionError(absl::StrCat(
            "predictor_version: version ", version,
            " is not kept by this namespace and model; the latest is ", latest_version(),
            " (0 = none): fetch it with GetPredictor and encode again")),
        kStalePredictorVersion);
  };
  absl::StatusOr<std::shared_ptr<const PredictorState>> state = Find(version);
  if (absl::IsNotFound(state.status())) return not_kept();
  if (!state.ok()) return state.status();
  {
    absl::MutexLock lock(&mu_);
    auto it = versions_.find(version);
    if (it != versions_.end() && !it->second.freeing) {
      ++it->second.pending;
      return state;
    }
  }
  return not_kept();  // freed since Find
}

std::shared_ptr<const void> PredictorRegistry::Hold(uint32_t version) {
  if (version == 0) return nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = versions_.find(version);
    if (it == versions_.end()) return nullptr;
    ++it->second.readers;
  }
  std::shared_ptr<PredictorRegistry> self = shared_from_this();
  return std::shared_ptr<const void>(self.get(),
                                     [self, version](const void*) { self->ReleaseHold(version); });
}

void PredictorRegistry::ReleaseHold(uint32_t version) {
  absl::MutexLock lock(&mu_);
  auto it = versions_.find(version);
  if (it == versions_.end() || it->second.readers == 0) return;
  const Version& v = it->second;
  if (--it->second.readers == 0 && v.dependents == 0 && v.pending == 0 && version != latest_ &&
      !v.freeing) {
    free_hint_.store(true, std::memory_order_release);
  }
}

absl::Status PredictorRegistry::CheckLocked(uint32_t version) const {
  auto it = versions_.find(version);
  if (it == versions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("version: predictor state version ", version, " is not stored"));
  }
  if (!it->second.error.ok()) {
    return absl::DataLossError(absl::StrCat("predictor state version ", version,
                                            " is unreadable: ", it->second.error.message()));
  }
  return absl::OkStatus();
}

absl::Status PredictorRegistry::Check(uint32_t version) const {
  absl::MutexLock lock(&mu_);
  return CheckLocked(version);
}

absl::StatusOr<std::shared_ptr<const PredictorState>> PredictorRegistry::Find(uint32_t version) {
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckLocked(version); !s.ok()) return s;
    auto it = versions_.find(version);
    if (it->second.state) {
      it->second.last_use = ++uses_;
      return it->second.state;
    }
  }
  // Not resident: read it back with no lock held (a concurrent Find may read it too).
  if (!loader_) return absl::InternalError("predictor registry: no loader");
  absl::StatusOr<std::shared_ptr<const PredictorState>> state = loader_(version);
  if (state.ok() && (*state)->version() != version) {
    state =
        absl::DataLossError(absl::StrCat("the stored state names version ", (*state)->version()));
  }
  absl::MutexLock lock(&mu_);
  auto it = versions_.find(version);
  if (!state.ok()) {
    if (absl::IsDataLoss(state.status()) && it != versions_.end())
      it->second.error = state.status();
    if (absl::IsNotFound(state.status())) {
      return absl::NotFoundError(
          absl::StrCat("version: predictor state version ", version, " is not stored"));
    }
    return absl::Status(state.status().code(),
                        absl::StrCat("predictor state version ", version,
                                     " is unreadable: ", state.status().message()));
  }
  if (it != versions_.end() && !it->second.state) {
    SetStateLocked(&it->second, *state);
    TrimResidentLocked();
  }
  return *state;
}

absl::StatusOr<bool> PredictorRegistry::Observe(absl::Span<const uint8_t> kv,
                                                absl::Span<const int32_t> tokens,
                                                uint32_t first_position, int32_t previous_token) {
  absl::MutexLock learn(&learn_mu_);
  if (!learner_error_.ok()) return learner_error_;
  if (!learner_) {
    LearnerOptions lo;
    lo.max_bytes = options_.memory_bytes;
    lo.fit_linear = options_.cross_layer;
    lo.fit_klt = options_.cross_layer;
    absl::StatusOr<std::unique_ptr<PredictorLearner>> l = PredictorLearner::Create(geometry_, lo);
    if (!l.ok()) {
      learner_error_ = l.status();
      return learner_error_;
    }
    learner_ = *std::move(l);
  }
  if (absl::Status s = learner_->Observe(kv, tokens, first_position, previous_token); !s.ok()) {
    return s;
  }
  observations_.fetch_add(1, std::memory_order_relaxed);
  tokens_since_fit_ += tokens.size();
  const size_t bytes = learner_->memory_bytes();
  {
    absl::MutexLock lock(&mu_);
    learner_bytes_ = bytes;
  }
  return tokens_since_fit_ >= std::max<uint64_t>(options_.refit_every_tokens, 1);
}

absl::StatusOr<std::shared_ptr<const PredictorState>> PredictorRegistry::Fit() {
  absl::MutexLock learn(&learn_mu_);
  if (!learner_) return absl::FailedPreconditionError("predictor: nothing observed");
  uint32_t next = 0;
  {
    absl::MutexLock lock(&mu_);
    next = max_version_ + 1;
  }
  tokens_since_fit_ = 0;
  return learner_->Fit(next);
}

void PredictorRegistry::Publish(std::shared_ptr<const PredictorState> state, uint64_t state_bytes) {
  absl::MutexLock lock(&mu_);
  const uint32_t version = state->version();
  Version& v = versions_[version];
  v.tokens_learned = state->tokens_learned();
  v.state_bytes = state_bytes;
  SetStateLocked(&v, std::move(state));
  latest_ = std::max(latest_, version);
  max_version_ = std::max(max_version_, version);
  TrimResidentLocked();
  fits_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<uint32_t> PredictorRegistry::TakeUnused() {
  absl::MutexLock lock(&mu_);
  std::vector<uint32_t> out;
  for (auto& [version, v] : versions_) {
    if (version == latest_ || v.freeing || v.dependents != 0 || v.pending != 0 || v.readers != 0) {
      continue;
    }
    v.freeing = true;
    out.push_back(version);
  }
  return out;
}

void PredictorRegistry::Forget(const std::vector<uint32_t>& versions) {
  absl::MutexLock lock(&mu_);
  for (uint32_t version : versions) {
    if (versions_.erase(version)) freed_.fetch_add(1, std::memory_order_relaxed);
  }
}

void PredictorRegistry::Unmark(const std::vector<uint32_t>& versions) {
  absl::MutexLock lock(&mu_);
  for (uint32_t version : versions) {
    if (auto it = versions_.find(version); it != versions_.end()) it->second.freeing = false;
  }
}

uint64_t PredictorRegistry::StateBytes(uint32_t version) const {
  absl::MutexLock lock(&mu_);
  auto it = versions_.find(version);
  return it == versions_.end() ? 0 : it->second.state_bytes;
}

std::vector<PredictorVersionView> PredictorRegistry::Versions() const {
  absl::MutexLock lock(&mu_);
  std::vector<PredictorVersionView> out;
  for (const auto& [version, v] : versions_) {
    PredictorVersionView view;
    view.version = version;
    view.state_bytes = v.state_bytes;
    view.memory_bytes = v.state ? v.memory_bytes : 0;
    view.tokens_learned = v.tokens_learned;
    view.dependents = v.dependents;
    view.bytes_saved = static_cast<uint64_t>(v.bytes_saved);
    view.latest = version == latest_;
    view.description = v.description;
    if (!v.error.ok()) view.error = std::string(v.error.message());
    out.push_back(std::move(view));
  }
  return out;
}

void PredictorRegistry::AddStats(StoreStats* s) const {
  {
    absl::MutexLock lock(&mu_);
    s->predictor_versions += versions_.size();
    s->predictor_memory_bytes += learner_bytes_;
    s->predictor_bytes_saved += static_cast<uint64_t>(bytes_saved_);
    for (const auto& [version, v] : versions_) {
      s->predictor_state_bytes += v.state_bytes;
      if (v.state) s->predictor_memory_bytes += v.memory_bytes;
      s->blocks_on_learned += v.dependents;
      if (version == latest_) s->predictor_tokens_learned += v.tokens_learned;
    }
  }
  const auto get = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  s->predictor_fits += get(fits_);
  s->predictor_observations += get(observations_);
  s->predictor_observations_dropped += get(observations_dropped_);
  s->predictor_versions_freed += get(freed_);
  s->predictor_encoded_observations += get(encoded_observed_);
  s->predictor_encoded_dropped += get(encoded_dropped_);
}

std::vector<uint32_t> SpreadSample(uint32_t n, uint32_t k, uint64_t seed) {
  k = std::min(n, k);
  std::vector<uint32_t> out;
  out.reserve(k);
  if (k == 0) return out;
  // Index i = floor((i + u) * n / k) with u in [0, 1) from the seed: one in each stride of n / k
  // (>= 1) blocks, strictly ascending, the last < n.
  const uint64_t u = seed % 1024;  // u = this / 1024
  for (uint64_t i = 0; i < k; ++i) {
    out.push_back(static_cast<uint32_t>(((i * 1024 + u) * n) / (uint64_t{k} * 1024)));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// LearnQueue

LearnQueue::LearnQueue(uint64_t max_bytes) : max_bytes_(max_bytes) {
  thread_ = std::thread([this] { Run(); });
}

LearnQueue::~LearnQueue() { Stop(); }

bool LearnQueue::Push(uint64_t bytes, std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  if (stop_ || bytes_ + bytes > max_bytes_) return false;
  bytes_ += bytes;
  jobs_.emplace_back(bytes, std::move(job));
  return true;
}

std::vector<bool> LearnQueue::PushSample(std::vector<Job> jobs, uint64_t seed) {
  std::vector<bool> queued(jobs.size(), false);
  if (jobs.empty()) return queued;
  uint64_t total = 0;
  for (const Job& j : jobs) total += j.first;
  const uint64_t mean = std::max<uint64_t>(1, total / jobs.size());
  std::vector<Job> dropped;  // destroyed after the lock is released (their holds release)
  {
    absl::MutexLock lock(&mu_);
    const uint64_t free = stop_ || bytes_ >= max_bytes_ ? 0 : max_bytes_ - bytes_;
    const uint64_t fit = std::min<uint64_t>(free / mean, jobs.size());
    std::vector<bool> chosen(jobs.size(), false);
    for (uint32_t i :
         SpreadSample(static_cast<uint32_t>(jobs.size()), static_cast<uint32_t>(fit), seed)) {
      chosen[i] = true;
    }
    for (size_t i = 0; i < jobs.size(); ++i) {
      // A block larger than the mean may not fit after all: it is dropped like the unchosen.
      if (chosen[i] && bytes_ + jobs[i].first <= max_bytes_) {
        bytes_ += jobs[i].first;
        jobs_.push_back(std::move(jobs[i]));
        queued[i] = true;
      } else {
        dropped.push_back(std::move(jobs[i]));
      }
    }
  }
  return queued;
}

void LearnQueue::Drain() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](LearnQueue* q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) {
        return q->stop_ || (q->jobs_.empty() && !q->running_job_);
      },
      this));
}

void LearnQueue::Stop() {
  std::deque<Job> dropped;  // destroyed with no lock held: a job's hold takes a registry's lock
  {
    absl::MutexLock lock(&mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
    dropped.swap(jobs_);
    bytes_ = 0;
  }
  if (thread_.joinable()) thread_.join();
}

void LearnQueue::Run() {
  pthread_setname_np(pthread_self(), "kvtrie-learn");
  // Best effort: a failure (e.g. a seccomp profile that forbids it) leaves the default priority.
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), kLearnerNice);
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](LearnQueue* q)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) { return q->stop_ || !q->jobs_.empty(); },
          this));
      if (stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
      running_job_ = true;
    }
    job.second();
    job.second = nullptr;  // what it holds (a predictor version) goes before Drain returns
    absl::MutexLock lock(&mu_);
    bytes_ -= std::min(bytes_, job.first);
    running_job_ = false;
  }
}

}  // namespace kvtrie
