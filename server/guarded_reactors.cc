// GuardedService's streaming calls as callback reactors (see server/guarded_service.h): Put reads
// one message at a time, Get and GetPredictor write one at a time while the next is made. Every
// step runs on the handler pool, one at a time per call (Strand); gRPC's callbacks (OnReadDone,
// OnWriteDone, OnCancel) only post steps. A reactor is deleted after gRPC's OnDone and its last
// step, whichever comes later. Get and GetPredictor reactors are listed in
// GuardedService::writers_ from their first step to their OnDone, for the watchdog (WatchLoop).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/crc32c.h"
#include "server/guarded_service.h"

namespace kvtrie {

// Runs a call's steps in the order posted, one at a time, on the handler pool, and deletes the
// call once it is released (OnDone) and no step is queued or running.
class GuardedService::Strand {
 public:
  explicit Strand(TaskPool* pool) : pool_(pool) {}
  virtual ~Strand() = default;
  Strand(const Strand&) = delete;
  Strand& operator=(const Strand&) = delete;

  void Post(std::function<void()> step) {
    bool start = false;
    {
      absl::MutexLock lock(&mu_);
      steps_.push_back(std::move(step));
      start = !running_;
      running_ = true;
    }
    if (start) pool_->Schedule([this] { Drain(); });
  }
  // Runs `step` on this thread at once when no step is queued or running (true); else runs
  // nothing (false). Steps it posts run on the pool after it.
  bool RunInlineIfIdle(const std::function<void()>& step) {
    {
      absl::MutexLock lock(&mu_);
      if (running_) return false;
      running_ = true;
    }
    step();
    bool start = false, remove = false;
    {
      absl::MutexLock lock(&mu_);
      if (steps_.empty()) {
        running_ = false;
        remove = released_;
      } else {
        start = true;
      }
    }
    if (start) {
      pool_->Schedule([this] { Drain(); });
    } else if (remove) {
      delete this;
    }
    return true;
  }
  // gRPC is done with the call (OnDone): no more steps will be posted.
  void Release() {
    bool remove = false;
    {
      absl::MutexLock lock(&mu_);
      released_ = true;
      remove = !running_;
    }
    if (remove) delete this;
  }

 private:
  void Drain() {
    bool remove = false;
    for (;;) {
      std::function<void()> step;
      {
        absl::MutexLock lock(&mu_);
        if (steps_.empty()) {
          running_ = false;
          remove = released_;
          break;
        }
        step = std::move(steps_.front());
        steps_.pop_front();
      }
      step();
    }
    if (remove) delete this;
  }

  TaskPool* const pool_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> steps_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;   // a Drain is scheduled or running
  bool released_ ABSL_GUARDED_BY(mu_) = false;  // OnDone has run
};

namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool IsAuthFailure(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAUTHENTICATED || code == grpc::StatusCode::PERMISSION_DENIED;
}

}  // namespace

