"""Server test fixtures: real uvicorn servers on 127.0.0.1 over the embedded model.

`server` runs in this process (a background thread) over `FaultyEngine`, the real
engine plus switches the tests flip to inject failures; `start_subprocess_server`
runs `scripts/serve_hybrid.py` itself (CLI, signals, exit code).
"""
import contextlib
import functools
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import httpx
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.server.api import build_app
from hybrid_engine.server.async_llm import AsyncLLM
from hybrid_engine.server.connections import uvicorn_config
from hybrid_engine.server.limits import ServerLimits

REPO = Path(__file__).resolve().parents[2]
SERVE_SCRIPT = REPO / "scripts" / "serve_hybrid.py"
# Small context: an unset max_tokens (= the room left) stays cheap on CPU.
MAX_MODEL_LEN = 128


class FaultyEngine(LLMEngine):
    """LLMEngine whose next step or add_requests can be made to raise, and whose steps can
    be slowed down (to catch a request mid-flight). The switches are thread-safe; the
    engine itself is still only used by the server's engine thread."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.fail_next_step = threading.Event()
        self.fail_next_add = threading.Event()
        self.step_delay = 0.0

    def step(self):
        if self.fail_next_step.is_set():
            self.fail_next_step.clear()
            raise RuntimeError("injected step failure")
        time.sleep(self.step_delay)
        return super().step()

    def add_requests(self, requests):
        if self.fail_next_add.is_set():
            self.fail_next_add.clear()
            raise RuntimeError("injected add_requests failure")
        return super().add_requests(requests)


@dataclass
class Server:
    """A running test server."""

    url: str
    llm: AsyncLLM
    engine: LLMEngine | None  # None when it runs in its own process

    def metrics(self) -> dict[str, float]:
        """/metrics as {"name{label=value}": value} (labels sorted, counters with _total)."""
        text = httpx.get(f"{self.url}/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return values

    def idle_and_free(self) -> bool:
        """Nothing in flight and every KV block and Mamba slot back in its pool."""
        m = self.metrics()
        return (m["hybrid_engine_num_requests_in_flight"] == 0 and m["hybrid_engine_num_requests_running"] == 0
                and m["hybrid_engine_num_requests_waiting"] == 0
                and m["hybrid_engine_kv_blocks_free"] == m["hybrid_engine_kv_blocks_total"]
                and m["hybrid_engine_mamba_slots_free"] == m["hybrid_engine_mamba_slots_total"])

    def assert_healthy(self) -> None:
        """/health is 200 and a normal request completes."""
        assert httpx.get(f"{self.url}/health").status_code == 200
        r = httpx.post(f"{self.url}/v1/completions", json={"prompt": "ok?", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1


@dataclass
class RawResponse:
    """An HTTP response read off a raw socket (`read_response`)."""

    status: int
    headers: dict[str, str]
    body: bytes
    interim: list[int]  # statuses of the 1xx responses before it

    def json(self) -> dict:
        """The body as JSON."""
        return json.loads(self.body)


def raw_connect(url: str, timeout: float = 30.0) -> socket.socket:
    """A TCP connection to the server at `url` (reads time out after `timeout` seconds)."""
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def request_head(method: str, path: str, **headers: str) -> bytes:
    """An HTTP/1.1 request line and headers (`content_length="5"` -> "content-length: 5")."""
    lines = [f"{method} {path} HTTP/1.1", "host: test"] + [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_request(path: str, body: dict) -> bytes:
    """A complete POST of `body` as JSON."""
    data = json.dumps(body).encode()
    return request_head("POST", path, content_type="application/json", content_length=str(len(data))) + data


def read_response(sock: socket.socket) -> RawResponse:
    """Read one response (skipping 1xx ones) with a Content-Length, chunked, or up to EOF body."""
    f = sock.makefile("rb")
    interim: list[int] = []
    while True:
        status_line = f.readline()
        assert status_line.startswith(b"HTTP/1.1 "), status_line
        status = int(status_line.split()[1])
        headers = {}
        while (line := f.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status >= 200:
            break
        interim.append(status)
    if "content-length" in headers:
        body = f.read(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while (size := int(f.readline().split(b";")[0], 16)) > 0:
            body += f.read(size)
            f.readline()
        f.readline()
    else:
        body = f.read()
    return RawResponse(status, headers, body, interim)


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    """Poll `predicate` until true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def child_processes(pid: int) -> list[int]:
    """Child processes of `pid`, whichever of its threads started them (Linux /proc)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(p) for p in f.read().split()]
    return children


def process_alive(pid: int) -> bool:
    """True while process `pid` runs (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessEngine(LLMEngine):
    """LLMEngine for a server whose engine runs in a process of its own (`engine_process`),
    built through `process_engine`: it runs with this test session's intra-op threads (a
    spawned process starts with torch's default; tests/conftest.py says why tests use
    fewer), takes `start_delay` seconds longer to build, sleeps `step_delay` seconds before
    each step, and raises from the steps numbered in `fail_steps` (counted from 0)."""

    def __init__(self, config: EngineConfig, num_threads: int, step_delay: float, start_delay: float,
                 fail_steps: tuple[int, ...]):
        torch.set_num_threads(num_threads)
        time.sleep(start_delay)
        super().__init__(config)
        self.step_delay, self.fail_steps, self.num_steps = step_delay, fail_steps, 0

    def step(self):
        self.num_steps += 1
        if self.num_steps - 1 in self.fail_steps:
            raise RuntimeError("injected step failure")
        time.sleep(self.step_delay)
        return super().step()


class UnsendableEngine(LLMEngine):
    """LLMEngine whose tokenizer copies but does not pickle: its engine process cannot send
    the server its `EngineInfo`."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.tokenizer.unpicklable = lambda: None


def process_engine(config: EngineConfig, step_delay: float = 0.0, start_delay: float = 0.0,
                   fail_steps: tuple[int, ...] = ()) -> Callable[[], LLMEngine]:
    """A picklable factory of a `ProcessEngine`."""
    return functools.partial(ProcessEngine, config, torch.get_num_threads(), step_delay, start_delay, fail_steps)


@contextlib.contextmanager
def serve_in_thread(engine_factory: Callable[[], LLMEngine], max_waiting_requests: int = 256,
                    limits: ServerLimits = ServerLimits(), served_model_names: list[str] | None = None,
                    reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> Iterator[Server]:
    """A uvicorn server for `build_app` in a background thread, its engine on a thread of
    this process (`Server.engine` reaches it)."""
    engines: list[LLMEngine] = []

    def build() -> LLMEngine:  # runs on the engine thread; keep a handle for the switches
        engines.append(engine_factory())
        return engines[0]

    llm = AsyncLLM(build, max_waiting_requests=max_waiting_requests)
    with _serve(llm, limits, served_model_names, reasoning_parser, tool_call_parser) as url:
        yield Server(url, llm, engines[0])


@contextlib.contextmanager
def serve_engine_process(engine_factory: Callable[[], LLMEngine]) -> Iterator[Server]:
    """A uvicorn server for `build_app` in a background thread, its engine in a process of
    its own (`engine_factory` picklable; `Server.engine` is None)."""
    llm = AsyncLLM(engine_factory, engine_process=True)
    with _serve(llm, ServerLimits()) as url:
        yield Server(url, llm, None)


@contextlib.contextmanager
def _serve(llm: AsyncLLM, limits: ServerLimits, served_model_names: list[str] | None = None,
           reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> Iterator[str]:
    """Serve `llm` from a uvicorn thread on a socket bound up front, configured as the CLI
    configures it (`uvicorn_config`); yields the base URL. The engine is shut down after."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = build_app(llm, served_model_names, limits=limits, reasoning_parser=reasoning_parser,
                    tool_call_parser=tool_call_parser)
    server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="the test server to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        llm.shutdown()


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """The shared server: embedded model on CPU, 16 sequences, context 128."""
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    with serve_in_thread(lambda: FaultyEngine(config)) as s:
        yield s


