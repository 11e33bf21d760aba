"""Fake vllm (see vllm/__init__.py): what vLLM's v1/__init__.py exports."""

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
