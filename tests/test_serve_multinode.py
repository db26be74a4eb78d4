"""`serve --ray-address` on a real two-node Ray cluster on this machine: a head (`ray start --head`, no CPUs, so
replicas land elsewhere) and a worker node started inside its own mount namespace, where the data dir is either
an empty file system of its own (a node that does not share it) or the head's (a shared one). Also `doctor
--ray-address` on that cluster's resources (the head declares 8 GPUs: Ray counts them, nothing uses them)."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving import ROOT, ProcessServer, wait_for

pytest.importorskip("ray.serve", reason="pip install 'yue2-vllm[ray]'")
BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")
GENERATION = {"abc": {"max_tokens": 6, "min_tokens": 6}, "semantic": {"max_tokens": 12, "min_tokens": 12},
              "ode_steps": 2}


def can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


pytestmark = [pytest.mark.skipif(not can_unshare(), reason="needs root and unshare -m (mount namespaces)"),
              pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node with no CPUs and 8 (logical) GPUs; `add_node(shared)` starts a 2-CPU worker node whose view of
    the data dir's parent is the head's (`shared`) or an empty tmpfs."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": f"{BIN}:{os.environ['PATH']}"}
    root = tmp_path_factory.mktemp("cluster")
    port = free_port()
    subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True)
    head = subprocess.run([RAY, "start", "--head", "--port", str(port), "--num-cpus", "0", "--num-gpus", "8",
                           "--include-dashboard", "false", "--disable-usage-stats"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert head.returncode == 0, head.stderr[-2000:]
    nodes: list[subprocess.Popen] = []

    def add_node(shared: bool) -> subprocess.Popen:
        for node in nodes:  # one worker node at a time
            node.terminate()
            node.wait(60)
        nodes.clear()
        mount = f"mount --bind {root} {root}" if shared else f"mount -t tmpfs none {root}"
        node = subprocess.Popen(["unshare", "-m", "sh", "-c", f"{mount} && exec {RAY} start --address "
                                 f"127.0.0.1:{port} --num-cpus 2 --block --disable-usage-stats"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        nodes.append(node)
        code = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR');"
                "print(ray.cluster_resources().get('CPU', 0))")
        wait_for(lambda: subprocess.run([sys.executable, "-c", code, f"127.0.0.1:{port}"], env=env,
                                        capture_output=True, text=True).stdout.strip(),
                 lambda cpus: cpus == "2.0", timeout=120, interval=1)
        return node

    yield {"address": f"127.0.0.1:{port}", "env": env, "root": root, "add_node": add_node}
    for node in nodes:
        node.terminate()
        node.wait(60)
    subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True)


def serve(cluster, *more: str) -> ProcessServer:
    config = cluster["root"] / "generation.json"
    config.write_text(json.dumps(GENERATION), encoding="utf-8")
    return ProcessServer(["--ray-address", cluster["address"], "--replicas", "1", "--replica-gpus", "0",
                          "--backend", "torch", "--data-dir", str(cluster["root"] / "data"), "--config", str(config),
                          *more], env=cluster["env"], log=cluster["root"] / "serve.log")


def test_doctor_shows_the_cluster_and_how_many_replicas_fit(cluster):
    cluster["add_node"](shared=True)

    def doctor(*more: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "yue2_vllm.cli", "doctor", "--ray-address", cluster["address"],
                               "--budget", "40", *more], capture_output=True, text=True, cwd=ROOT, env=cluster["env"],
                              timeout=300)
        return json.loads(done.stdout)["cluster"]

    report = doctor()  # one replica per GPU by default; each also reserves a core, and the cluster has two
    assert report["resources"]["GPU"] == 8 and report["resources"]["CPU"] == 2
    assert [node["resources"].get("GPU", 0) for node in report["nodes"]].count(8) == 1
    assert report["per_replica"]["gpus"] == 1 and report["per_replica"]["device"] == "cuda"
    assert report["replicas"] == {"asked": 8, "fit": 2, "by_gpus": 8, "by_cpus": 2, "by_memory_split": 8}
    assert report["problems"] == ["--replicas 8 × 1 CPU needs 8 CPUs, the cluster has 2", "8 replicas asked for, 2 fit"]
    report = doctor("--replicas", "16", "--replica-gpus", "0.5", "--replica-cpus", "1", "--budget", "20")
    assert report["replicas"]["by_gpus"] == 16 and report["replicas"]["fit"] == 2
    assert doctor("--replicas", "2")["problems"] == []


def test_a_node_that_cannot_see_the_data_dir_is_refused_then_a_shared_one_serves(cluster):
    cluster["add_node"](shared=False)
    server = serve(cluster)
    try:
        health = wait_for(lambda: server.client.get("/health"), lambda r: "data dir" in r.text, timeout=300)
        assert health.status_code == 503
        [problem] = health.json()["problems"]
        assert "DataDirUnreachable" in problem and "shared file system" in problem and "cluster.json" in problem
        refused = server.client.post("/v1/songs", json={"style": "pop", "lyrics": "la"})
        assert refused.status_code == 503 and "cannot see the data dir" in refused.json()["error"]["message"]
    finally:
        assert server.stop(timeout=120) == 0
    cluster["add_node"](shared=True)
    server = serve(cluster)
    try:
        server.wait_healthy(timeout=300)
        job = server.client.post("/v1/songs", json={"style": "pop", "lyrics": "la", "seed": 3}).json()["id"]
        doc = wait_for(lambda: server.client.get(f"/v1/songs/{job}").json(),
                       lambda d: d["status"] in ("complete", "failed", "cancelled"), timeout=300)
        assert doc["status"] == "complete", doc["error"]
        [replica] = server.client.get("/health").json()["replica_states"]
        assert replica["replica"] == doc["stages"]["audio"]["replica"]
    finally:
        started = time.monotonic()
        assert server.stop(timeout=120) == 0 and time.monotonic() - started < 60
    # The ingress took its replicas along (the cluster stays): nothing of ours is left deployed.
    code = "import ray, sys; from ray import serve; ray.init(address=sys.argv[1]); print(list(serve.status().applications))"
    left = subprocess.run([sys.executable, "-c", code, cluster["address"]], env=cluster["env"], capture_output=True,
                          text=True, timeout=120).stdout
    assert "yue2" not in left
