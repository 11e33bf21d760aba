"""The connector's counters as vLLM Prometheus metrics (KvtrieConnector.build_prom_metrics).

vLLM calls ``build_prom_metrics(vllm_config, metric_types, labelnames,
per_engine_labelvalues)`` once per engine core; ``metric_types`` maps prometheus_client's
Gauge / Counter / Histogram to the classes vLLM wants created (its multiprocess-safe wrappers),
which vLLM's ``KVConnectorPromMetrics`` constructor keeps as ``_counter_cls`` etc. ``observe``
then receives the ``data`` of the workers' aggregated :class:`KvtrieConnectorStats` (counters
since the last call) with the engine's index, and adds each to its counter.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Optional

#: stats key -> (counter name, help text)
COUNTERS: Dict[str, str] = {
    "lookups": "Prefix lookups sent to kvtrie by the scheduler.",
    "lookup_hits": "Lookups that found KV beyond the engine's local prefix-cache hit.",
    "loaded_tokens": "Tokens of KV loaded from kvtrie into the paged cache.",
    "loaded_bytes": "Bytes of dense KV loaded from kvtrie into the paged cache.",
    "load_failed_tokens": "Tokens whose KV load from kvtrie failed (recomputed or failed).",
    "load_failures": "Requests whose KV load from kvtrie failed.",
    "saved_blocks": "kvtrie blocks stored by the connector's saves.",
    "saved_bytes": "Bytes of dense KV gathered for committed kvtrie saves.",
    "save_errors": "kvtrie saves that failed (a future miss).",
    "leases": "Looked-up prefixes leased (pinned with a TTL) until their load.",
    "failed_requests": "Requests failed by a KV load under kv_load_failure_policy 'fail'.",
}

_cls: Optional[type] = None


def _prom_base() -> Optional[type]:
    try:
        mod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    except ImportError:
        return None
    return getattr(mod, "KVConnectorPromMetrics", None)


def _make_class(base: type) -> type:
    class KvtriePromMetrics(base):  # type: ignore[misc, valid-type]
        """A counter ``vllm:kvtrie_<key>`` per key of :data:`COUNTERS`, per engine."""

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any,
                     per_engine_labelvalues: Any) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self.counters: Dict[str, Dict[int, Any]] = {}
            for key, doc in COUNTERS.items():
                metric = self._counter_cls(name=f"vllm:kvtrie_{key}", documentation=doc,
                                           labelnames=labelnames)
                self.counters[key] = {idx: metric.labels(*values)
                                      for idx, values in per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
            for key, value in transfer_stats_data.items():
                per_engine = self.counters.get(key)
                if per_engine is not None and value:
                    per_engine[engine_idx].inc(value)

    return KvtriePromMetrics


def build_prom_metrics(vllm_config: Any, metric_types: Any, labelnames: Any,
                       per_engine_labelvalues: Any) -> Any:
    """A KvtriePromMetrics (a subclass of vLLM's KVConnectorPromMetrics), or None without it."""
    global _cls
    base = _prom_base()
    if base is None:
        return None
    if _cls is None or not issubclass(_cls, base):
        _cls = _make_class(base)
    return _cls(vllm_config, metric_types, labelnames, per_engine_labelvalues)
