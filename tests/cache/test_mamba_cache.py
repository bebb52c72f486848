"""MambaStateAllocator: exact counts, exhaustion, which slots launched rows read and write
(in place, ping-pong, longer rings), commit, deferred batched zeroing, storage layout."""
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cache.mamba_cache import MambaStateAllocator

LAYERS, CONV_DIM, CONV_W, HEADS, HEAD_DIM, STATE = 3, 6, 3, 2, 4, 5


def make(max_num_seqs=4, copies=1, dtype=torch.float32):
    return MambaStateAllocator(max_num_seqs, LAYERS, CONV_DIM, CONV_W, HEADS, HEAD_DIM, STATE, dtype,
                               torch.device("cpu"), copies_per_request=copies)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("copies", [1, 2, 3])
def test_allocate_free_exact_counts_and_exhaustion(copies):
    m = make(4, copies)
    assert m.num_free == m.max_num_seqs == 4
    states = [m.allocate() for _ in range(4)]
    assert sorted(s.row for s in states) == [0, 1, 2, 3] and m.num_free == 0
    slots = [slot for s in states for slot in s.ring]
    assert sorted(slots) == list(range(4 * copies))  # every slot owned exactly once
    assert all(len(s.ring) == copies for s in states)
    with pytest.raises(RuntimeError, match="exhausted"):
        m.allocate()
    assert m.num_free == 0
    m.free(states[1])
    again = m.allocate()
    assert m.num_free == 0 and again.row == states[1].row and sorted(again.ring) == sorted(states[1].ring)
    assert again.committed == 0  # a new owner starts from its first copy
    for s in states:
        m.free(s)
    assert m.num_free == 4


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="max_num_seqs"):
        make(0)
    with pytest.raises(ValueError, match="copies_per_request"):
        make(2, copies=0)


def _launch_and_retire(m, state, pattern):
    """Walk a request through launches and retirements; returns (src, dst) per launch.

    pattern: a string of 'L' (launch a row) and 'C' (retire the oldest row, committing)
    and 'R' (retire the oldest row rejected)."""
    inflight, seen = 0, []
    for event in pattern:
        if event == "L":
            seen.append(m.row_slots(state, inflight))
            inflight += 1
        else:
            if event == "C":
                m.commit(state)
            inflight -= 1
    return seen


def test_single_copy_updates_in_place():
    m = make(2, copies=1)
    state = m.allocate()
    (slot,) = state.ring
    assert _launch_and_retire(m, state, "LCLCLC") == [(slot, slot)] * 3
    assert m.committed_slot(state) == slot


def test_ping_pong_never_writes_what_a_rejection_needs():
    m = make(2, copies=2)
    state = m.allocate()
    a, b = state.ring
    # Serial within launch-ahead: read committed, write the other; commit flips.
    assert _launch_and_retire(m, state, "LC") == [(a, b)]
    assert m.committed_slot(state) == b
    # Two rows in flight: the second reads what the first writes.
    assert _launch_and_retire(m, state, "LLCC") == [(b, a), (a, b)]
    assert m.committed_slot(state) == b
    # The second row rejected: the first row's copy stays committed, untouched by the rejection.
    assert _launch_and_retire(m, state, "LLCR") == [(b, a), (a, b)]
    assert m.committed_slot(state) == a
    # A lone row rejected: the committed copy was only read.
    assert _launch_and_retire(m, state, "LR") == [(a, b)]
    assert m.committed_slot(state) == a


def test_longer_ring_and_following_slots_agree():
    """Any ring: a row reads its predecessor's copy and writes the next one, and the
    vectorised `following_slots` gives the same as asking `row_slots` one row later."""
    m = make(3, copies=3)
    states = [m.allocate() for _ in range(3)]
    m.commit(states[1])
    for inflight in range(3):
        now = [m.row_slots(s, inflight) for s in states]
        later = [m.row_slots(s, inflight + 1) for s in states]
        src, dst = m.following_slots(np.array([d for _, d in now], dtype=np.int64))
        assert list(zip(src.tolist(), dst.tolist())) == later
        assert all(s != d for s, d in now)


