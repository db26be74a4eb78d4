"""Helpers for the server tests: a real uvicorn server on a random loopback port, in a thread or a subprocess."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
# Songs of a few tokens, two ODE steps: a whole song in about a second on the tiny model.
GENERATION = {"abc": {"max_tokens": 6, "min_tokens": 6}, "semantic": {"max_tokens": 12, "min_tokens": 12},
              "ode_steps": 2}


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_vae_dir):
    """The tiny pipeline with GENERATION's budgets (import it into a test module to use it as a fixture)."""
    from yue2_vllm.pipeline import YuE2Pipeline

    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION) as pipe:
        yield pipe


class ThreadServer:
    """`create_app(service, ...)` served by uvicorn in a background thread (lifespan included), as `serve` serves
    it (`uvicorn_server`: its shutdown answers the calls waiting for songs first)."""

    def __init__(self, service, **app_options):
        import uvicorn

        from yue2_vllm.serve.app import create_app
        from yue2_vllm.serve.runner import uvicorn_server

        self.service = service
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(create_app(service, **app_options), lifespan="on", log_level="warning", ws="none",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn_server(config, service)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def stop(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the server did not stop"


class ProcessServer:
    """`python -m yue2_vllm.cli serve ARGS --port 0`; its status line says where it listens."""

    def __init__(self, args: list[str], env: dict | None = None, log: Path | None = None, serving: bool = True):
        self.log = open(log, "ab") if log else subprocess.DEVNULL
        self.process = subprocess.Popen([sys.executable, "-m", "yue2_vllm.cli", "serve", "--port", "0", *args],
                                        stdout=subprocess.PIPE, stderr=self.log, cwd=ROOT,
                                        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
        line = self.process.stdout.readline()
        assert line, f"serve exited with {self.process.wait()} before listening"
        self.starting = json.loads(line)  # the port is bound: /health answers 503 with the start-up's phase
        assert self.starting["status"] == "starting", self.starting
        self.url = self.starting["url"]
        self.client = httpx.Client(base_url=self.url, timeout=30)
        if serving:
            self.wait_serving()

    def wait_serving(self) -> dict:
        """The second status line: the app serves."""
        line = self.process.stdout.readline()
        assert line, f"serve exited with {self.process.wait()} before serving"
        self.status = json.loads(line)
        assert self.status["status"] == "serving" and self.status["url"] == self.url, self.status
        return self.status

    def wait_healthy(self, timeout: float = 300) -> dict:
        return wait_for(lambda: self.client.get("/health"), lambda r: r.status_code == 200, timeout).json()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.client.close()

    def stop(self, timeout: float = 60) -> int:
        self.process.terminate()
        code = self.process.wait(timeout)
        self.client.close()
        return code


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(poll, done, timeout: float = 120, interval: float = 0.05):
    """Call `poll()` until `done(value)`; the last value, or an AssertionError naming it."""
    deadline = time.monotonic() + timeout
    while True:
        value = poll()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"timed out waiting; last: {getattr(value, 'text', value)!r:.600}"
        time.sleep(interval)


def read_events(client: httpx.Client, job_id: str, timeout: float = 120) -> list[tuple[str, dict, float]]:
    """Every SSE event of a job until its final event: `(kind, data, seconds since connecting)`."""
    events, start = [], time.monotonic()
    with client.stream("GET", f"/v1/songs/{job_id}/events", timeout=timeout) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        kind, data = None, []
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif line == "" and kind is not None:
                events.append((kind, json.loads("\n".join(data)), time.monotonic() - start))
                kind, data = None, []
    return events


@contextlib.contextmanager
def tmpfs(directory: Path, size: str = "32m"):
    """A tmpfs of `size` at `directory` (skipped with the reason when it cannot be mounted here)."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a real full filesystem needs a tmpfs mount, and this test does not run as root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill(directory: Path) -> Path:
    """Take every free byte of `directory`'s filesystem with one file; its path."""
    ballast = directory / "ballast"
    descriptor = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 4096, 512):  # the last blocks too
            try:
                while os.write(descriptor, b"\0" * size) == size:
                    pass
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(descriptor)
    return ballast