@pytest.fixture
def engine_switches(server: Server) -> Iterator[FaultyEngine]:
    """The shared server's FaultyEngine, with every switch reset afterwards."""
    engine = server.engine
    yield engine
    engine.step_delay = 0.0
    engine.fail_next_step.clear()
    engine.fail_next_add.clear()


@contextlib.contextmanager
def start_subprocess_server(*flags: str, log: BinaryIO | None = None,
                            open_files: int | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`scripts/serve_hybrid.py` in a child process; yields (base url, process) once healthy.

    Its stdout and stderr go to `log` (a binary file) if given; `open_files` sets its limit
    on open files (soft and hard). Afterwards the process is killed if still running (tests
    SIGTERM it themselves).
    """
    port = free_port()
    own_log = log is None
    log = tempfile.TemporaryFile() if log is None else log
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 busy CPU cores: intra-op threads only contend
    proc = subprocess.Popen([sys.executable, str(SERVE_SCRIPT), "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning", *flags], stdout=log, stderr=subprocess.STDOUT, env=env)
    if open_files is not None:  # long before the server reads it, after loading the model
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (open_files, open_files))
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read().decode(errors='replace')}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        return False

    try:
        wait_until(up, timeout=90, what="the server subprocess to start")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if own_log:
            log.close()
