"""The pair hold on vLLM's own `Scheduler` (the installed release's class, real configs, real KV cache manager):
both rows of a CFG pair are admitted in the same step, never one alone, as that release's admission counts
(`kv_holding_waiting` drained first, `max_num_active_reqs` as the limit, 0.31+)."""
import pytest

from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.protocol import Sampling

needs_vllm = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
BLOCK = 16


@pytest.fixture(scope="module")
def make_scheduler(tiny_model_dir, tmp_path_factory):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from yue2_vllm.derive import derive_ar_checkpoint
    import torch

    derived = derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache-sched"))
    model_config = ModelConfig(model=str(derived), dtype="float32", skip_tokenizer_init=True, max_model_len=256)

    def build(cls, max_num_seqs: int, max_num_active_seqs: int | None = None):
        scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_active_seqs=max_num_active_seqs,
                                           max_num_batched_tokens=1024, max_model_len=256,
                                           is_encoder_decoder=False)
        config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False))
        config.cache_config.num_gpu_blocks = 200  # what the engine core sets after profiling
        kv = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32,
                                                            dtype=torch.float32))])
        return cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                   block_size=BLOCK)

    return build


def request(request_id: str, pair: str | None = None, role: str = "cond"):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from yue2_vllm.engine.plugin import Pairing, row_args

    args = row_args("semantic", Sampling(), 1, pairing=Pairing(pair, role, 1.5) if pair else None)
    params = SamplingParams(temperature=0, max_tokens=20, extra_args=args)
    return Request(request_id=request_id, prompt_token_ids=list(range(1, 9)), sampling_params=params,
                   pooling_params=None, arrival_time=0.0)


def admitted(scheduler) -> set[str]:
    """Request ids scheduled in one step that were not running before it."""
    before = {r.request_id for r in scheduler.running}
    scheduler.schedule()
    return {r.request_id for r in scheduler.running} - before


def finish(scheduler, *ids: str) -> None:
    from vllm.v1.request import RequestStatus

    scheduler.finish_requests(list(ids), RequestStatus.FINISHED_ABORTED)


def kv_holding(scheduler, *requests) -> None:
    """Move waiting requests to the queue of those that hold KV blocks (admitted ahead of `waiting`, 0.31+)."""
    scheduler.waiting.remove_requests(list(requests))
    for r in requests:
        scheduler.kv_holding_waiting.add_request(r)


@needs_vllm
@pytest.mark.parametrize("cls_name", ["PairScheduler", "PairAsyncScheduler"])
def test_a_pair_waits_for_two_active_slots_then_starts_whole(make_scheduler, cls_name):
    from yue2_vllm.engine import scheduler as pair_scheduler

    scheduler = make_scheduler(getattr(pair_scheduler, cls_name), max_num_seqs=8, max_num_active_seqs=3)
    assert scheduler.max_num_active_reqs == 3 and scheduler.max_num_running_reqs == 8
    for r in (request("a"), request("p.c", "p"), request("p.u", "p", "uncond")):
        scheduler.add_request(r)
    assert admitted(scheduler) == {"a", "p.c", "p.u"}
    for r in (request("q.c", "q"), request("q.u", "q", "uncond"), request("b")):
        scheduler.add_request(r)
    assert admitted(scheduler) == set()  # 3 active of 3: nothing starts (8 runner slots would have let one in)
    finish(scheduler, "a")
    assert admitted(scheduler) == {"b"}  # one active slot: the single behind the pair takes it, the pair waits
    finish(scheduler, "p.c")
    assert admitted(scheduler) == set()
    finish(scheduler, "p.u")
    assert admitted(scheduler) == {"q.c", "q.u"}  # both rows in the same step
    assert [r.request_id for r in scheduler.waiting] == []


@needs_vllm
def test_a_pair_split_across_kv_holding_waiting_and_waiting_starts_whole(make_scheduler):
    from yue2_vllm.engine.scheduler import PairScheduler, admission_queues, free_slots

    scheduler = make_scheduler(PairScheduler, max_num_seqs=8, max_num_active_seqs=3)
    rows = {name: request(name, "r" if name.startswith("r") else None, "uncond" if name == "r.u" else "cond")
            for name in ("s1", "r.c", "s2", "r.u")}
    for r in rows.values():
        scheduler.add_request(r)
    kv_holding(scheduler, rows["s1"], rows["r.c"])  # drained first: s1, r.c, then waiting's s2, r.u
    assert admission_queues(scheduler) == [scheduler.kv_holding_waiting, scheduler.waiting]
    assert free_slots(scheduler) == 3
    # Unheld, vLLM would admit s1, r.c and s2 (3 active) and leave r.u behind.
    assert admitted(scheduler) == {"s1", "s2"}
    assert [r.request_id for r in scheduler.kv_holding_waiting] == ["r.c"]  # held rows keep their queues
    assert [r.request_id for r in scheduler.waiting] == ["r.u"]
    finish(scheduler, "s1")
    assert admitted(scheduler) == {"r.c", "r.u"}  # two slots: both rows, from their two queues, in one step


@needs_vllm
def test_a_pair_with_one_row_missing_is_held_and_singles_go_on(make_scheduler):
    from yue2_vllm.engine.scheduler import PairScheduler

    scheduler = make_scheduler(PairScheduler, max_num_seqs=4)
    scheduler.add_request(request("x.c", "x"))
    scheduler.add_request(request("c"))
    assert admitted(scheduler) == {"c"}  # the uncond row has not arrived: its cond row waits
    scheduler.add_request(request("x.u", "x", "uncond"))
    assert admitted(scheduler) == {"x.c", "x.u"}
