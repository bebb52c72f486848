"""Invariant 2 in the running engine: exactly one host-to-device bookkeeping copy per step,
the device view is a byte-identical mirror of the host buffer at that copy, and the forward
reads only the device view (poisoning the host buffer right after each copy changes nothing).

On CPU the "device" buffer is a separate tensor with its own storage and the copy is
synchronous, so overwriting the host bytes after `sync()` cannot leak into the device view:
any output change means something read the host buffer after the copy.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.engine.engine_helpers import assert_drained, assert_mode_ran, byte_prompt, drive, greedy, seeded


def _bytes(view: torch.Tensor) -> torch.Tensor:
    """The whole storage behind a typed view, as a flat uint8 tensor (aliasing it)."""
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())


def _work():
    """Mixed prefill/decode, greedy / seeded / penalized / logprobs rows, staggered."""
    return [
        (0, "a", byte_prompt(30, 1), greedy(10)),
        (0, "b", byte_prompt(7, 2), seeded(12, seed=5)),
        (2, "c", byte_prompt(50, 3), seeded(9, seed=6, repetition_penalty=1.3, frequency_penalty=0.5)),
        (3, "d", byte_prompt(12, 4), greedy(8, logprobs=3, top_k=5)),
        (5, "e", byte_prompt(20, 5), seeded(10, seed=8, min_p=0.05)),
    ]


def _llm(make_llm, async_scheduling):
    # A small budget so prompts are chunked across steps that also carry decode rows.
    return make_llm(max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=async_scheduling)


class _HostToDeviceCopies(TorchDispatchMode):
    """Counts tensor ops that read a host step buffer and write the device step buffer --
    observed at the dispatcher, independently of the buffer's own `num_syncs` counter."""

    def __init__(self, host_storages: set[int], device_storage: int):
        super().__init__()
        self.host_storages, self.device_storage = host_storages, device_storage
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and tensors[0].untyped_storage().data_ptr() == self.device_storage and any(
                t.untyped_storage().data_ptr() in self.host_storages for t in tensors[1:]):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_one_h2d_copy_per_step(make_llm, async_scheduling):
    llm = _llm(make_llm, async_scheduling)
    buffer = llm.engine.runner.buffer
    hosts = {b.untyped_storage().data_ptr() for b in buffer._host_bytes}
    copies = _HostToDeviceCopies(hosts, _bytes(buffer.device["input_ids"]).data_ptr())
    with copies:
        drive(llm.engine, _work())
    stats = llm.engine.stats()
    assert stats["steps"] > 10
    assert copies.count == stats["steps"], (copies.count, stats)
    assert stats["h2d_copies"] == stats["steps"], stats
    assert_mode_ran(llm.engine)
    assert_drained(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_device_view_is_byte_identical_mirror(make_llm, async_scheduling):
    llm = _llm(make_llm, async_scheduling)
    buffer = llm.engine.runner.buffer
    original = buffer.sync
    checked = []

    def checking_sync(*args, **kwargs):
        host = _bytes(buffer.host["input_ids"])  # the host buffer this step was written into
        result = original(*args, **kwargs)
        device = _bytes(buffer.device["input_ids"])
        assert host.data_ptr() != device.data_ptr()
        assert host.numel() == device.numel() == buffer.nbytes
        assert torch.equal(host, device.cpu()), "device view differs from the host buffer after sync"
        checked.append(True)
        return result

    buffer.sync = checking_sync
    drive(llm.engine, _work())
    assert len(checked) == llm.engine.stats()["steps"] > 0
    assert_mode_ran(llm.engine)


def _poison(host: torch.Tensor, poison, gen: torch.Generator) -> None:
    if poison == "random":
        host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, generator=gen))
    else:
        host.fill_(poison)


def _assert_same_outputs(run, reference):
    for rid, ref in reference.items():
        out = run.finals[rid]
        assert out.output_token_ids == ref.output_token_ids, rid
        assert out.finish_reason == ref.finish_reason
        if ref.logprobs is not None:
            assert [list(d) for d in out.logprobs] == [list(d) for d in ref.logprobs]


POISONS = pytest.mark.parametrize("poison", [0xFF, 0x00, 0x7F, "random"])


@pytest.fixture(scope="module")
def reference():
    from tests.conftest import _make_llm

    return drive(_llm(_make_llm, False).engine, _work()).finals


@POISONS
def test_forward_reads_only_device_view(make_llm, reference, poison):
    """Host bytes are garbage from each copy until the next prepare (restored then)."""
    llm = _llm(make_llm, False)
    runner, buffer = llm.engine.runner, llm.engine.runner.buffer
    sync, prepare = buffer.sync, runner.prepare
    gen = torch.Generator().manual_seed(0)
    saved = []  # (host bytes, their real content) poisoned since the last prepare

    def poisoning_sync(*args, **kwargs):
        host = _bytes(buffer.host["input_ids"])
        result = sync(*args, **kwargs)
        assert _bytes(buffer.device["input_ids"]).data_ptr() != host.data_ptr()
        saved.append((host, host.clone()))
        _poison(host, poison, gen)
        return result

    def restoring_prepare(*args, **kwargs):
        while saved:
            host, content = saved.pop()
            host.copy_(content)
        return prepare(*args, **kwargs)

    buffer.sync, runner.prepare = poisoning_sync, restoring_prepare
    run = drive(llm.engine, _work())
    assert llm.engine.stats()["steps"] > 10
    _assert_same_outputs(run, reference)
    assert_drained(llm.engine)


@POISONS
def test_stale_rows_are_never_read(make_llm, reference, poison):
    """The whole host buffer is garbage before every prepare: whatever a step does not write
    (rows past its counts) reaches the device as garbage and must never be read."""
    llm = _llm(make_llm, False)
    runner, buffer = llm.engine.runner, llm.engine.runner.buffer
    prepare = runner.prepare
    gen = torch.Generator().manual_seed(1)

    def poisoned_prepare(*args, **kwargs):
        _poison(_bytes(buffer.host["input_ids"]), poison, gen)
        return prepare(*args, **kwargs)

    runner.prepare = poisoned_prepare
    run = drive(llm.engine, _work())
    _assert_same_outputs(run, reference)
    assert_drained(llm.engine)


def _memcpy_counts(prof):
    counts = {"htod": 0, "dtoh": 0}
    names = set()
    for e in prof.events():
        if e.name.startswith("Memcpy"):
            names.add(e.name)
        if e.name.startswith("Memcpy HtoD"):
            counts["htod"] += 1
        elif e.name.startswith("Memcpy DtoH"):
            counts["dtoh"] += 1
    return counts, sorted(names)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_cuda_exactly_one_htod_memcpy_per_step(async_scheduling):
    """On a GPU, the copies the CUDA profiler sees: one host-to-device memcpy per step (the
    step buffer), across admissions, chunked prefill, decode and finishes."""
    from torch.profiler import ProfilerActivity, profile

    from tests.conftest import _make_llm

    llm = _make_llm(device="cuda", max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64,
                    async_scheduling=async_scheduling)
    eng = llm.engine
    drive(eng, [(0, "warm", byte_prompt(20, 9), greedy(6)), (1, "warm2", byte_prompt(5, 8), seeded(6, seed=1))])
    torch.cuda.synchronize()
    before = eng.stats()["steps"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        drive(eng, _work())
        torch.cuda.synchronize()
    steps = eng.stats()["steps"] - before
    counts, names = _memcpy_counts(prof)
    assert steps > 10
    assert counts["htod"] == steps, (counts, steps, names)
