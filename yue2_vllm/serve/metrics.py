"""The service's metrics on `prometheus_client`: one `CollectorRegistry` per service with the process, platform
and GC collectors, real counters and histograms, and gauges or counters read at scrape time from a function.

    registry = Registry()
    songs = registry.counter("yue2_songs_total", "Songs by final status.", ("status",))
    songs.inc(status="complete")
    print(registry.render())
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Iterable

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = getattr(prometheus_client, "CONTENT_TYPE_PLAIN_0_0_4", "text/plain; version=0.0.4; charset=utf-8")
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class _Labelled:
    """`inc(**labels)` / `observe(value, **labels)` over a prometheus_client metric (labels checked by name)."""

    def __init__(self, metric, labels: tuple[str, ...]):
        self._metric, self.labels = metric, tuple(labels)

    def _child(self, labels: dict):
        if set(labels) != set(self.labels):
            raise ValueError(f"labels must be {self.labels}, got {tuple(labels)}")
        return self._metric.labels(**{k: str(v) for k, v in labels.items()}) if self.labels else self._metric


class Counter(_Labelled):
    def inc(self, amount: float = 1.0, **labels) -> None:
        self._child(labels).inc(amount)

    def value(self, **labels) -> float:
        return self._child(labels)._value.get()


class Gauge(_Labelled):
    def set(self, value: float, **labels) -> None:
        self._child(labels).set(value)


class Histogram(_Labelled):
    def observe(self, value: float, **labels) -> None:
        self._child(labels).observe(value)

    def count(self, **labels) -> int:
        child = self._child(labels)
        return int(sum(bucket.get() for bucket in child._buckets))


class _FunctionMetric:
    """A gauge or counter whose value is read when scraped: a number, or {label values tuple: number}."""

    def __init__(self, kind: str, name: str, help_text: str, labels: tuple[str, ...], function: Callable):
        self.kind, self.name, self.help, self.labels, self.function = kind, name, help_text, tuple(labels), function

    def collect(self):
        family = (CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily)(
            self.name, self.help, labels=self.labels)
        value = self.function()
        items = value.items() if isinstance(value, dict) else [((), value)]
        for key, number in sorted(items):
            family.add_metric([str(k) for k in key], float(number))
        return [family]

    def describe(self):
        return []


class Registry:
    def __init__(self, process: bool = True):
        self.registry = prometheus_client.CollectorRegistry()
        if process:
            prometheus_client.ProcessCollector(registry=self.registry)
            prometheus_client.PlatformCollector(registry=self.registry)
            prometheus_client.GCCollector(registry=self.registry)

    def counter(self, name: str, help_text: str, labels: tuple[str, ...] = (), function=None):
        if function is not None:
            return self._function("counter", name, help_text, labels, function)
        return Counter(prometheus_client.Counter(name, help_text, labels, registry=self.registry), labels)

    def gauge(self, name: str, help_text: str, labels: tuple[str, ...] = (), function=None):
        if function is None:
            return Gauge(prometheus_client.Gauge(name, help_text, labels, registry=self.registry), labels)
        return self._function("gauge", name, help_text, labels, function)

    def histogram(self, name: str, help_text: str, labels: tuple[str, ...] = (),
                  buckets: tuple[float, ...] = SECONDS_BUCKETS) -> Histogram:
        metric = prometheus_client.Histogram(name, help_text, labels, registry=self.registry, buckets=buckets)
        return Histogram(metric, labels)

    def _function(self, kind, name, help_text, labels, function):
        metric = _FunctionMetric(kind, name, help_text, labels, function)
        self.registry.register(metric)
        return metric

    def render(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode("utf-8")


class RateWindow:
    """Events per second per key over the last `seconds` (whole-second buckets), e.g. AR tokens/s by phase."""

    def __init__(self, seconds: int = 10, clock=None):
        self.seconds, self.clock = seconds, clock or time.monotonic
        self._buckets: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()

    def add(self, key: str, amount: float = 1.0) -> None:
        second = int(self.clock())
        with self._lock:
            buckets = self._buckets[key]
            if buckets and buckets[-1][0] == second:
                buckets[-1][1] += amount
            else:
                buckets.append([second, amount])
            while buckets and buckets[0][0] <= second - self.seconds:
                buckets.popleft()

    def rates(self, keys: Iterable[str] = ()) -> dict[tuple[str], float]:
        """`{(key,): per second}` for every key seen (and `keys`), as a labelled gauge wants it."""
        now = int(self.clock())
        with self._lock:
            names = set(self._buckets) | set(keys)
            return {(key,): sum(n for second, n in self._buckets.get(key, ()) if second > now - self.seconds)
                    / self.seconds for key in sorted(names)}