@pytest.mark.parametrize("copies", [1, 2])
def test_storage(copies):
    m = make(3, copies=copies, dtype=torch.bfloat16)
    assert m.conv_states.shape == (LAYERS, 3 * copies, CONV_DIM, CONV_W) and m.conv_states.dtype == torch.bfloat16
    assert m.ssm_states.shape == (LAYERS, 3 * copies, HEADS, HEAD_DIM, STATE)
    assert m.ssm_states.dtype == torch.float32
    conv, ssm = m.layer_views(1)
    assert conv.data_ptr() == m.conv_states[1].data_ptr() and ssm.data_ptr() == m.ssm_states[1].data_ptr()
    nbytes = sum(t.numel() * t.element_size() for t in (m.conv_states, m.ssm_states))
    assert nbytes == 3 * MambaStateAllocator.bytes_per_seq(LAYERS, CONV_DIM, CONV_W, HEADS, HEAD_DIM, STATE,
                                                           torch.bfloat16, copies_per_request=copies)


@pytest.mark.parametrize("copies", [1, 2])
def test_new_slots_zeroed_by_zero_slots(copies):
    m = make(4, copies=copies)
    m.conv_states.fill_(1.0)
    m.ssm_states.fill_(2.0)
    a, b = m.allocate(), m.allocate()
    # Deferred: nothing is touched until the next step zeroes the slots it was handed.
    assert (m.conv_states == 1).all() and (m.ssm_states == 2).all()
    m.zero_slots(torch.tensor(m.take_new_slots(), dtype=torch.long))
    zeroed = list(a.ring + b.ring)
    for s in range(4 * copies):
        conv, ssm = m.conv_states[:, s], m.ssm_states[:, s]
        if s in zeroed:
            assert not conv.any() and not ssm.any(), s
        else:
            assert (conv == 1).all() and (ssm == 2).all(), s
    # Nothing pending: a second call touches nothing.
    m.conv_states.fill_(3.0)
    m.zero_slots(torch.tensor(m.take_new_slots(), dtype=torch.long))
    assert (m.conv_states == 3).all()
    # Freed and handed out again: zeroed again (a new request never sees old state).
    m.free(a)
    again = m.allocate()
    assert sorted(again.ring) == sorted(a.ring)
    m.zero_slots(torch.tensor(m.take_new_slots(), dtype=torch.long))
    assert not m.conv_states[:, list(again.ring)].any() and (m.conv_states[:, list(b.ring)] == 3).all()


@pytest.mark.parametrize("copies", [1, 2])
def test_zeroing_is_one_batched_op_per_state_kind(copies):
    """The number of tensor ops does not grow with the number of new slots."""
    counts = []
    for n in (1, 5):
        m = make(8, copies=copies)
        for _ in range(n):
            m.allocate()
        index = torch.tensor(m.take_new_slots(), dtype=torch.long)
        with OpCounter() as counter:
            m.zero_slots(index)
        fills = [op for op in counter.ops if "fill" in op or "zero" in op or "copy" in op or "index_put" in op]
        counts.append((len(counter.ops), len(fills)))
        assert m.take_new_slots() == []  # handed out once: the next step has nothing to zero
    assert counts[0] == counts[1], counts
    assert counts[0][1] <= 2, counts  # one op for conv, one for ssm


def test_freed_before_zeroing_is_not_zeroed_twice():
    """A state freed before its first step (that step failed) leaves the zeroing list; the
    next owner queues its slots again, so the list never outgrows the pool."""
    m = make(2, copies=2)
    first = [m.allocate(), m.allocate()]
    for state in first:
        m.free(state)
    assert not m.has_new_slots()
    again = [m.allocate(), m.allocate()]
    new = m.take_new_slots()
    assert sorted(new) == sorted(slot for s in again for slot in s.ring) and len(new) == m.num_slots
