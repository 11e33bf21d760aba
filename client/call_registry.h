// client/call_registry.h
//
// The gRPC calls of one kvtrie::Client in flight, so that another thread can see how long the
// oldest has waited and cancel them all: a shard that stopped answering (SIGSTOP, a hung host)
// without closing its connection (client/shard_health.h). Client::NewContext registers each
// context it makes; the context's deleter takes it out again before it is freed, so a cancel
// never touches a freed context. Thread-safe.
#ifndef KVTRIE_CLIENT_CALL_REGISTRY_H_
#define KVTRIE_CLIENT_CALL_REGISTRY_H_

#include <grpcpp/client_context.h>

#include <cstdint>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvtrie {

class CallRegistry {
 public:
  void Add(grpc::ClientContext* ctx);
  void Remove(grpc::ClientContext* ctx);
  // TryCancel on every call in flight (each then ends CANCELLED); returns how many.
  int CancelAll();
  // When the oldest call in flight began; InfiniteFuture when none is.
  absl::Time OldestStart() const;

 private:
  mutable absl::Mutex mu_;  // guards calls_ (TryCancel does no I/O: it only marks the call)
  std::map<grpc::ClientContext*, absl::Time> calls_ ABSL_GUARDED_BY(mu_);  // -> when it began
};

// Deletes a context Client::NewContext made, after taking it out of its registry.
struct ContextDeleter {
  std::shared_ptr<CallRegistry> registry;
  void operator()(grpc::ClientContext* ctx) const;
};
using ContextPtr = std::unique_ptr<grpc::ClientContext, ContextDeleter>;

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_CALL_REGISTRY_H_
