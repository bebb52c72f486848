"""How the driver's per-step messages reach the tensor-parallel workers: byte strings
from rank 0 to every other rank, in order.

- `SharedMemoryTransport`, when every rank runs on the driver's node (the one-node
  rendezvous): a ring of slots in a shared-memory file that the driver writes and each
  worker reads. A message costs a copy in and a copy out, and a worker that polls sees it
  within tens of microseconds.
- `GlooTransport`, across nodes (env:// rendezvous): broadcasts on the group's gloo
  channel. A broadcast costs a round trip through the kernel's TCP stack; measured on
  two H200s' host, a step's host time was about 700 us longer with two ranks than with
  one, most of it this (docs/parallel.md).

Both carry any length: the ring splits a message over consecutive slots, gloo sends its
first 64 KiB in a broadcast of fixed size (a receiver must know the size to post) and the
rest in a second one.
"""
import errno
import mmap
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

# Gloo: the bytes that ride in the fixed-size first broadcast of a message.
GLOO_FIRST_BYTES = 1 << 16
# The ring: slots of 1 MiB (a decode step's message is a few KB, a long prompt step's a few
# hundred KB), four of them, so the driver runs up to four messages ahead of a worker.
SLOT_BYTES = 1 << 20
NUM_SLOTS = 4
_LINE = 8  # int64s per 64-byte line: the ring's shape, each slot's header and each reader's acks own one
# Waiting: poll without sleeping for SPIN_S (a worker between two steps, a driver whose
# ring is full), then sleep SLEEP_S between polls; after IDLE_S (a server without
# requests) poll every IDLE_SLEEP_S. A writer checks its readers' health every CHECK_S.
SPIN_S, SLEEP_S, IDLE_S, IDLE_SLEEP_S, CHECK_S = 2e-4, 5e-5, 0.1, 1e-3, 0.05

_fence_lock = threading.Lock()


def _fence() -> None:
    """A barrier between this process's accesses to the shared file before it and after it.
    x86 keeps stores (and loads) in order anyway; Arm (Grace Hopper) does not. One cycle of
    a lock (an acquire, then a release) does not order an access before it against one
    after it: the earlier may sink below the acquire, the later rise above the release.
    Two cycles do, since a release and a later acquire stay in order (on Arm too): every
    access before the first release comes before every access after the second acquire."""
    with _fence_lock:
        pass
    with _fence_lock:
        pass


class MessageTransport(Protocol):
    """Rank 0 `send`s byte strings; every other rank `receive`s them, in order."""

    def send(self, message: np.ndarray, check: Callable[[], None] | None = None) -> None:
        """Driver: deliver `message` (uint8) to every worker. `check` is called now and then
        while waiting for a slow reader (it raises if that reader is dead)."""

    def receive(self) -> np.ndarray:
        """Worker: the next message (uint8)."""


class GlooTransport:
    """Messages as broadcasts on a gloo group: the length and the first GLOO_FIRST_BYTES in
    one fixed-size broadcast, the rest (if any) in a second."""

    def __init__(self, group):
        self.group = group
        self._first = torch.empty(8 + GLOO_FIRST_BYTES, dtype=torch.uint8)  # (reused: a broadcast returns once sent)

    def send(self, message: np.ndarray, check: Callable[[], None] | None = None) -> None:
        first = self._first.numpy()
        first[:8] = np.array([len(message)], dtype=np.int64).view(np.uint8)
        head = min(len(message), GLOO_FIRST_BYTES)
        first[8:8 + head] = message[:head]
        self._broadcast(self._first)
        if len(message) > head:
            self._broadcast(torch.from_numpy(np.ascontiguousarray(message[head:])))

    def receive(self) -> np.ndarray:
        self._broadcast(self._first)
        first = self._first.numpy()
        length = int(first[:8].view(np.int64)[0])
        head = min(length, GLOO_FIRST_BYTES)
        if length == head:
            return first[8:8 + head].copy()
        rest = torch.empty(length - head, dtype=torch.uint8)
        self._broadcast(rest)
        return np.concatenate([first[8:8 + head], rest.numpy()])

    def _broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=0, group=self.group)


