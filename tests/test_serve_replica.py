"""The replica's parts that need no cluster: progress coalescing, the data-dir check, CPU pinning, and the
ingress's shaping of replicas, refusals and failure classification (serve/replica.py, serve/cluster.py)."""
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from yue2_vllm.request_json import UsageError
from yue2_vllm.serve.cluster import ReplicaShape, check_ray, shape_replicas

ray = pytest.importorskip("ray", reason="pip install 'yue2-vllm[ray]'")
from yue2_vllm.serve.replica import DataDirUnreachable, check_data_dir, coalesced, collapse  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_collapse_keeps_order_first_steps_and_the_last_of_each_run():
    events = [("state", {"state": "planning"}), *[("tokens", {"phase": "abc", "count": n}) for n in (1, 2, 3)],
              ("tokens", {"phase": "semantic", "count": 1}), ("tokens", {"phase": "semantic", "count": 2}),
              ("stage_done", {"stage": "plan"}), *[("nar", {"done": n, "total": 4}) for n in (1, 2, 3, 4)],
              ("vae", {"done": 1, "total": 2}), ("vae", {"done": 2, "total": 2})]
    assert collapse(events) == [
        ("state", {"state": "planning"}), ("tokens", {"phase": "abc", "count": 3}),
        ("tokens", {"phase": "semantic", "count": 2}), ("stage_done", {"stage": "plan"}),
        ("nar", {"done": 1, "total": 4}), ("nar", {"done": 4, "total": 4}),
        ("vae", {"done": 1, "total": 2}), ("vae", {"done": 2, "total": 2})]


def test_coalesced_sends_other_events_at_once_and_progress_a_few_times_a_second():
    async def scenario():
        inbox: asyncio.Queue = asyncio.Queue()
        out: list[tuple[float, str, dict]] = []
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def consume():
            async for kind, data in coalesced(inbox, 0.2):
                out.append((loop.time() - start, kind, data))
                if kind == "complete":
                    return

        task = asyncio.create_task(consume())
        for count in range(1, 101):  # 100 tokens over ~0.5 s
            inbox.put_nowait(("tokens", {"phase": "semantic", "count": count}))
            await asyncio.sleep(0.005)
        inbox.put_nowait(("complete", {"error": None}))
        await asyncio.wait_for(task, 5)
        return out

    out = asyncio.run(scenario())
    kinds = [kind for _, kind, _ in out]
    assert kinds[-1] == "complete" and 2 <= kinds.count("tokens") <= 6, kinds
    assert out[-2][2]["count"] == 100  # the last count is never lost
    counts = [data["count"] for _, kind, data in out if kind == "tokens"]
    assert counts == sorted(counts)


def test_a_replica_that_cannot_see_the_data_dir_is_refused_with_the_reason(tmp_path):
    data = tmp_path / "data"
    with pytest.raises(DataDirUnreachable, match=r"cannot see the data dir .*data.*shared file system"):
        check_data_dir(data, "t0k3n", "node-b")
    data.mkdir()
    (data / "cluster.json").write_text(json.dumps({"token": "other"}), encoding="utf-8")
    with pytest.raises(DataDirUnreachable, match="another server's"):
        check_data_dir(data, "t0k3n", "node-b")
    (data / "cluster.json").write_text(json.dumps({"token": "t0k3n"}), encoding="utf-8")
    (data / "jobs").write_text("not a directory", encoding="utf-8")
    with pytest.raises(DataDirUnreachable, match="cannot write into"):
        check_data_dir(data, "t0k3n", "node-b")
    (data / "jobs").unlink()
    check_data_dir(data, "t0k3n", "node-b")
    assert list((data / "jobs").iterdir()) == []  # the write probe leaves nothing behind