// Put: reads a message only when the last one was handled (PutCall, server/put_call.h), admits
// the stream (auth, the namespace replaced, quotas) at its header, and waits for memory without
// a thread. All members are touched by the steps only (one at a time).
class GuardedService::PutReactor final : public grpc::ServerReadReactor<v1::PutRequest>,
                                         public Strand {
 public:
  PutReactor(GuardedService* guard, grpc::CallbackServerContext* context, v1::PutResponse* response)
      : Strand(guard->handlers_.get()),
        guard_(guard),
        context_(context),
        response_(response),
        start_(std::chrono::steady_clock::now()) {
    Post([this] { Begin(); });
  }

  void OnReadDone(bool ok) override {
    // The message is here: from now until the next read is asked for, the time is the server's
    // (its step may wait for a handler thread), never the client's idle time.
    reading_->Touch();
    Post([this, ok] { ReadDone(ok); });
  }
  void OnCancel() override {
    Post([this] { Cancelled(); });
  }
  void OnDone() override { Release(); }

 private:
  void Begin() {
    call_ = guard_->inner_->NewPut(context_);
    Act(call_->Start(guard_->PeerOf(*context_)));
  }

  void Act(PutCall::Next next) {
    switch (next) {
      case PutCall::Next::kRead:
        reading_ = call_->stream();  // lives while the read is outstanding (steps end it)
        StartRead(&request_);
        return;
      case PutCall::Next::kReserve:
        if (cancelled_) {  // no wait for memory on behalf of a client gone
          Act(call_->OnReserved(absl::CancelledError("put: cancelled")));
          return;
        }
        waiting_ = true;
        // Called back at once, when another stream makes room, or at the deadline.
        call_->stream()->ReserveWholeAsync(call_->reserve_bytes(), [this](absl::Status s) {
          Post([this, s = std::move(s)] { Reserved(s); });
        });
        return;
      case PutCall::Next::kDone:
        End(call_->status());
        return;
    }
  }

  void ReadDone(bool ok) {
    if (finished_) return;
    if (!ok) {  // half-closed, cancelled, or a message that did not parse
      Act(call_->OnEnd());
      return;
    }
    if (!seen_header_) {
      seen_header_ = true;
      if (request_.has_header()) {  // else the call names the error
        guard_status_ = Admit();
        if (!guard_status_.ok()) {
          End(guard_status_);
          return;
        }
      }
    }
    Act(call_->OnMessage(&request_));
  }

  void Reserved(const absl::Status& s) {
    waiting_ = false;
    if (finished_) return;
    Act(call_->OnReserved(cancelled_ ? absl::CancelledError("put: cancelled") : s));
  }

  void Cancelled() {
    cancelled_ = true;
    if (finished_) return;
    // A pending read ends with OnReadDone(false); a wait for memory is taken back here (or its
    // outcome is on its way to Reserved).
    if (waiting_ && call_->stream()->CancelWait()) {
      waiting_ = false;
      Act(call_->OnReserved(absl::CancelledError("put: cancelled while waiting for memory")));
    }
  }

  grpc::Status Admit() {
    grpc::Status s = guard_->auth_->Authorize(*context_, request_.header().namespace_(), &caller_);
    if (!s.ok()) return s;
    request_.mutable_header()->set_namespace_(caller_.ns);
    if (caller_.tenant != nullptr) counters_ = guard_->CountersOf(caller_.ns);
    s = guard_->AdmitPut(caller_, request_.header());
    if (!s.ok()) return s;
    admitted_ = true;
    if (guard_->metrics_ != nullptr) guard_->metrics_->AddPutStreams(caller_.ns, 1);
    return grpc::Status::OK;
  }

  void End(grpc::Status s) {
    finished_ = true;
    if (!guard_status_.ok()) s = guard_status_;
    Metrics* metrics = guard_->metrics_;
    const bool authorized = seen_header_ && !IsAuthFailure(guard_status_.error_code());
    std::optional<std::string> ns;  // none: refused before it had a namespace
    if (authorized) ns = caller_.ns;
    if (!authorized && metrics != nullptr && seen_header_)
      metrics->RecordAuthFailure(s.error_code());
    if (s.ok()) {
      *response_ = std::move(*call_->response());
      if (metrics != nullptr) metrics->RecordPut(*ns, *response_);
      if (counters_ != nullptr) {
        counters_->puts++;
        counters_->blocks_stored += response_->blocks_stored();
        counters_->blocks_deduplicated += response_->blocks_deduplicated();
      }
    }
    call_.reset();  // the slot and the reserved bytes, before the client hears back
    if (admitted_) {
      if (counters_ != nullptr) counters_->put_streams.fetch_sub(1);
      if (metrics != nullptr) metrics->AddPutStreams(caller_.ns, -1);
    }
    if (metrics != nullptr) {
      metrics->RecordCall("Put", ns ? &*ns : nullptr, s.error_code(), SecondsSince(start_));
    }
    Finish(s);
  }

  GuardedService* const guard_;
  grpc::CallbackServerContext* const context_;
  v1::PutResponse* const response_;
  const std::chrono::steady_clock::time_point start_;
  std::unique_ptr<PutCall> call_;
  PutLimits::Stream* reading_ = nullptr;  // call_'s stream, set before each StartRead
  v1::PutRequest request_;                // the read in flight lands here
  bool waiting_ = false;                  // for memory (ReserveWholeAsync)
  bool cancelled_ = false;
  bool finished_ = false;
  bool seen_header_ = false;  // the first message arrived
  bool admitted_ = false;
  grpc::Status guard_status_;  // a refusal at the header (auth, quotas)
  Caller caller_;
  NamespaceCounters* counters_ = nullptr;
};

grpc::ServerReadReactor<v1::PutRequest>* GuardedService::Put(grpc::CallbackServerContext* context,
                                                             v1::PutResponse* response) {
  return new PutReactor(this, context, response);
}