class SharedMemoryTransport:
    """A one-writer ring of slots in a shared-memory file, read by every worker.

    Layout, in 64-byte lines of int64s: the ring's shape [slots, slot bytes, readers]; per
    slot [chunk number, message length, chunk length]; per reader the chunk number it last
    consumed in each slot. Then the slots. The writer's chunk k (numbered from 1) goes to
    slot k % slots once every reader has consumed that slot's previous chunk: the writer
    stores the chunk, then (after a barrier) its number, which is what readers poll for.
    A message longer than a slot takes consecutive chunks.

    The file has no name: the driver unlinks it as soon as it is made, and its workers
    inherit the open descriptor (`fd`), so nothing is left behind however the processes end.
    """

    def __init__(self, fd: int, reader: int | None, shape: tuple[int, int, int] | None = None):
        """Map the ring open at `fd` as `reader` (a worker), or lay it out as its writer
        (`reader` None; `shape`: slots, slot bytes, readers)."""
        self.fd, self.reader = fd, reader
        self._map = mmap.mmap(fd, 0)
        lines = np.frombuffer(self._map, dtype=np.int64, count=_LINE)
        if reader is None:
            lines[:3] = shape
        num_slots, slot_bytes, num_readers = (int(v) for v in lines[:3])
        words = np.frombuffer(self._map, dtype=np.int64, count=_LINE * (1 + num_slots + num_readers))
        self._slots = words[_LINE:_LINE * (1 + num_slots)].reshape(num_slots, _LINE)  # [number, length, chunk]
        self._acks = words[_LINE * (1 + num_slots):].reshape(num_readers, _LINE)  # [reader, slot]
        self._data = np.frombuffer(self._map, dtype=np.uint8, offset=_control_bytes(num_slots, num_readers)
                                   ).reshape(num_slots, slot_bytes)
        self._next = 1  # the next chunk number to write (driver) or read (this worker)
        self._partial = False  # a send was interrupted: the readers hold part of a message

    @classmethod
    def create(cls, num_readers: int) -> "SharedMemoryTransport":
        """Driver: a new ring of NUM_SLOTS x SLOT_BYTES in a file under /dev/shm (where there
        is one), unlinked at once; hand `fd` to the workers (`subprocess.Popen(pass_fds=)`)
        and `close_fd` once they have mapped it."""
        if not 1 <= NUM_SLOTS <= _LINE:  # (each reader's acks fill one line)
            raise ValueError(f"the ring holds 1 to {_LINE} slots, got {NUM_SLOTS}")
        root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        path = os.path.join(root, f"hybrid_engine_steps_{os.getpid()}_{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.unlink(path)
        try:
            size = _file_bytes(NUM_SLOTS, SLOT_BYTES, num_readers)
            _reserve(fd, size, root)
            return cls(fd, None, (NUM_SLOTS, SLOT_BYTES, num_readers))
        except BaseException:
            os.close(fd)
            raise

    def close_fd(self) -> None:
        """Close the descriptor (the mapping stays)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def send(self, message: np.ndarray, check: Callable[[], None] | None = None) -> None:
        if self._partial:
            raise RuntimeError("an interrupted send left part of a message in the ring: the workers are out of step")
        self._partial = True  # (until the whole message is in)
        num_slots, slot_bytes = self._data.shape
        length, offset = len(message), 0
        while True:
            chunk = message[offset:offset + slot_bytes]
            number, slot = self._next, self._next % num_slots
            acks = self._acks[:, slot]
            _wait(lambda: int(acks.min()) >= number - num_slots, check)
            self._data[slot, :len(chunk)] = chunk
            self._slots[slot, 1], self._slots[slot, 2] = length, len(chunk)
            _fence()
            self._slots[slot, 0] = number
            self._next += 1
            offset += len(chunk)
            if offset >= length:
                self._partial = False
                return

    def receive(self) -> np.ndarray:
        num_slots = len(self._slots)
        out, offset = None, 0
        while True:
            number, slot = self._next, self._next % num_slots
            header = self._slots[slot]
            _wait(lambda: int(header[0]) == number, None)
            _fence()
            if out is None:
                out = np.empty(int(header[1]), dtype=np.uint8)
            size = int(header[2])
            out[offset:offset + size] = self._data[slot, :size]
            _fence()
            self._acks[self.reader, slot] = number
            self._next += 1
            offset += size
            if offset >= len(out):
                return out


def _reserve(fd: int, size: int, root: str) -> None:
    """Size the ring's file, its pages reserved where the file system can: a full /dev/shm
    (a container's small --shm-size) is then an error at start-up, not a SIGBUS (a write
    into a page that cannot be had) at the first step."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no room in {root} for the tensor-parallel step ring ({size} bytes): "
                                        f"free some, or give the container more shared memory (--shm-size)") from None
        os.ftruncate(fd, size)  # (a file system without fallocate)
    except AttributeError:  # (no posix_fallocate: macOS)
        os.ftruncate(fd, size)


def _control_bytes(num_slots: int, num_readers: int) -> int:
    return -(-8 * _LINE * (1 + num_slots + num_readers) // 4096) * 4096


def _file_bytes(num_slots: int, slot_bytes: int, num_readers: int) -> int:
    return _control_bytes(num_slots, num_readers) + num_slots * slot_bytes


def _wait(ready: Callable[[], bool], check: Callable[[], None] | None) -> None:
    """Return once `ready()`: poll, then sleep between polls (longer once idle); call
    `check` every CHECK_S."""
    if ready():
        return
    start = last_check = time.perf_counter()
    while not ready():
        now = time.perf_counter()
        waited = now - start
        if waited >= SPIN_S:
            time.sleep(SLEEP_S if waited < IDLE_S else IDLE_SLEEP_S)
        if check is not None and now - last_check >= CHECK_S:
            check()
            last_check = now
