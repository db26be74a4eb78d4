"""vLLM scheduler that admits the two rows of a CFG pair as a gang (imported only inside the engine worker).

vLLM admits waiting requests one by one; a pair whose cond row gets the last free slot while its uncond
row waits would run out of step, and every such step costs the driver a restart. Before each
`schedule()`, this subclass takes out of the waiting queue every pair that cannot start whole (fewer
than two free slots, or its partner is not waiting), and puts them back, in order, afterwards.
Preemption is not ganged: a preempted row's partner goes on alone, gets the sentinel and the driver
resubmits the pair (our parent-side KV admission keeps preemption rare).

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


class _HoldsUnstartablePairs:
    def schedule(self, *args, **kwargs):
        held = self._hold_unstartable_pairs()
        try:
            return super().schedule(*args, **kwargs)
        finally:
            if held:
                self.waiting.prepend_requests(reversed(held))  # prepend reverses: keep their order

    def _hold_unstartable_pairs(self) -> list:
        waiting = list(self.waiting)
        members: dict[str, list] = {}
        for request in waiting:
            pair = pair_of(request)
            if pair is not None:
                members.setdefault(pair, []).append(request)
        if not members:
            return []
        free, held, seen = self.max_num_running_reqs - len(self.running), [], set()
        for request in waiting:
            pair = pair_of(request)
            if pair is None:
                free -= 1  # a single request ahead takes a slot first
            elif pair not in seen:
                seen.add(pair)
                if len(members[pair]) == 2 and free >= 2:
                    free -= 2
                else:
                    held += members[pair]
        if held:
            self.waiting.remove_requests(held)
        return held


class PairScheduler(_HoldsUnstartablePairs, Scheduler):
    pass


class PairAsyncScheduler(_HoldsUnstartablePairs, AsyncScheduler):
    pass
