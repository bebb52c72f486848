"""MambaStateAllocator: exact counts, exhaustion, which slots launched rows read and write
(in place, ping-pong, verify rows of several positions, a resumed request's checkpoint),
commit, reject, deferred batched zeroing, storage layout."""
import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cache.mamba_cache import MambaStateAllocator

LAYERS, CONV_DIM, CONV_W, HEADS, HEAD_DIM, STATE = 3, 6, 3, 2, 4, 5


def make(max_num_seqs=4, banks=1, positions=1, dtype=torch.float32, checkpoints=0):
    return MambaStateAllocator(max_num_seqs, LAYERS, CONV_DIM, CONV_W, HEADS, HEAD_DIM, STATE, dtype,
                               torch.device("cpu"), banks=banks, row_positions=positions,
                               checkpoint_slots=checkpoints)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("banks,positions", [(1, 1), (2, 1), (2, 3)])
def test_allocate_free_exact_counts_and_exhaustion(banks, positions):
    m = make(4, banks, positions)
    copies = banks * positions
    assert m.num_free == m.max_num_seqs == 4 and m.copies_per_request == copies
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
    assert again.committed == again.head == again.ring[0]  # a new owner starts from its first copy
    for s in states:
        m.free(s)
    assert m.num_free == 4


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="max_num_seqs"):
        make(0)
    with pytest.raises(ValueError, match="banks"):
        make(2, banks=3)
    with pytest.raises(ValueError, match="row_positions"):
        make(2, positions=0)


def test_single_copy_updates_in_place():
    m = make(2)
    state = m.allocate()
    (slot,) = state.ring
    for _ in range(3):
        src, dsts = m.launch(state)
        assert (src, dsts) == (slot, (slot,))
        m.commit(state, dsts)
    assert state.committed == slot == state.head


def test_ping_pong_never_writes_what_a_rejection_needs():
    m = make(2, banks=2)
    state = m.allocate()
    a, b = state.ring
    # Serial within launch-ahead: read committed, write the other; commit flips.
    src, dsts = m.launch(state)
    assert (src, dsts) == (a, (b,))
    m.commit(state, dsts)
    assert state.committed == b
    # Two rows in flight: the second reads what the first writes.
    first, second = m.launch(state), m.launch(state)
    assert (first, second) == ((b, (a,)), (a, (b,)))
    m.commit(state, first[1])
    assert state.committed == a and state.head == b
    # The second row rejected: the first row's copy stays committed and is the head again.
    m.reject(state)
    assert state.committed == a == state.head
    # A lone row rejected: the committed copy was only read.
    assert m.launch(state) == (a, (b,))
    m.reject(state)
    assert state.committed == a == state.head


def test_verify_rows_keep_every_position_a_commit_can_need():
    """Random launch / retire / reject walks as the engine makes them (at most two rows in
    flight; a partial acceptance rejects the row launched on top of it): every slot a row
    reads holds the state it expects, and every committed slot holds the state after the
    accepted position -- no launched row ever overwrote one that was still needed."""
    rng = random.Random(0)
    width = 4
    m = make(3, banks=2, positions=width)
    state = m.allocate()
    content = {slot: ("zero",) for slot in state.ring}  # what each slot holds (a label)
    head_label = committed_label = ("zero",)
    inflight = []  # (dsts, labels written) of live rows, oldest first
    for step in range(400):
        if len(inflight) < 2 and (not inflight or rng.random() < 0.7):
            n = rng.randint(1, width)
            src, dsts = m.launch(state, n)
            assert content[src] == head_label, step
            assert len(set(dsts)) == n and src not in dsts
            labels = [(step, j) for j in range(n)]
            for slot, label in zip(dsts, labels):
                content[slot] = label
            head_label = labels[-1]
            inflight.append((dsts, labels))
            continue
        dsts, labels = inflight.pop(0)
        accepted = rng.randint(0, len(dsts) - 1)
        m.commit(state, dsts, accepted)
        committed_label = labels[accepted]
        assert content[state.committed] == committed_label, step
        if accepted < len(dsts) - 1:  # partial: the row launched on top of it is rejected
            if inflight:
                inflight.pop()
                m.reject(state)
            head_label = committed_label
        assert content[state.head] == head_label, step