def test_pin_cpus_moves_every_thread_of_the_replica_onto_its_own_cores():
    if len(os.sched_getaffinity(0)) < 2:  # asked at run time: under xdist this file's fixture gives it all the cores
        pytest.skip("needs two cores")
    code = ("import os, threading, time; from yue2_vllm.serve.replica import pin_cpus;"
            "t = threading.Thread(target=time.sleep, args=(2,)); t.start();"
            "mine = pin_cpus(1, 1);"
            "print(mine, sorted({tuple(sorted(os.sched_getaffinity(int(x)))) for x in os.listdir('/proc/self/task')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    cores = sorted(os.sched_getaffinity(0))
    assert out.split() == [f"[{cores[1]}]", f"[({cores[1]},)]"], out


@pytest.mark.parametrize("resources, replicas, gpus, cpus, shape", [
    ({"CPU": 2}, 2, None, None, ReplicaShape(2, 0.0, 1)),
    ({"CPU": 16}, None, None, None, ReplicaShape(1, 0.0, 16)),
    ({"CPU": 64, "GPU": 8}, None, None, None, ReplicaShape(8, 1.0, 1)),
    ({"CPU": 64, "GPU": 8}, 4, None, 8, ReplicaShape(4, 1.0, 8)),
    ({"CPU": 64, "GPU": 8}, 16, 0.5, None, ReplicaShape(16, 0.5, 1)),  # fractional: asked for
    ({"CPU": 64, "GPU": 8}, 2, 0, 4, ReplicaShape(2, 0.0, 4)),  # CPU replicas on a GPU node
])
def test_replicas_are_shaped_one_gpu_each_or_the_cores_shared_out(resources, replicas, gpus, cpus, shape):
    assert shape_replicas(resources, replicas, gpus, cpus) == shape


@pytest.mark.parametrize("resources, replicas, gpus, words", [
    ({"CPU": 2}, 3, None, "needs 3 CPUs, the cluster has 2"),
    ({"CPU": 64, "GPU": 8}, 16, None, "needs 16 GPUs, the cluster has 8; --replica-gpus 0.5 would share"),
    ({"CPU": 64, "GPU": 8}, 2, 1.5, "a fraction of one GPU, or whole GPUs"),
])
def test_shapes_that_cannot_fit_are_refused_naming_the_numbers(resources, replicas, gpus, words):
    with pytest.raises(UsageError, match=words.replace(".", r"\.")):
        shape_replicas(resources, replicas, gpus)
    if "fraction" not in words:  # a cluster that may grow: logged, not refused
        assert shape_replicas(resources, replicas, gpus, strict=False).replicas == replicas


def test_without_ray_the_replica_flags_name_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UsageError, match=r"pip install 'yue2-vllm\[ray\]'"):
        check_ray()
    code = ("import sys; sys.modules['ray'] = None; from yue2_vllm.cli import main;"
            f"sys.exit(main(['serve', '--replicas', '2', '--port', '0', '--data-dir', {str(tmp_path / 'd')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    status = json.loads(done.stdout.splitlines()[0])
    assert status["status"] == "failed" and "yue2-vllm[ray]" in status["reason"]
    assert not (tmp_path / "d").exists()  # refused before anything was written


def test_a_stream_that_fails_because_its_replica_died_is_told_from_an_error_of_the_replica():
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

    from yue2_vllm.serve.cluster import replica_lost

    assert replica_lost(ActorDiedError())
    assert replica_lost(ActorUnavailableError("unreachable", None))
    raised = RayTaskError("run", "Traceback ...", RuntimeError("job j1 is already running")).as_instanceof_cause()
    assert not replica_lost(raised)
    assert not replica_lost(RuntimeError("not from Ray"))


def test_a_local_cluster_that_cannot_hold_the_replicas_is_refused_before_anything_starts(tmp_path):
    cores = len(os.sched_getaffinity(0))
    done = subprocess.run([sys.executable, "-m", "yue2_vllm.cli", "serve", "--replicas", str(cores + 1), "--port", "0",
                           "--data-dir", str(tmp_path / "d")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    status = json.loads(done.stdout.splitlines()[0])
    assert status["reason"] == f"--replicas {cores + 1} × 1 CPU needs {cores + 1} CPUs, the cluster has {cores}"
    assert not (tmp_path / "d").exists() and "Started a local Ray instance" not in done.stderr