// A server-streaming call of grpc::ByteBuffer messages: Open makes the first, Produce each next
// one while the one before is on the wire (one write outstanding: gRPC's rule, and its flow
// control paces the call), Close sees the final status before the client does.
class GuardedService::WriteReactor : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                                     public Strand {
 public:
  void OnWriteDone(bool ok) override {
    write_since_ns_.store(0, std::memory_order_relaxed);
    // The next message, when made, goes on the wire from here (no hand-off between two writes);
    // making the one after it is posted to the pool.
    if (ok && RunInlineIfIdle([this] { NextWrite(); })) return;
    Post([this, ok] { WriteDone(ok); });
  }
  void OnCancel() override {
    Post([this] { Cancelled(); });
  }
  void OnDone() override {
    guard_->RemoveWriter(this);
    Release();
  }

  // The watchdog's check at `now_ns` (GuardedService::WatchLoop, under writers_mu_; the reactor is
  // not released): a write outstanding for `idle_ns` cancels the call; a snapshot older than
  // `age_ns` ends it ABORTED after the write outstanding. Each at most once; 0 = no check.
  void Watch(int64_t now_ns, int64_t idle_ns, int64_t age_ns) {
    const int64_t since = write_since_ns_.load(std::memory_order_relaxed);
    if (idle_ns > 0 && since != 0 && now_ns - since >= idle_ns && !idle_expired_.exchange(true)) {
      const double seconds = static_cast<double>(idle_ns) / 1e9;
      spdlog::warn(
          "{} stream of {}: its client read nothing for {} s, cancelled "
          "(--get_idle_timeout_seconds)",
          method(), context_->peer(), seconds);
      cut_.store(true, std::memory_order_relaxed);
      context_->TryCancel();  // the client sees CANCELLED; the write outstanding fails
      Post([this, seconds] {
        Abandon(grpc::Status(grpc::StatusCode::CANCELLED,
                             absl::StrCat("get: the client read nothing for "
                                          "--get_idle_timeout_seconds=",
                                          seconds)));
      });
      return;
    }
    if (age_ns > 0 && holds_snapshot() && now_ns - opened_ns_ >= age_ns && !aged_.exchange(true)) {
      cut_.store(true, std::memory_order_relaxed);
      const double seconds = static_cast<double>(age_ns) / 1e9;
      spdlog::warn("{} stream of {}: open for {} s, ended ABORTED (--get_max_snapshot_seconds)",
                   method(), context_->peer(), seconds);
      Post([this, seconds] {
        Abandon(grpc::Status(
            grpc::StatusCode::ABORTED,
            absl::StrCat("get: open for more than --get_max_snapshot_seconds=", seconds,
                         " (a Get reads a store snapshot, which keeps every payload deleted or "
                         "evicted since it began on disk); the blocks received are valid: Get the "
                         "rest again")));
      });
    }
  }

  // Whether the folder rule may cut it at `now_ns`: a Get holding its snapshot (not ended by the
  // watchdog yet) that began at least `min_age_ns` ago.
  bool Cuttable(int64_t now_ns, int64_t min_age_ns) const {
    return holds_snapshot() && !cut_.load(std::memory_order_relaxed) &&
           now_ns - opened_ns_ >= min_age_ns;
  }
  int64_t opened_ns() const { return opened_ns_; }
  // The folder rule (GuardedService::WatchLoop, under writers_mu_): ends the call ABORTED after
  // the write outstanding and releases its snapshot now.
  void CutForDisk(uint64_t folder_bytes, uint64_t cut_bytes, uint64_t bound_bytes) {
    if (cut_.exchange(true)) return;
    spdlog::warn(
        "{} stream of {}: ended ABORTED: the data folder holds {} bytes (cut at {}, bound "
        "{}) and it holds a store snapshot",
        method(), context_->peer(), folder_bytes, cut_bytes, bound_bytes);
    Post([this, folder_bytes, cut_bytes, bound_bytes] {
      Abandon(grpc::Status(
          grpc::StatusCode::ABORTED,
          absl::StrCat("get: cut to keep the data folder under its disk bound (", folder_bytes,
                       " bytes, cut at ", cut_bytes, ", bound ", bound_bytes,
                       " = 3 x --disk_bytes + 2 MiB): its store snapshot keeps the payloads "
                       "deleted or evicted since it began on disk; the blocks received are valid: "
                       "Get the rest again")));
    });
  }