def test_following_slots_agree_with_launch():
    """The vectorised `following_slots` gives the slots `launch` gives the next one-position row."""
    for banks, positions in ((1, 1), (2, 1), (2, 3)):
        m = make(3, banks, positions)
        states = [m.allocate() for _ in range(3)]
        first = [m.launch(s) for s in states]
        src, dst = m.following_slots(np.array([d[0] for _, d in first], dtype=np.int64))
        assert list(zip(src.tolist(), dst.tolist())) == [(s, d[0]) for s, d in (m.launch(s) for s in states)]


@pytest.mark.parametrize("banks,positions", [(1, 1), (2, 1), (2, 3)])
def test_resumed_request_reads_its_checkpoint_in_place_until_its_first_row_commits(banks, positions):
    m = make(2, banks, positions, checkpoints=2)
    checkpoint = m.take_checkpoint_slot()
    state = m.allocate(resume_from=checkpoint)
    assert not m.has_new_slots()  # nothing to zero (or copy): every ring slot is written before read
    assert state.committed == state.head == checkpoint and m.is_read(checkpoint)
    first = m.launch(state)
    assert first == (checkpoint, (state.ring[0],))
    m.reject(state)  # a rejected first row: the relaunch reads the checkpoint again
    assert m.launch(state) == first
    if banks == 2:  # launch-ahead: the next row reads the first row's state, in the other bank
        src, dsts = m.launch(state, positions)
        assert src == state.ring[0] and set(dsts) <= set(state.ring[positions:])
        m.commit(state, first[1])
        assert state.committed == state.ring[0] and state.head == dsts[-1]
    else:
        m.commit(state, first[1])
        assert state.committed == state.head == state.ring[0]
    assert not m.is_read(checkpoint) and state.reads_checkpoint == -1
    assert checkpoint not in {m.launch(state)[0] for _ in range(3)}


@pytest.mark.parametrize("banks,positions", [(1, 1), (2, 1), (2, 3)])
def test_hand_over_makes_the_committed_slot_a_checkpoint_without_a_copy(banks, positions):
    m = make(2, banks, positions, checkpoints=2)
    state = m.allocate()
    m.take_new_slots()
    first = m.launch(state)
    m.commit(state, first[1])
    committed = state.committed
    m.conv_states[:, committed] = 7.0
    inflight = m.launch(state, positions) if banks == 2 else None  # launch-ahead: it reads `committed`
    spare = m.take_checkpoint_slot()
    assert m.hand_over(state, spare) == committed
    assert committed not in state.ring and spare in state.ring and len(set(state.ring)) == m.copies_per_request
    assert m.is_read(committed) and state.committed == committed
    if inflight is not None:
        src, dsts = m.launch(state)  # the next row follows the in-flight one, into the bank with the spare
        assert src == inflight[1][-1] and dsts[0] == spare
        assert tuple(m.following_slots(np.array([inflight[1][-1]]))[1]) == (spare,)
        m.commit(state, inflight[1])
    else:
        src, dsts = m.launch(state)
        assert src == committed and dsts == (spare,)
        m.reject(state)  # relaunched: the checkpoint is read again, the spare written again
        assert m.launch(state) == (src, dsts)
        m.commit(state, dsts)
    assert not m.is_read(committed) and (m.conv_states[:, committed] == 7.0).all()
    m.free(state)
    assert committed not in m._free_slots and spare in m._free_slots  # the pools swapped one slot each


def test_a_request_that_ends_hands_over_its_slot_without_reading_it():
    m = make(2, banks=2, checkpoints=1)
    state = m.allocate()
    m.take_new_slots()
    m.commit(state, m.launch(state)[1])
    committed, spare = state.committed, m.take_checkpoint_slot()
    assert m.hand_over(state, spare, goes_on=False) == committed
    assert not m.is_read(committed) and spare in state.ring and committed not in state.ring
    m.free_checkpoint_slot(committed)  # evictable at once: it is free again, not deferred
    assert m.take_checkpoint_slot() == committed


