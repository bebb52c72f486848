"""KVBlockAllocator: exact free counts, exhaustion, reuse order, storage layout.

(That allocate/free cost does not grow with the pool is measured by
`scripts/bench_host_ops.py`, not asserted here: timing belongs in benchmarks.)"""
import pytest
import torch

from cache.kv_cache import KVBlockAllocator


def make(num_blocks=10, block_size=4, layers=2, heads=2, head_dim=8, dtype=torch.float32):
    return KVBlockAllocator(num_blocks, block_size, layers, heads, head_dim, dtype, torch.device("cpu"))


def test_allocate_free_exact_counts():
    kv = make(10)
    assert kv.num_free == kv.num_blocks == 10
    a = kv.allocate(3)
    b = kv.allocate(4)
    assert kv.num_free == 3
    assert len(a) == 3 and len(b) == 4 and len(set(a + b)) == 7
    assert all(0 <= x < 10 for x in a + b)
    kv.release(a)
    assert kv.num_free == 6
    c = kv.allocate(6)
    assert kv.num_free == 0 and not set(c) & set(b) and len(set(c)) == 6
    assert sorted(b + c) == list(range(10))
    kv.release(b)
    kv.release(c)
    assert kv.num_free == 10
    assert kv.allocate(0) == [] and kv.num_free == 10


def test_exhaustion_raises_and_changes_nothing():
    kv = make(5)
    held = kv.allocate(4)
    with pytest.raises(RuntimeError, match="exhausted"):
        kv.allocate(2)
    assert kv.num_free == 1
    assert kv.allocate(1)[0] not in held
    with pytest.raises(RuntimeError):
        kv.allocate(1)


def test_most_recently_freed_reused_first():
    kv = make(8)
    a = kv.allocate(3)
    kv.allocate(2)
    kv.release(a)
    assert sorted(kv.allocate(3)) == sorted(a)


def test_blocks_for():
    kv = make(block_size=16)
    assert [kv.blocks_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("bad", [(0, 16), (-1, 16), (4, 0)])
def test_rejects_non_positive_sizes(bad):
    with pytest.raises(ValueError):
        make(num_blocks=bad[0], block_size=bad[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_storage_shapes_and_bytes(dtype):
    kv = make(num_blocks=6, block_size=4, layers=3, heads=2, head_dim=8, dtype=dtype)
    assert len(kv.kv_caches) == 3
    total = 0
    for k, v in kv.kv_caches:
        for t in (k, v):
            assert t.shape == (6, 4, 2, 8) and t.dtype == dtype and not t.any()
            total += t.numel() * t.element_size()
        assert k.data_ptr() != v.data_ptr()
    assert total == 6 * KVBlockAllocator.bytes_per_block(4, 3, 2, 8, dtype)