 protected:
  WriteReactor(GuardedService* guard, grpc::CallbackServerContext* context,
               const grpc::ByteBuffer* request)
      : Strand(guard->handlers_.get()),
        guard_(guard),
        context_(context),
        request_(*request),
        opened_ns_(absl::GetCurrentTimeNanos()) {
    // The subclass posts Begin once it is constructed (Begin lists it for the watchdog, which
    // calls its virtual methods).
  }

  virtual const char* method() const = 0;
  // Whether the call reads a store snapshot (the watchdog caps its age).
  virtual bool holds_snapshot() const { return false; }
  // Lets go of what the call holds for the messages not yet made (a step; no Produce after).
  virtual void Drop() {}

  virtual grpc::Status Open(grpc::ByteBuffer* first) = 0;
  virtual grpc::Status Produce(grpc::ByteBuffer* next, bool* end) = 0;
  virtual void Close(const grpc::Status& status) = 0;

  void Begin() {
    guard_->AddWriter(this);
    if (grpc::Status s = guard_->CheckSize(request_); !s.ok()) {
      End(s);
      return;
    }
    grpc::Status s = Open(&ready_);
    if (!s.ok()) {
      End(s);
      return;
    }
    has_ready_ = true;
    Advance();
  }

  GuardedService* const guard_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer request_;  // the raw request (shares the call's slices)

 private:
  void ProduceNext() {
    if (end_) return;
    bool end = false;
    grpc::Status s = Produce(&ready_, &end);
    if (!s.ok() || end) {
      end_ = true;
      final_ = s;
    } else {
      has_ready_ = true;
    }
  }
  // With no write outstanding: the next message on the wire (and the one after it made), or
  // the end.
  void Advance() {
    if (finished_ || writing_) return;
    if (cancelled_) {
      End(grpc::Status(grpc::StatusCode::CANCELLED, "client gone"));
      return;
    }
    if (has_ready_) {
      in_flight_ = std::move(ready_);
      ready_.Clear();
      has_ready_ = false;
      writing_ = true;
      write_since_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
      StartWrite(&in_flight_);
      if (!end_) ProduceNext();
      return;
    }
    if (end_) End(final_);
  }
  // A write completed and no step is running: start the next one (cheap, on gRPC's thread).
  void NextWrite() {
    writing_ = false;
    in_flight_.Clear();
    if (finished_ || cancelled_ || !has_ready_) {
      Post([this] { Advance(); });
      return;
    }
    in_flight_ = std::move(ready_);
    ready_.Clear();
    has_ready_ = false;
    writing_ = true;
    write_since_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
    StartWrite(&in_flight_);
    if (!end_) {
      Post([this] {
        if (finished_ || end_) return;
        ProduceNext();
        Advance();  // no-op while the write is outstanding
      });
    }
  }
  void WriteDone(bool ok) {
    writing_ = false;
    in_flight_.Clear();
    if (finished_) return;
    if (!ok) {
      End(grpc::Status(grpc::StatusCode::CANCELLED, "client gone"));
      return;
    }
    Advance();
  }
  void Cancelled() {
    cancelled_ = true;
    Advance();  // a write outstanding fails: WriteDone ends the call
  }
  // The watchdog's verdict: no message after the one on the wire; the call ends with `s` once
  // that write completes (or fails), and lets go of the rest now.
  void Abandon(const grpc::Status& s) {
    if (finished_) return;
    ready_.Clear();
    has_ready_ = false;
    end_ = true;
    final_ = s;
    Drop();
    Advance();
  }
  void End(const grpc::Status& s) {
    if (finished_) return;
    finished_ = true;
    Close(s);
    Finish(s);
  }

  grpc::ByteBuffer in_flight_;  // the write outstanding
  grpc::ByteBuffer ready_;      // the next message, made
  bool has_ready_ = false;
  bool writing_ = false;
  bool end_ = false;  // no message after ready_: the call ends with final_
  grpc::Status final_;
  bool cancelled_ = false;
  bool finished_ = false;
  // Read by the watchdog: when the write outstanding started (0: none), when the call began.
  std::atomic<int64_t> write_since_ns_{0};
  const int64_t opened_ns_;
  std::atomic<bool> idle_expired_{false}, aged_{false};  // the watchdog acted (once each)
  std::atomic<bool> cut_{false};  // the watchdog ended it (any rule): the folder rule skips it
};

