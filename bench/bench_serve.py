"""`yue2-vllm serve` under a bounded loopback load, on the tiny default (vLLM backend when installed).

Starts the server as a subprocess on 127.0.0.1 (random port, fresh data dir), then runs the same load
twice: --songs songs from --concurrency client threads (each POSTs a song, follows its SSE stream to the
final event, then the next), and again with the engine worker killed (SIGKILL) once mid-run. Prints a
Markdown table: songs/s, p50/p95 seconds from POST to complete, p50 seconds from POST to the first SSE
event and to the first token event, AR tok/s, lost jobs (accepted but not listed in a final state),
5xx answers, failed and retried songs. Every complete song's files are verified.

`--replicas 1 2` (the `ray` extra) runs the same load on `serve --replicas N` for each N, side by side — the
same songs in flight in all (each replica serves ceil(concurrency / N) at once) — and then, on the largest N,
the load again with one replica (its process) killed once mid-run; `0` in the list is the single-process
server. On a GPU node each replica takes a GPU: the same command measures N GPUs.
Run: `.venv/bin/python bench/bench_serve.py [--songs 32 --concurrency 8] [--replicas 1 2]`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from yue2_vllm.artifacts import verify_result

ROOT = Path(__file__).resolve().parent.parent
FINAL = ("complete", "failed", "cancelled")


class Server:
    def __init__(self, data_dir: Path, concurrency: int, log: Path, replicas: int = 0):
        self.log = open(log, "ab")
        per_replica = -(-concurrency // replicas) if replicas else concurrency
        command = [sys.executable, "-m", "yue2_vllm.cli", "serve", "--port", "0", "--data-dir", str(data_dir),
                   "--max-concurrency", str(per_replica), "--queue-size", "256", "--quiet",
                   *(["--replicas", str(replicas)] if replicas else [])]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, cwd=ROOT,
                                        env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.url = json.loads(self.process.stdout.readline())["url"]
        self.data_dir, self.replicas = data_dir, replicas

    def ready(self, client: httpx.Client) -> bool:
        health = client.get("/health")
        return health.status_code == 200 and (not self.replicas or health.json()["replicas"] ==
                                              f"{self.replicas}/{self.replicas}")

    def kill_once(self, client: httpx.Client) -> None:
        """What the faulty run kills: a replica's process (with replicas), else the engine worker."""
        if self.replicas:
            os.kill(client.get("/health").json()["replica_states"][0]["pid"], signal.SIGKILL)
            return
        worker_pid = self.engine_worker()
        if worker_pid is not None:
            os.killpg(worker_pid, signal.SIGKILL)

    def recovered(self, health: httpx.Response) -> bool:
        if health.status_code != 200:
            return False
        if self.replicas:
            return health.json()["replicas"] == f"{self.replicas}/{self.replicas}"
        return health.json()["engine"].get("restarts", 0) >= 1

    def engine_worker(self) -> int | None:
        """The engine worker: the child of the server process that leads its own process group (forked by any of
        the server's threads: the backend starts workers from a spawner thread of its own)."""
        tasks = Path(f"/proc/{self.process.pid}/task")
        children = [c for task in tasks.iterdir() for c in (task / "children").read_text(encoding="utf-8").split()]
        for child in map(int, children):
            try:
                if os.getpgid(child) == child:
                    return child
            except ProcessLookupError:
                continue
        return None

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(120)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def tokens_total(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("yue2_ar_tokens_total"))


def one_song(client: httpx.Client, index: int, statuses: Counter, lock: threading.Lock) -> dict:
    body = {"style": "pop, piano", "lyrics": f"[verse]\nla la {index}\n", "seed": 1000 + index}
    start = time.monotonic()
    response = client.post("/v1/songs", json=body, headers={"Idempotency-Key": f"bench-{index}-{start}"})
    with lock:
        statuses[response.status_code] += 1
    if response.status_code != 202:
        return {"index": index, "accepted": False, "status": response.status_code}
    job_id = response.json()["id"]
    song = {"index": index, "accepted": True, "id": job_id, "first_event": None, "first_token": None,
            "final": None, "retried": False}
    while song["final"] is None:  # reconnect if the stream breaks; the job is durable
        try:
            with client.stream("GET", f"/v1/songs/{job_id}/events", timeout=600) as events:
                with lock:
                    statuses[events.status_code] += 1
                kind = None
                for line in events.iter_lines():
                    now = time.monotonic() - start
                    if line.startswith("event: "):
                        kind = line[7:]
                        song["first_event"] = song["first_event"] or now
                        if kind == "tokens":
                            song["first_token"] = song["first_token"] or now
                        elif kind == "retry":
                            song["retried"] = True
                        elif kind in FINAL:
                            song["final"], song["seconds"] = kind, now
        except httpx.HTTPError:
            time.sleep(0.2)
    return song


