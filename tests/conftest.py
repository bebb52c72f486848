"""Shared test setup: GPU-test skipping, CPU threading, and embedded-LLM fixtures."""
import os

import pytest
import torch

# Every steady-state decode step the runner prepares through its fast path is checked
# against the general path (hybrid_engine/runner.py, CHECK_FAST_PATHS_ENV).
os.environ.setdefault("HYBRID_ENGINE_CHECK_FAST_PATHS", "1")

# The embedded model is tiny: on a small shared CPU box intra-op threads only add
# contention (measured 50-100x slower steps with 2 busy cores). Override with the env var.
if not torch.cuda.is_available():
    torch.set_num_threads(int(os.environ.get("HYBRID_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests skip when no CUDA device is present, except in modules that
    set `RUNS_IN_TRITON_INTERPRETER` when TRITON_INTERPRET=1 (Triton kernels on the CPU)."""
    if torch.cuda.is_available():
        return
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not (interpret and getattr(item.module, "RUNS_IN_TRITON_INTERPRETER", False)):
            item.add_marker(skip)


def _make_llm(**kwargs):
    from hybrid_engine import LLM

    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("dtype", "float32")
    return LLM(**kwargs)


@pytest.fixture
def make_llm():
    """Factory for the embedded model on CPU/float32: `make_llm(num_kv_blocks=8, ...)`."""
    return _make_llm


@pytest.fixture(scope="session")
def solo():
    """`solo(prompt, params)` -> RequestOutput of that request alone in a fresh LLM with ample
    memory (cached per session: a solo run depends only on model, prompt and params)."""
    cache = {}

    def run(prompt, params):
        key = (prompt if isinstance(prompt, str) else tuple(prompt), repr(params))
        if key not in cache:
            llm = _make_llm(max_num_seqs=1)
            cache[key] = llm.generate([prompt], params, use_tqdm=False)[0]
        return cache[key]

    return run
