"""Prometheus text exposition (format 0.0.4), written by hand: counters, gauges and histograms with labels.

    registry = Registry()
    songs = registry.counter("yue2_songs_total", "Songs by final status.", ("status",))
    songs.inc(status="complete")
    print(registry.render())
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))


def escape_label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def label_text(names: Iterable[str], values: Iterable[str]) -> str:
    pairs = [f'{name}="{escape_label(value)}"' for name, value in zip(names, values)]
    return "{" + ",".join(pairs) + "}" if pairs else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.labels = name, help_text, tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict) -> tuple[str, ...]:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name}: labels must be {self.labels}, got {tuple(labels)}")
        return tuple(str(labels[name]) for name in self.labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A count that only goes up: `inc`remented, or read at scrape time from `function` (kept elsewhere)."""

    kind = "counter"

    def __init__(self, name, help_text, labels=(), function: Callable[[], float] | None = None):
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {}
        self.function = function

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up (got {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def samples(self) -> list[str]:
        if self.function is not None:
            items = [((), float(self.function()))]
        else:
            with self._lock:
                items = sorted(self._values.items())
        if not items and not self.labels:
            items = [((), 0.0)]
        return [f"{self.name}{label_text(self.labels, key)} {format_value(v)}" for key, v in items]


class Gauge(_Metric):
    """A value set now and then, or read at scrape time from `function` (a number, or {label values: number})."""

    kind = "gauge"

    def __init__(self, name, help_text, labels=(), function: Callable[[], object] | None = None):
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {}
        self.function = function

    def set(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def samples(self) -> list[str]:
        if self.function is not None:
            value = self.function()
            items = sorted(value.items()) if isinstance(value, dict) else [((), value)]
        else:
            with self._lock:
                items = sorted(self._values.items())
        return [f"{self.name}{label_text(self.labels, key)} {format_value(float(v))}" for key, v in items]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help_text, labels=(), buckets: tuple[float, ...] = SECONDS_BUCKETS):
        super().__init__(name, help_text, labels)
        if list(buckets) != sorted(buckets) or len(set(buckets)) != len(buckets):
            raise ValueError(f"{self.name}: buckets must increase strictly, got {buckets}")
        self.buckets = tuple(float(b) for b in buckets)
        self._series: dict[tuple[str, ...], list] = {}  # key -> [counts per bucket..., sum, count]

    def observe(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            series = self._series.setdefault(key, [0] * len(self.buckets) + [0.0, 0])
            for index, bound in enumerate(self.buckets):
                if value <= bound:
                    series[index] += 1
            series[-2] += value
            series[-1] += 1

    def count(self, **labels) -> int:
        with self._lock:
            series = self._series.get(self._key(labels))
            return series[-1] if series else 0

    def samples(self) -> list[str]:
        with self._lock:
            items = sorted((key, list(series)) for key, series in self._series.items())
        if not items and not self.labels:
            items = [((), [0] * len(self.buckets) + [0.0, 0])]
        lines = []
        for key, series in items:
            names = self.labels + ("le",)
            for bound, count in zip(self.buckets, series):
                lines.append(f"{self.name}_bucket{label_text(names, key + (format_value(bound),))} {count}")
            lines.append(f"{self.name}_bucket{label_text(names, key + ('+Inf',))} {series[-1]}")
            lines.append(f"{self.name}_sum{label_text(self.labels, key)} {format_value(series[-2])}")
            lines.append(f"{self.name}_count{label_text(self.labels, key)} {series[-1]}")
        return lines


class Registry:
    def __init__(self):
        self._metrics: list[_Metric] = []

    def _add(self, metric):
        if any(m.name == metric.name for m in self._metrics):
            raise ValueError(f"metric {metric.name} is registered already")
        self._metrics.append(metric)
        return metric

    def counter(self, name: str, help_text: str, labels: tuple[str, ...] = (), function=None) -> Counter:
        return self._add(Counter(name, help_text, labels, function))

    def gauge(self, name: str, help_text: str, labels: tuple[str, ...] = (), function=None) -> Gauge:
        return self._add(Gauge(name, help_text, labels, function))

    def histogram(self, name: str, help_text: str, labels: tuple[str, ...] = (),
                  buckets: tuple[float, ...] = SECONDS_BUCKETS) -> Histogram:
        return self._add(Histogram(name, help_text, labels, buckets))

    def render(self) -> str:
        lines = []
        for metric in self._metrics:
            lines += metric.header() + metric.samples()
        return "\n".join(lines) + "\n"


class RateWindow:
    """Events per second per key over the last `seconds` (whole-second buckets), e.g. AR tokens/s by phase."""

    def __init__(self, seconds: int = 10, clock=None):
        import collections
        import time

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