def run_load(server: Server, songs: int, concurrency: int, kill_after: int | None) -> dict:
    statuses, health_codes, lock, results = Counter(), Counter(), threading.Lock(), []  # /v1 answers; /health
    client = httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=4 * concurrency))
    tokens_before = tokens_total(client)
    queue = list(range(songs))
    killed = {"at": None, "recovered": None}

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                index = queue.pop(0)
            song = one_song(client, index, statuses, lock)
            with lock:
                results.append(song)
                done = sum(1 for r in results if r.get("final"))
                kill_now = kill_after is not None and done >= kill_after and killed["at"] is None
                if kill_now:
                    killed["at"] = time.monotonic()
            if kill_now:
                server.kill_once(client)

    start = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    if kill_after is not None:
        while killed["at"] is None and any(t.is_alive() for t in threads):
            time.sleep(0.05)
        seen_down = False  # back only after /health has shown the death (503, or fewer replicas)
        while killed["at"] is not None and killed["recovered"] is None:  # until the engine / replica is back
            health = client.get("/health")
            health_codes[health.status_code] += 1
            back = server.recovered(health)
            seen_down = seen_down or not back or time.monotonic() - killed["at"] > 15
            if back and seen_down:
                killed["recovered"] = time.monotonic() - killed["at"]
            time.sleep(0.1)
    for thread in threads:
        thread.join()
    wall = time.monotonic() - start
    tokens = tokens_total(client) - tokens_before
    accepted = {r["id"] for r in results if r["accepted"]}
    listed, cursor = {}, None
    while True:
        page = client.get("/v1/songs", params={"limit": 200, **({"cursor": cursor} if cursor else {})}).json()
        listed.update({s["id"]: s["status"] for s in page["songs"]})
        cursor = page["next_cursor"]
        if cursor is None:
            break
    lost = [job for job in accepted if listed.get(job) not in FINAL]
    complete = [r for r in results if r.get("final") == "complete"]
    for song in complete:
        verify_result(server.data_dir / "jobs" / song["id"])
    health = client.get("/health").status_code
    client.close()
    return {"songs": songs, "concurrency": concurrency, "wall": wall, "songs_per_s": len(complete) / wall,
            "complete": len(complete), "failed": sum(1 for r in results if r.get("final") == "failed"),
            "retried": sum(1 for r in results if r.get("retried")), "lost": len(lost),
            "http_5xx": sum(n for code, n in statuses.items() if code >= 500),
            "health_503": health_codes.get(503, 0), "health_after": health,
            "p50_complete": percentile([r["seconds"] for r in complete], 0.5),
            "p95_complete": percentile([r["seconds"] for r in complete], 0.95),
            "p50_first_event": percentile([r["first_event"] for r in results if r.get("first_event")], 0.5),
            "p50_first_token": percentile([r["first_token"] for r in results if r.get("first_token")], 0.5),
            "ar_tok_s": tokens / wall, "engine_recovered_s": killed["recovered"]}


def serve_and_load(replicas: int, args, tmp: Path) -> list[tuple[str, dict]]:
    start = time.monotonic()
    name = f"{replicas} replica{'s' if replicas > 1 else ''}" if replicas else "one process"
    server = Server(tmp / f"data-{replicas}", args.concurrency, tmp / f"serve-{replicas}.log", replicas)
    client = httpx.Client(base_url=server.url, timeout=30)
    while not server.ready(client):
        time.sleep(0.2)
    engine = client.get("/health").json()["engine"]
    print(f"{name}: up in {time.monotonic() - start:.1f} s ({engine['backend']} backend, engine {engine['state']})",
          file=sys.stderr)
    try:
        runs = [(f"{name}: steady", run_load(server, args.songs, args.concurrency, None))]
        kill = not args.no_kill and (replicas == max(args.replicas) if replicas else engine["backend"] == "vllm")
        if kill:
            what = "a replica killed once" if replicas else "engine worker killed once"
            runs.append((f"{name}: {what}", run_load(server, args.songs, args.concurrency, args.songs // 4)))
    finally:
        client.close()
        server.stop()
        server.log.close()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--songs", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="client threads = the server's songs in flight")
    parser.add_argument("--replicas", type=int, nargs="+", default=[0],
                        help="serve --replicas N for each N, side by side (0: the single-process server; default 0)")
    parser.add_argument("--no-kill", action="store_true", help="skip the run with the engine worker / a replica "
                                                              "killed")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        for replicas in args.replicas:
            runs += serve_and_load(replicas, args, Path(tmp))
    print("\n| run | songs @ conc | songs/s | p50 / p95 to complete (s) | p50 to 1st SSE event (s) | "
          "p50 to 1st token (s) | AR tok/s | complete | failed | retried | lost | 5xx | health 503s | "
          "back after (s) | /health after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs:
        recovered = f"{r['engine_recovered_s']:.1f}" if r["engine_recovered_s"] is not None else "–"
        print(f"| {name} | {r['songs']} @ {r['concurrency']} | {r['songs_per_s']:.2f} | {r['p50_complete']:.1f} / "
              f"{r['p95_complete']:.1f} | {r['p50_first_event']:.3f} | {r['p50_first_token']:.2f} | "
              f"{r['ar_tok_s']:.0f} | {r['complete']} | {r['failed']} | {r['retried']} | {r['lost']} | "
              f"{r['http_5xx']} | {r['health_503']} | {recovered} | {r['health_after']} |")
    steady = {name.split(":")[0]: r["songs_per_s"] for name, r in runs if name.endswith("steady")}
    if len(steady) > 1:
        first = next(iter(steady.values()))
        print("\nsongs/s relative to the first: " + ", ".join(f"{name} {value / first:.2f}x"
                                                                for name, value in steady.items()))


if __name__ == "__main__":
    main()
