// client/proto_json.h
//
// Converts a protobuf message to JSON for the CLI: field names as in the .proto (snake_case),
// every field printed (defaults too), 64-bit integers as JSON numbers (protobuf's canonical JSON
// prints them as strings), enums by name.
#ifndef KVTRIE_CLIENT_PROTO_JSON_H_
#define KVTRIE_CLIENT_PROTO_JSON_H_

#include <google/protobuf/message.h>

#include <nlohmann/json.hpp>

namespace kvtrie {

nlohmann::json ProtoToJson(const google::protobuf::Message& message);

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_PROTO_JSON_H_
