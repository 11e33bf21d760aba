// server/parse_failure_interceptor.h
//
// A gRPC server interceptor that names the cause when a unary or server-streaming request does
// not parse. gRPC's sync server answers such a call itself, before any handler runs, with
// INTERNAL and an empty message (proto_utils.h: the message is InitializationErrorString(),
// empty in proto3); the common cause is a proto3 `string` field (namespace, model_id) holding
// invalid UTF-8, which protobuf refuses to parse. This interceptor sees that the request did not
// deserialize (POST_RECV_MESSAGE with no message) and replaces that status with
//   INVALID_ARGUMENT "request: did not parse (proto3 string fields such as namespace and
//   model_id must be valid UTF-8)".
// Calls whose request parsed are untouched; client-streaming calls (Put) are not intercepted
// (KvCacheService reports a Put whose message does not parse itself). kvtrie-server's KVCache
// methods take raw requests and name a parse failure themselves (server/guarded_service.h); this
// covers services served with generated (sync) handlers, such as KvCacheService itself. grpcurl's
// JSON path is unchanged: the messages and their serialization stay protobuf's.
//
// Register with ServerBuilder::experimental().SetInterceptorCreators(
//     MakeParseFailureInterceptors()).
#ifndef KVTRIE_SERVER_PARSE_FAILURE_INTERCEPTOR_H_
#define KVTRIE_SERVER_PARSE_FAILURE_INTERCEPTOR_H_

#include <grpcpp/support/server_interceptor.h>

#include <memory>
#include <vector>

namespace kvtrie {

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
MakeParseFailureInterceptors();

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_PARSE_FAILURE_INTERCEPTOR_H_
