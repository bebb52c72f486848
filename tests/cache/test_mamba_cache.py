"""MambaSlotAllocator: exact counts, exhaustion, deferred batched zeroing of new slots
(both state copies under ping-pong), storage layout."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cache.mamba_cache import MambaSlotAllocator

LAYERS, CONV_DIM, CONV_W, HEADS, HEAD_DIM, STATE = 3, 6, 3, 2, 4, 5


def make(max_num_seqs=4, copies=1, dtype=torch.float32):
    return MambaSlotAllocator(max_num_seqs, LAYERS, CONV_DIM, CONV_W, HEADS, HEAD_DIM, STATE, dtype,
                              torch.device("cpu"), copies=copies)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_allocate_free_exact_counts_and_exhaustion():
    m = make(4)
    assert m.num_free == m.max_num_seqs == 4
    slots = [m.allocate() for _ in range(4)]
    assert sorted(slots) == [0, 1, 2, 3] and m.num_free == 0
    with pytest.raises(RuntimeError, match="exhausted"):
        m.allocate()
    assert m.num_free == 0
    m.free(slots[1])
    assert m.num_free == 1 and m.allocate() == slots[1] and m.num_free == 0
    for s in slots:
        m.free(s)
    assert m.num_free == 4


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="max_num_seqs"):
        make(0)


@pytest.mark.parametrize("copies", [1, 2])
def test_state_slots_and_storage(copies):
    m = make(3, copies=copies, dtype=torch.bfloat16)
    assert [m.state_slots(s) for s in range(3)] == [[s * copies + i for i in range(copies)] for s in range(3)]
    assert m.conv_states.shape == (LAYERS, 3 * copies, CONV_DIM, CONV_W) and m.conv_states.dtype == torch.bfloat16
    assert m.ssm_states.shape == (LAYERS, 3 * copies, HEADS, HEAD_DIM, STATE)
    assert m.ssm_states.dtype == torch.float32
    conv, ssm = m.layer_views(1)
    assert conv.data_ptr() == m.conv_states[1].data_ptr() and ssm.data_ptr() == m.ssm_states[1].data_ptr()
    nbytes = sum(t.numel() * t.element_size() for t in (m.conv_states, m.ssm_states))
    assert nbytes == 3 * MambaSlotAllocator.bytes_per_seq(LAYERS, CONV_DIM, CONV_W, HEADS, HEAD_DIM, STATE,
                                                          torch.bfloat16, copies=copies)


@pytest.mark.parametrize("copies", [1, 2])
def test_new_slots_zeroed_by_zero_slots(copies):
    m = make(4, copies=copies)
    m.conv_states.fill_(1.0)
    m.ssm_states.fill_(2.0)
    a, b = m.allocate(), m.allocate()
    # Deferred: nothing is touched until the next step zeroes the slots it was handed.
    assert (m.conv_states == 1).all() and (m.ssm_states == 2).all()
    m.zero_slots(torch.tensor(m.take_new_slots(), dtype=torch.long))
    zeroed = m.state_slots(a) + m.state_slots(b)
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
    # A freed and re-handed-out slot is zeroed again (a new request never sees old state).
    m.free(a)
    assert m.allocate() == a
    m.zero_slots(torch.tensor(m.take_new_slots(), dtype=torch.long))
    assert not m.conv_states[:, m.state_slots(a)].any() and (m.conv_states[:, m.state_slots(b)] == 3).all()


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
