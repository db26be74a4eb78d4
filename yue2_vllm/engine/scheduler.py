"""vLLM scheduler that admits the two rows of a CFG pair as a gang (imported only inside the engine worker).

vLLM admits waiting requests one by one; a pair whose cond row gets the last free slot while its uncond
row waits would run out of step, and every such step costs the driver a restart. Before each
`schedule()`, this subclass takes out of the waiting queues every pair that cannot start whole (fewer
than two free slots, or its partner is not waiting), and puts them back, in order, afterwards.
Preemption is not ganged: a preempted row's partner goes on alone, gets the sentinel and the driver
resubmits the pair (our parent-side KV admission keeps preemption rare).

What "free" and "waiting" mean is read from the release's own `Scheduler.schedule()` (checked per release
by bench/vllm_source_check.py, sections 4 and 10):
* 0.28–0.30: admission drains `skipped_waiting` before `waiting` (FCFS) while `len(running) +
  num_waiting_for_streaming_input < max_num_running_reqs`.
* 0.31+: admission drains `kv_holding_waiting` before `waiting` (only the former while new requests are
  paused) while `len(running) + num_waiting_for_streaming_input < max_num_active_reqs`.
The hold walks the queues in that order; a pair starts only if the free slots cover both rows and every
request admission meets between them (the two rows may sit in different queues), and each single request
ahead counts as taking a slot (one the scan skips takes none: the hold errs towards holding, never
towards splitting). Token budget and KV allocation are not ganged: our parent-side admission sizes both.

Two classes share the hold: `PairScheduler` (sync scheduling, the V1 runner) and `PairAsyncScheduler`
(over vLLM's `AsyncScheduler`, for Model Runner V2 with async scheduling on). vLLM warns that a custom
scheduler derived from the sync one degrades under async scheduling; the backend names the one that
matches the engine's `async_scheduling` (`scheduler_for`).
"""
from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .plugin import ROW_KEY


def pair_of(request) -> str | None:
    params = getattr(request, "sampling_params", None)
    args = (params.extra_args or {}).get(ROW_KEY) if params is not None else None
    return args.get("pair") if isinstance(args, dict) else None


def admission_queues(scheduler) -> list:
    """The waiting queues `schedule()` admits from, in the order it drains them (see the module doc)."""
    ahead = getattr(scheduler, "kv_holding_waiting", None)  # 0.31+
    if ahead is None:
        return [getattr(scheduler, "skipped_waiting", None), scheduler.waiting]  # 0.28–0.30
    pause = getattr(scheduler, "_pause_state", None)
    if pause is not None and getattr(pause, "name", "UNPAUSED") != "UNPAUSED":
        return [ahead]  # PAUSED_NEW: only requests that hold KV blocks are admitted
    return [ahead, scheduler.waiting]


def free_slots(scheduler) -> int:
    """Requests `schedule()` may still admit this step (as its admission loop counts them)."""
    limit = min(getattr(scheduler, "max_num_active_reqs", scheduler.max_num_running_reqs),
                scheduler.max_num_running_reqs)
    return limit - len(scheduler.running) - getattr(scheduler, "num_waiting_for_streaming_input", 0)


def in_admission_order(scheduler, queues: list) -> list:
    requests = [request for queue in queues if queue for request in queue]
    if getattr(getattr(scheduler, "policy", None), "name", "FCFS") == "PRIORITY":
        return sorted(requests)  # vLLM's Request orders by (priority, arrival); a heap iterates unsorted
    return requests


class _HoldsUnstartablePairs:
    def schedule(self, *args, **kwargs):
        held = self._hold_unstartable_pairs()
        try:
            return super().schedule(*args, **kwargs)
        finally:
            for queue, requests in held:
                queue.prepend_requests(reversed(requests))  # prepend reverses: keep their order

    def _hold_unstartable_pairs(self) -> list[tuple[object, list]]:
        """Take out of their queues the waiting pairs that cannot start whole this step; `[(queue, held)]`."""
        drained = [queue for queue in admission_queues(self) if queue is not None]
        everywhere = [queue for queue in (getattr(self, "kv_holding_waiting", None),
                                          getattr(self, "skipped_waiting", None), self.waiting) if queue is not None]
        members: dict[str, list] = {}
        for queue in everywhere:
            for request in queue:
                pair = pair_of(request)
                if pair is not None:
                    members.setdefault(pair, []).append(request)
        if not members:
            return []
        order = in_admission_order(self, drained)
        position = {id(request): index for index, request in enumerate(order)}
        free, held_pairs, seen = free_slots(self), set(), set()
        for request in order:
            pair = pair_of(request)
            if pair is None:
                free -= 1  # a single request ahead takes a slot first
            elif pair not in seen:
                seen.add(pair)
                rows = members[pair]
                if len(rows) == 2 and all(id(row) in position for row in rows):
                    # what admission meets between the two rows may take slots first: count all of it
                    between = abs(position[id(rows[0])] - position[id(rows[1])]) - 1
                    if free >= 2 + between:
                        free -= 2
                        continue
                held_pairs.add(pair)
        held = []
        for queue in everywhere:
            requests = [request for request in queue if pair_of(request) in held_pairs]
            if requests:
                queue.remove_requests(requests)
                held.append((queue, requests))
        return held


class PairScheduler(_HoldsUnstartablePairs, Scheduler):
    pass


class PairAsyncScheduler(_HoldsUnstartablePairs, AsyncScheduler):
    pass
