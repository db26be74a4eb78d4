"""Per-job event fan-out: song threads publish, each SSE connection (or speech call waiting for its song) reads its
own asyncio queue, so nothing that waits for a job's events holds a thread.

A subscriber is registered together with a snapshot of the job taken under the same lock as
`publish`, so a client that connects late gets the current state first and then every later
event, none older than its snapshot. When the server stops, every subscriber hears `STOPPING` last.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

BACKLOG = 1000  # events a slow client may fall behind before it is sent a fresh snapshot instead
STOPPING = "stopping"  # the hub's last word to every subscriber: the server stops (no job event has this kind)
# json.dumps escapes CR, LF and every other C0 control, but (ensure_ascii=False) leaves these raw, and
# str.splitlines and some SSE readers break lines at them.
_LINE_BREAKS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_LINE_BREAK_TABLE = str.maketrans(_LINE_BREAKS)


def event_json(data) -> str:
    """`data` as one line of JSON for an SSE `data:` field: UTF-8 text kept, but no raw line separator of any
    kind (CR, LF, NEL, U+2028, U+2029)."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAK_TABLE)


@dataclass(eq=False)
class Subscriber:
    job_id: str
    loop: asyncio.AbstractEventLoop
    kinds: frozenset[str] | None = None  # the event kinds it hears (None: every kind); STOPPING always
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(BACKLOG))

    def hears(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds or kind == STOPPING

    def tell(self, item) -> bool:
        """Hand `(kind, data, event id)` to it (from any thread); False when its event loop is closed (it is gone)."""
        try:
            self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:
            return False
        return True

    def _put(self, item) -> None:  # runs on the subscriber's event loop
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(item if item[0] == STOPPING else ("resync", {}, item[2]))


class EventHub:
    def __init__(self):
        self._lock = threading.Lock()
        self._subscribers: dict[str, set[Subscriber]] = {}
        self._ids = itertools.count(1)
        self.stopped = False

    def subscribe(self, job_id: str, loop: asyncio.AbstractEventLoop, snapshot: Callable[[], object],
                  kinds: frozenset[str] | None = None):
        """`(subscriber, snapshot())`, atomically with respect to `publish`; the subscriber hears the events of
        `kinds` (None: every kind), and STOPPING at once once the hub has stopped."""
        with self._lock:
            value = snapshot()
            subscriber = Subscriber(job_id, loop, kinds)
            self._subscribers.setdefault(job_id, set()).add(subscriber)
            if self.stopped:
                subscriber.tell((STOPPING, {}, None))
        return subscriber, value

    def unsubscribe(self, subscriber: Subscriber) -> None:
        with self._lock:
            subscribers = self._subscribers.get(subscriber.job_id)
            if subscribers is not None:
                subscribers.discard(subscriber)
                if not subscribers:
                    del self._subscribers[subscriber.job_id]

    def publish(self, job_id: str, kind: str, data: dict) -> None:
        """Hand `(kind, data, event id)` to every subscriber of the job (from any thread)."""
        with self._lock:
            event_id = next(self._ids)
            for subscriber in list(self._subscribers.get(job_id, ())):
                if subscriber.hears(kind) and not subscriber.tell((kind, data, event_id)):
                    self._subscribers[job_id].discard(subscriber)  # its connection is gone

    def stop(self) -> None:
        """The server stops: every subscriber, now and later, hears STOPPING (an SSE stream ends, a speech call
        answers), so no connection holds the shutdown. From any thread; again: nothing more."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            for subscribers in self._subscribers.values():
                for subscriber in list(subscribers):
                    if not subscriber.tell((STOPPING, {}, None)):
                        subscribers.discard(subscriber)  # its connection is gone

    def subscribers(self, job_id: str | None = None) -> int:
        with self._lock:
            if job_id is not None:
                return len(self._subscribers.get(job_id, ()))
            return sum(len(s) for s in self._subscribers.values())


class Throttle:
    """At most one event per `interval` seconds per key; `force` lets the last one of a series through."""

    def __init__(self, interval: float, clock=time.monotonic):
        self.interval, self.clock = interval, clock
        self._last: dict[object, float] = {}
        self._lock = threading.Lock()

    def ready(self, key, force: bool = False) -> bool:
        now = self.clock()
        with self._lock:
            if force or now - self._last.get(key, -float("inf")) >= self.interval:
                self._last[key] = now
                return True
            return False

    def forget(self, key) -> None:
        with self._lock:
            self._last.pop(key, None)
