"""`serve_hybrid.py --tensor-parallel-size 2` on CPU: the server starts its worker, serves
the single-process engine's tokens, answers 503 once the worker dies (the engine is
dead: requests would hang otherwise), and leaves no worker behind when it exits."""
import os
import signal
import time

import httpx

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.models.embedded import EMBEDDED_MODEL_NAME
from tests.server.conftest import child_processes, process_alive, start_subprocess_server, wait_until

PROMPT = "tensor parallel"


def _workers(server_pid: int) -> list[int]:
    """The tensor-parallel worker processes below the server (its engine process starts them)."""
    found, todo = [], child_processes(server_pid)
    while todo:
        pid = todo.pop()
        todo += child_processes(pid)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"hybrid_engine.parallel.worker" in f.read():
                found.append(pid)
    return found


def test_tensor_parallel_server_serves_then_reports_a_dead_worker():
    expected = LLM(device="cpu", max_model_len=128).generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].text
    with start_subprocess_server("--device", "cpu", "--max-model-len", "128", "--tensor-parallel-size", "2") as (
            url, proc):
        workers = _workers(proc.pid)
        assert len(workers) == 1
        body = {"model": EMBEDDED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        os.kill(workers[0], signal.SIGKILL)
        # The next request fails (the step breaks the group: 500), then the server is down (503).
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code in (500, 503)
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, timeout=30,
                   what="/health to report the dead engine")
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(map(process_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(process_alive, workers))


def test_tensor_parallel_server_exits_cleanly_with_its_workers():
    with start_subprocess_server("--device", "cpu", "--max-model-len", "128", "--tensor-parallel-size", "2") as (
            url, proc):
        workers = _workers(proc.pid)
        r = httpx.post(f"{url}/v1/completions", json={"model": EMBEDDED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert workers and not any(map(process_alive, workers))
