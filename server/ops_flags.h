// server/ops_flags.h
//
// The operating flags of kvtrie-server (config file, logs, TLS, tenants, metrics); the storage
// and service flags stay in server/main.cc. ReadOpsFlags() returns their parsed values.
#ifndef KVTRIE_SERVER_OPS_FLAGS_H_
#define KVTRIE_SERVER_OPS_FLAGS_H_

#include <cstddef>
#include <string>

#include "server/tls.h"

namespace kvtrie {

struct OpsFlags {
  std::string log_format;  // text | json
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