// Get: KvCacheService::GetCall makes the messages; blocks are framed around their stored (or
// decoded) buffers without copying them (FrameGetBlock).
class GuardedService::GetReactor final : public WriteReactor {
 public:
  GetReactor(GuardedService* guard, grpc::CallbackServerContext* context,
             const grpc::ByteBuffer* request)
      : WriteReactor(guard, context, request) {
    Post([this] { Begin(); });
  }

 private:
  grpc::Status Open(grpc::ByteBuffer* first) override {
    v1::GetRequest request;
    if (!grpc::SerializationTraits<v1::GetRequest>::Deserialize(&request_, &request).ok()) {
      return NotParsed();
    }
    parsed_ = true;
    start_ = std::chrono::steady_clock::now();
    grpc::Status s = guard_->auth_->Authorize(*context_, request.namespace_(), &caller_);
    if (!s.ok()) return s;
    authorized_ = true;
    request.set_namespace_(caller_.ns);
    node_id_ = request.node_id();
    tokens_asked_ = KvCacheService::TokenCount(request);
    call_ = guard_->inner_->NewGet(context_, std::move(request));
    v1::GetResponse header;
    if (s = call_->Start(&header); !s.ok()) return s;
    matched_tokens_ = header.header().matched_tokens();
    bool own_buffer = false;
    return grpc::SerializationTraits<v1::GetResponse>::Serialize(header, first, &own_buffer);
  }

  const char* method() const override { return "Get"; }
  bool holds_snapshot() const override { return true; }
  void Drop() override { call_.reset(); }  // its snapshot and the payloads not yet sent

  grpc::Status Produce(grpc::ByteBuffer* next, bool* end) override {
    KvCacheService::GetCall::Message m;
    grpc::Status s = call_->Next(&m, end);
    if (s.ok() && !*end) *next = FrameGetBlock(m.block, m.encoded, m.bytes, std::move(m.owner));
    return s;
  }

  void Close(const grpc::Status& s) override {
    call_.reset();  // its buffers (the messages on the wire hold their own)
    Metrics* metrics = guard_->metrics_;
    if (!parsed_) return;  // as before any handler: not counted
    if (s.ok() && node_id_ == 0 && metrics != nullptr) {
      metrics->RecordMatch(caller_.ns, tokens_asked_, matched_tokens_);
    }
    if (s.ok() && caller_.tenant != nullptr) guard_->CountersOf(caller_.ns)->gets++;
    if (metrics != nullptr) {
      if (!authorized_) metrics->RecordAuthFailure(s.error_code());
      metrics->RecordCall("Get", authorized_ ? &caller_.ns : nullptr, s.error_code(),
                          SecondsSince(start_));
    }
  }

  std::unique_ptr<KvCacheService::GetCall> call_;
  bool parsed_ = false;
  bool authorized_ = false;
  Caller caller_;
  uint64_t node_id_ = 0;
  uint32_t tokens_asked_ = 0;
  uint32_t matched_tokens_ = 0;
  std::chrono::steady_clock::time_point start_;
};

grpc::ServerWriteReactor<grpc::ByteBuffer>* GuardedService::Get(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new GetReactor(this, context, request);
}

// GetPredictor: the state read whole, sent in chunks of --max_get_message_bytes.
class GuardedService::PredictorReactor final : public WriteReactor {
 public:
  PredictorReactor(GuardedService* guard, grpc::CallbackServerContext* context,
                   const grpc::ByteBuffer* request)
      : WriteReactor(guard, context, request) {
    Post([this] { Begin(); });
  }

 private:
  grpc::Status Open(grpc::ByteBuffer* first) override {
    if (!grpc::SerializationTraits<v1::GetPredictorRequest>::Deserialize(&request_, &request_msg_)
             .ok()) {
      return NotParsed();
    }
    parsed_ = true;
    start_ = std::chrono::steady_clock::now();
    grpc::Status s = guard_->auth_->Authorize(*context_, request_msg_.namespace_(), &caller_);
    if (!s.ok()) return s;
    authorized_ = true;
    request_msg_.set_namespace_(caller_.ns);
    if (s = guard_->inner_->ReadPredictor(request_msg_, &state_); !s.ok()) return s;
    crc_ = Crc32c(state_);
    chunks_ = guard_->inner_->PredictorChunks(state_);
    bool end = false;
    return Produce(first, &end);  // there is always a first chunk
  }

