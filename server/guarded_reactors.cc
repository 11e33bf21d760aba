// GuardedService's streaming calls as callback reactors (see server/guarded_service.h): Put reads
// one message at a time, Get and GetPredictor write one at a time while the next is made. Every
// step runs on the handler pool, one at a time per call (Strand); gRPC's callbacks (OnReadDone,
// OnWriteDone, OnCancel) only post steps. A reactor is deleted after gRPC's OnDone and its last
// step, whichever comes later.
#include <chrono>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <utility>

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
    Post([this, ok] { ReadDone(ok); });
  }
  void OnCancel() override {
    Post([this] { Cancelled(); });
  }
  void OnDone() override { Release(); }

 private:
  void Begin() {
    call_ = guard_->inner_->NewPut(context_);
    Act(call_->Start());
  }

  void Act(PutCall::Next next) {
    switch (next) {
      case PutCall::Next::kRead:
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
  v1::PutRequest request_;  // the read in flight lands here
  bool waiting_ = false;    // for memory (ReserveWholeAsync)
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
    // The next message, when made, goes on the wire from here (no hand-off between two writes);
    // making the one after it is posted to the pool.
    if (ok && RunInlineIfIdle([this] { NextWrite(); })) return;
    Post([this, ok] { WriteDone(ok); });
  }
  void OnCancel() override {
    Post([this] { Cancelled(); });
  }
  void OnDone() override { Release(); }

 protected:
  WriteReactor(GuardedService* guard, grpc::CallbackServerContext* context,
               const grpc::ByteBuffer* request)
      : Strand(guard->handlers_.get()), guard_(guard), context_(context), request_(*request) {
    // The subclass posts Begin once it is constructed.
  }

  virtual grpc::Status Open(grpc::ByteBuffer* first) = 0;
  virtual grpc::Status Produce(grpc::ByteBuffer* next, bool* end) = 0;
  virtual void Close(const grpc::Status& status) = 0;

  void Begin() {
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
    StartWrite(&in_flight_);
    if (!end_) {
      Post([this] {
        if (finished_) return;
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
