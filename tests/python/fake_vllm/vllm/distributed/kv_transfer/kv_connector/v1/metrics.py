"""Fake vllm (see vllm/__init__.py): KVConnectorPromMetrics as in vLLM's v1/metrics.py at the
pinned commit (its constructor's signature and the attributes it sets: ``_kv_transfer_config``,
``_gauge_cls``, ``_counter_cls``, ``_histogram_cls``, ``_labelnames``,
``per_engine_labelvalues``; ``make_per_engine``; ``observe`` for subclasses), and stand-ins for
the prometheus_client Gauge / Counter / Histogram it keys ``metric_types`` by (prometheus_client
is not installed here). The stand-ins record what is done to them, for the tests."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple


class _Metric:
    """A prometheus_client metric's surface: a parent with labelnames, children by labels."""

    def __init__(self, name: str, documentation: str, labelnames: Any = (), **_: Any) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.children: Dict[Tuple[Any, ...], "_Metric"] = {}
        self.value: float = 0
        self.observed: List[float] = []

    def labels(self, *values: Any) -> "_Metric":
        assert len(values) == len(self.labelnames), (values, self.labelnames)
        return self.children.setdefault(tuple(values), type(self)(self.name, self.documentation))


class Counter(_Metric):
    def inc(self, amount: float = 1) -> None:
        assert amount >= 0, "a counter only goes up"
        self.value += amount


class Gauge(_Metric):
    def set(self, value: float) -> None:
        self.value = value


class Histogram(_Metric):
    def observe(self, value: float) -> None:
        self.observed.append(value)


PromMetric = Any


class KVConnectorPromMetrics:
    """Per-connector Prometheus metric registration and recording (vLLM's base class)."""

    def __init__(self, vllm_config: Any, metric_types: Dict[type, type], labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]) -> None:
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._gauge_cls = metric_types[Gauge]
        self._counter_cls = metric_types[Counter]
        self._histogram_cls = metric_types[Histogram]
        self._labelnames = labelnames
        self.per_engine_labelvalues = per_engine_labelvalues

    def make_per_engine(self, metric: Any) -> Dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        raise NotImplementedError
