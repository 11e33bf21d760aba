"""Fake vllm: KVConnectorFactory's way of loading a connector that is not registered by name
(vLLM's factory.py): import ``kv_transfer_config.kv_connector_module_path``, take the attribute
named ``kv_transfer_config.kv_connector``, construct it with ``(vllm_config, role,
kv_cache_config)`` (vLLM before kv_cache_config: ``(vllm_config, role)``)."""

from __future__ import annotations

import importlib
from typing import Any


class KVConnectorFactory:
    @classmethod
    def get_connector_class(cls, kv_transfer_config: Any) -> type:
        module_path = kv_transfer_config.kv_connector_module_path
        if module_path is None:
            raise ValueError(f"Unsupported connector type: {kv_transfer_config.kv_connector}")
        return getattr(importlib.import_module(module_path), kv_transfer_config.kv_connector)

    @classmethod
    def create_connector(cls, config: Any, role: Any, kv_cache_config: Any = None) -> Any:
        connector_cls = cls.get_connector_class(config.kv_transfer_config)
        return connector_cls(config, role, kv_cache_config)
