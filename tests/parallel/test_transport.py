"""The step-message transports (hybrid_engine/parallel/transport.py): every reader gets
every message, whole and in order, whatever its length -- through the shared-memory ring
(messages longer than a slot, a writer that laps slow readers) and through gloo (messages
past the first broadcast's fixed size)."""
import errno
import multiprocessing
import os
import tempfile
import threading
import time

import numpy as np
import pytest
import torch.distributed as dist

from hybrid_engine.parallel import transport
from hybrid_engine.parallel.transport import GlooTransport, SharedMemoryTransport

# Lengths around the boundaries: empty, under a slot, exactly one, one past, several
# slots (more than the ring holds: the writer waits for readers to free them).
SLOT = 256
LENGTHS = [0, 1, 100, SLOT - 1, SLOT, SLOT + 1, 3 * SLOT + 7, 9 * SLOT + 3, 5]


HANG_S = 60  # a reader or writer still waiting after this is stuck (a lost or overwritten chunk)


def _before(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError("the writer is still waiting for its readers")


def test_ring_has_at_most_one_line_of_slots(monkeypatch):
    monkeypatch.setattr(transport, "NUM_SLOTS", 9)
    with pytest.raises(ValueError, match="1 to 8 slots"):
        SharedMemoryTransport.create(num_readers=1)


def test_an_interrupted_send_makes_every_later_send_fail(monkeypatch):
    """A send cut off mid-message (an interrupt) leaves the readers waiting for the rest:
    the next message would be read as its continuation, so the ring refuses it."""
    monkeypatch.setattr(transport, "SLOT_BYTES", SLOT)
    writer = SharedMemoryTransport.create(num_readers=1)
    SharedMemoryTransport(writer.fd, reader=0)
    writer.close_fd()
    calls = []

    def interrupt() -> None:
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(transport, "CHECK_S", 0.0)
    with pytest.raises(KeyboardInterrupt):  # (the 5th chunk waits for the reader, and `check` interrupts)
        writer.send(np.zeros(5 * SLOT, dtype=np.uint8), check=interrupt)
    assert calls
    with pytest.raises(RuntimeError, match="interrupted send"):
        writer.send(np.zeros(1, dtype=np.uint8))


def _messages(lengths: list[int]) -> list[np.ndarray]:
    gen = np.random.default_rng(0)
    return [gen.integers(0, 256, n, dtype=np.uint8) for n in lengths]


def test_ring_delivers_every_message_whole_and_in_order_to_every_reader(monkeypatch):
    monkeypatch.setattr(transport, "SLOT_BYTES", SLOT)
    monkeypatch.setattr(transport, "NUM_SLOTS", 3)
    writer = SharedMemoryTransport.create(num_readers=2)
    readers = [SharedMemoryTransport(writer.fd, reader=r) for r in range(2)]
    writer.close_fd()  # (the mappings stay)
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    assert not [name for name in os.listdir(root) if name.startswith(f"hybrid_engine_steps_{os.getpid()}_")]
    sent = _messages(LENGTHS * 3)
    received: dict[int, list[np.ndarray]] = {0: [], 1: []}

    def read(r: int) -> None:
        for _ in sent:
            received[r].append(readers[r].receive())

    threads = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + HANG_S
    for message in sent:
        writer.send(message, check=lambda: _before(deadline))
    for t in threads:
        t.join(timeout=HANG_S)
    for r in range(2):
        assert len(received[r]) == len(sent)
        for got, want in zip(received[r], sent):
            assert np.array_equal(got, want)


def test_ring_writer_waits_for_a_slow_reader_and_checks_its_health(monkeypatch):
    """A full ring makes the writer wait (calling `check`, which raises for a dead reader)."""
    monkeypatch.setattr(transport, "SLOT_BYTES", SLOT)
    monkeypatch.setattr(transport, "NUM_SLOTS", 2)
    monkeypatch.setattr(transport, "CHECK_S", 0.0)
    writer = SharedMemoryTransport.create(num_readers=1)
    SharedMemoryTransport(writer.fd, reader=0)  # a reader that never reads
    writer.close_fd()
    writer.send(np.zeros(2 * SLOT, dtype=np.uint8))  # fills both slots

    def dead() -> None:
        raise RuntimeError("reader died")

    with pytest.raises(RuntimeError, match="reader died"):
        writer.send(np.zeros(1, dtype=np.uint8), check=dead)


def _gloo_rank(rank: int, port: int, lengths: list[int], out) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        pipe = GlooTransport(dist.group.WORLD)
        sent = _messages(lengths)
        for message in sent:
            if rank == 0:
                pipe.send(message)
            else:
                assert np.array_equal(pipe.receive(), message)
        out.put(rank)
    finally:
        dist.destroy_process_group()


def test_gloo_delivers_messages_past_the_first_broadcast():
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)  # (serves the two ranks)
    first = transport.GLOO_FIRST_BYTES
    lengths = [0, 7, first - 1, first, first + 1, 3 * first + 5, 12]
    context = multiprocessing.get_context("spawn")
    done = context.Queue()
    procs = [context.Process(target=_gloo_rank, args=(r, store.port, lengths, done)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(done.get(timeout=1) for _ in procs) == [0, 1]


def test_a_full_shared_memory_is_an_error_at_creation_naming_the_fix(monkeypatch):
    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    with pytest.raises(OSError, match="shm-size"):
        SharedMemoryTransport.create(num_readers=1)
