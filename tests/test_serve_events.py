"""The event hub on a real event loop: what a subscriber hears (every kind, or the kinds it asked for), and the
hub's STOPPING, which every subscriber hears, those that come later and those whose queue is full included."""
import asyncio

from yue2_vllm.serve.events import BACKLOG, STOPPING, EventHub
from yue2_vllm.serve.store import FINAL


def drain(subscriber) -> list[str]:
    kinds = []
    while not subscriber.queue.empty():
        kinds.append(subscriber.queue.get_nowait()[0])
    return kinds


def test_a_subscriber_hears_every_kind_or_only_the_kinds_it_asked_for():
    async def run():
        hub, loop = EventHub(), asyncio.get_running_loop()
        everything, snapshot = hub.subscribe("j1", loop, lambda: "now")
        final, _ = hub.subscribe("j1", loop, lambda: "now", frozenset(FINAL))
        other, _ = hub.subscribe("j2", loop, lambda: "now", frozenset(FINAL))
        for kind in ("state", "tokens", "stage", "complete"):
            hub.publish("j1", kind, {})
        await asyncio.sleep(0)
        assert snapshot == "now"
        assert drain(everything) == ["state", "tokens", "stage", "complete"]
        assert drain(final) == ["complete"] and drain(other) == []
        hub.unsubscribe(final)
        hub.publish("j1", "failed", {})
        await asyncio.sleep(0)
        assert drain(final) == [] and drain(everything) == ["failed"]

    asyncio.run(run())


def test_stop_tells_every_subscriber_once_and_each_later_one_at_once():
    async def run():
        hub, loop = EventHub(), asyncio.get_running_loop()
        every, _ = hub.subscribe("j1", loop, lambda: None)
        final, _ = hub.subscribe("j2", loop, lambda: None, frozenset(FINAL))
        hub.stop()
        hub.stop()
        await asyncio.sleep(0)
        assert drain(every) == [STOPPING] and drain(final) == [STOPPING]
        later, _ = hub.subscribe("j4", loop, lambda: None, frozenset(FINAL))
        assert (await asyncio.wait_for(later.queue.get(), 5))[0] == STOPPING

    asyncio.run(run())


def test_a_full_queue_turns_into_a_resync_but_never_loses_stopping():
    async def run():
        hub, loop = EventHub(), asyncio.get_running_loop()
        behind, _ = hub.subscribe("j1", loop, lambda: None)
        for _ in range(BACKLOG + 1):
            hub.publish("j1", "tokens", {})
        await asyncio.sleep(0)
        assert drain(behind) == ["resync"]
        for _ in range(BACKLOG):
            hub.publish("j1", "tokens", {})
        hub.stop()  # a client behind by a whole backlog still hears it
        await asyncio.sleep(0)
        assert drain(behind) == [STOPPING]

    asyncio.run(run())
