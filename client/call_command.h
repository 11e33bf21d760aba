// client/call_command.h
//
// `kvtrie call METHOD JSON`: a grpcurl-equivalent that needs nothing but this binary. METHOD is a
// kvtrie.v1.KVCache method ("Stats", "KVCache/Stats" or "kvtrie.v1.KVCache/Stats"); JSON is the
// request in protobuf's JSON mapping (field names as in the .proto or lowerCamelCase; 64-bit
// integers as numbers or strings; bytes as base64; enums by name), "-" for stdin or "@FILE".
// Put takes a JSON array of PutRequest messages (header, blocks, commit). Each response message
// is printed on stdout as JSON with the .proto's field names (grpcurl's output form).
// Errors: INVALID_ARGUMENT naming the method or the JSON's problem; the server's status.
#ifndef KVTRIE_CLIENT_CALL_COMMAND_H_
#define KVTRIE_CLIENT_CALL_COMMAND_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "client/client.h"

namespace kvtrie {

absl::Status CallMethod(Client& client, const std::string& method, const std::string& json,
                        std::ostream& out);

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_CALL_COMMAND_H_