  const char* method() const override { return "GetPredictor"; }
  void Drop() override { state_.clear(); }

  grpc::Status Produce(grpc::ByteBuffer* next, bool* end) override {
    if (k_ >= chunks_) {
      *end = true;
      return grpc::Status::OK;
    }
    if (context_->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client gone");
    v1::PredictorChunk chunk;
    guard_->inner_->PredictorChunkAt(request_msg_, state_, crc_, k_++, &chunk);
    bool own_buffer = false;
    return grpc::SerializationTraits<v1::PredictorChunk>::Serialize(chunk, next, &own_buffer);
  }

  void Close(const grpc::Status& s) override {
    state_.clear();
    Metrics* metrics = guard_->metrics_;
    if (!parsed_ || metrics == nullptr) return;
    if (!authorized_) metrics->RecordAuthFailure(s.error_code());
    metrics->RecordCall("GetPredictor", authorized_ ? &caller_.ns : nullptr, s.error_code(),
                        SecondsSince(start_));
  }

  v1::GetPredictorRequest request_msg_;
  bool parsed_ = false;
  bool authorized_ = false;
  Caller caller_;
  std::string state_;
  uint32_t crc_ = 0;
  size_t chunks_ = 0, k_ = 0;
  std::chrono::steady_clock::time_point start_;
};

grpc::ServerWriteReactor<grpc::ByteBuffer>* GuardedService::GetPredictor(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new PredictorReactor(this, context, request);
}

}  // namespace kvtrie

namespace kvtrie {

void GuardedService::AddWriter(WriteReactor* writer) {
  absl::MutexLock lock(&writers_mu_);
  writers_.insert(writer);
}

void GuardedService::RemoveWriter(WriteReactor* writer) {
  absl::MutexLock lock(&writers_mu_);
  writers_.erase(writer);
}

void GuardedService::WatchLoop() {
  absl::Duration period = absl::Seconds(1);
  for (absl::Duration d : {options_.get_idle_timeout, options_.get_max_snapshot_age}) {
    if (d > absl::ZeroDuration()) period = std::min(period, d / 4);
  }
  const bool folder_rule = options_.get_cut_folder_bytes > 0 && store_ != nullptr;
  if (folder_rule) period = std::min(period, absl::Milliseconds(50));
  period = std::max(period, absl::Milliseconds(10));
  const int64_t idle_ns = absl::ToInt64Nanoseconds(options_.get_idle_timeout);
  const int64_t age_ns = absl::ToInt64Nanoseconds(options_.get_max_snapshot_age);
  constexpr int64_t kMinCutAgeNs = 100'000'000;  // a Get this young holds little: left be
  for (;;) {
    // The folder is measured with no lock held (a directory scan).
    const uint64_t folder = folder_rule ? store_->DataFolderBytes() : 0;
    absl::MutexLock lock(&writers_mu_);
    if (stop_watch_) return;
    const int64_t now = absl::GetCurrentTimeNanos();
    // Watch posts steps and may TryCancel, which only marks the call and schedules its callbacks
    // (PutLimits' watchdog relies on the same): no reactor code runs here to want writers_mu_.
    for (WriteReactor* w : writers_) w->Watch(now, idle_ns, age_ns);
    if (folder_rule && folder >= options_.get_cut_folder_bytes) {
      // Every Get holding a snapshot older than kMinCutAgeNs, oldest first: a spike past the line
      // (a garbage collection relocating the live blobs) is short, and each snapshot left keeps
      // what was deleted or evicted since it began.
      std::vector<WriteReactor*> cut;
      for (WriteReactor* w : writers_) {
        if (w->Cuttable(now, kMinCutAgeNs)) cut.push_back(w);
      }
      std::sort(cut.begin(), cut.end(), [](const WriteReactor* a, const WriteReactor* b) {
        return a->opened_ns() < b->opened_ns();
      });
      for (WriteReactor* w : cut) {
        w->CutForDisk(folder, options_.get_cut_folder_bytes, options_.folder_bound_bytes);
      }
    }
    writers_mu_.AwaitWithTimeout(absl::Condition(&stop_watch_), period);
    if (stop_watch_) return;
  }
}

}  // namespace kvtrie
