#include "server/request_checks.h"

namespace kvtrie::service_checks {

void ToModelSpec(const ModelInfo& info, v1::ModelSpec* spec) {
  spec->set_model_id(info.model_id);
  spec->set_num_layers(info.geometry.num_layers);
  spec->set_num_kv_heads(info.geometry.num_kv_heads);
  spec->set_head_dim(info.geometry.head_dim);
  spec->set_dtype(static_cast<v1::DType>(info.geometry.dtype));
  spec->set_block_tokens(info.geometry.block_tokens);
}

}  // namespace kvtrie::service_checks