def test_hand_over_copies_when_the_request_still_reads_a_checkpoint():
    m = make(2, checkpoints=2)
    checkpoint = m.take_checkpoint_slot()
    m.ssm_states[:, checkpoint] = torch.randn_like(m.ssm_states[:, checkpoint])
    state = m.allocate(resume_from=checkpoint)  # no row committed yet: its committed state is the checkpoint
    spare = m.take_checkpoint_slot()
    assert m.hand_over(state, spare) == spare
    assert torch.equal(m.ssm_states[:, spare], m.ssm_states[:, checkpoint]) and spare not in state.ring


@pytest.mark.parametrize("ends", ["commit", "free"])
def test_a_checkpoint_given_back_while_read_is_free_only_after_its_readers(ends):
    m = make(3, banks=2, checkpoints=2)
    checkpoint = m.take_checkpoint_slot()
    readers = [m.allocate(resume_from=checkpoint), m.allocate(resume_from=checkpoint)]
    m.free_checkpoint_slot(checkpoint)  # the cache evicted it while two requests read it
    assert len(m._free_checkpoint_slots) == 1 and m.take_checkpoint_slot() != checkpoint
    for i, state in enumerate(readers):
        assert len(m._free_checkpoint_slots) == 0 and m.is_read(checkpoint)
        if ends == "commit":
            m.commit(state, m.launch(state)[1])
        else:
            m.free(state)
    assert not m.is_read(checkpoint) and len(m._free_checkpoint_slots) == 1
    assert m.take_checkpoint_slot() == checkpoint


@pytest.mark.parametrize("copies", [1, 2])
def test_storage(copies):
    m = make(3, banks=copies, dtype=torch.bfloat16)
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
    m = make(4, banks=copies)
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
        m = make(8, banks=copies)
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
    m = make(2, banks=2)
    first = [m.allocate(), m.allocate()]
    for state in first:
        m.free(state)
    assert not m.has_new_slots()
    again = [m.allocate(), m.allocate()]
    new = m.take_new_slots()
    assert sorted(new) == sorted(slot for s in again for slot in s.ring) and len(new) == m.num_slots


@pytest.mark.parametrize("ssm_dtype", [torch.bfloat16, torch.float16])
def test_ssm_dtype_sets_the_ssm_pool_and_its_bytes(ssm_dtype):
    """`mamba_ssm_cache_dtype`: the SSM pool takes its own dtype (conv keeps the model's),
    `bytes_per_seq` counts it, and new slots are zeroed in it."""
    m = MambaStateAllocator(3, LAYERS, CONV_DIM, CONV_W, HEADS, HEAD_DIM, STATE, torch.float32, torch.device("cpu"),
                            banks=2, ssm_dtype=ssm_dtype)
    assert m.ssm_states.dtype == ssm_dtype and m.conv_states.dtype == torch.float32
    nbytes = sum(t.numel() * t.element_size() for t in (m.conv_states, m.ssm_states))
    per_seq = MambaStateAllocator.bytes_per_seq(LAYERS, CONV_DIM, CONV_W, HEADS, HEAD_DIM, STATE, torch.float32,
                                                copies_per_request=2, ssm_dtype=ssm_dtype)
    assert nbytes == 3 * per_seq
    fp32 = MambaStateAllocator.bytes_per_seq(LAYERS, CONV_DIM, CONV_W, HEADS, HEAD_DIM, STATE, torch.float32,
                                             copies_per_request=2)
    assert fp32 - per_seq == 2 * LAYERS * HEADS * HEAD_DIM * STATE * 2  # the SSM half: 2 of its 4 bytes
    m.ssm_states.fill_(2.0)
    state = m.allocate()
    m.zero_slots(torch.tensor(m.take_new_slots(), dtype=torch.long))
    assert not m.ssm_states[:, list(state.ring)].any() and (m.ssm_states[:, [2, 3, 4, 5]] == 2).all()
