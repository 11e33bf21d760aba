// server/ops_flags.h
//
// The operating flags of kvtrie-server (the listening address and its port file, gRPC's thread
// bound, the shutdown grace, config file, logs, TLS, tenants, metrics); the storage flags are in
// server/store_flags.h, the serving ones in server/service_flags.h. ReadOpsFlags() returns their
// parsed values (--log_level and --log_format are checked by SetUpLogging, server/config.h).
#ifndef KVTRIE_SERVER_OPS_FLAGS_H_
#define KVTRIE_SERVER_OPS_FLAGS_H_

#include <cstddef>
#include <string>

#include "server/tls.h"

namespace kvtrie {

struct OpsFlags {
  std::string listen;               // HOST:PORT of the gRPC service
  std::string port_file;            // written with the bound port; empty: none
  int max_threads = 512;            // gRPC's synchronous server (reflection)
  int shutdown_grace_seconds = 10;  // SIGTERM to exit
  std::string log_level;            // trace | debug | info | warn | error | off
  std::string log_format;           // text | json
  TlsOptions tls;
  std::string health_listen;      // plaintext health-only port; empty: none
  std::string health_port_file;   // written with the bound health port
  std::string tokens_file;        // empty: auth off
  std::string metrics_listen;     // empty: no /metrics
  std::string metrics_port_file;  // written with the bound metrics port
  size_t metrics_max_namespaces = 0;
  std::string shard_name;  // /metrics label shard="NAME"; empty: none
};

OpsFlags ReadOpsFlags();

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_OPS_FLAGS_H_
