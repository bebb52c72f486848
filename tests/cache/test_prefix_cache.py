"""PrefixCache on its own: what a finished request leaves cached, which checkpoint a new
request resumes from, copy-on-write of the partial block, and eviction (LRU, and never at
the expense of a block a request holds)."""
from dataclasses import dataclass, field

import pytest
import torch

from cache.kv_cache import KVBlockAllocator
from cache.mamba_cache import MambaStateAllocator
from cache.prefix_cache import NEVER, PrefixCache

BS = 4  # tokens per KV block


def make(num_blocks=32, checkpoints=4, interval=8, seqs=4):
    kv = KVBlockAllocator(num_blocks, BS, 2, 1, 2, torch.float32, torch.device("cpu"))
    mamba = MambaStateAllocator(seqs, 2, 3, 2, 2, 2, 2, torch.float32, torch.device("cpu"),
                                checkpoint_slots=checkpoints)
    return kv, mamba, PrefixCache(kv, mamba, interval)


@dataclass(eq=False)
class FakeRequest:
    """What the cache reads of a request."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    blocks: list[int] = field(default_factory=list)
    state: object = None
    checkpoint_at: int | None = None
    cache_limit: int = NEVER

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prompt_checkpoint(self) -> int:
        return len(self.prompt_token_ids) if self.checkpoint_at is None else self.checkpoint_at


def fill_kv(kv, block, value):
    for k, v in kv.kv_caches:
        k[block] = value
        v[block] = -value


def run_request(kv, mamba, cache, tokens, prompt_len=None, hit=None, cache_limit=NEVER):
    """Admit a request for `tokens` (prompt = the first prompt_len), 'compute' all of it (KV
    block i filled with i + 1 + 100 * id, state slot with a marker) and finish it."""
    prompt_len = len(tokens) if prompt_len is None else prompt_len
    request = FakeRequest(prompt_token_ids=tokens[:prompt_len], output_token_ids=tokens[prompt_len:], blocks=[],
                          cache_limit=cache_limit)
    start = 0
    if hit is not None:
        request.blocks, start = hit.blocks, hit.position
    request.state = mamba.allocate(None if hit is None else hit.checkpoint.slot)
    commit_at = cache.start(request) if hit is None else cache.resume(request, hit)
    request.blocks += kv.allocate(kv.blocks_for(len(tokens)) - len(request.blocks))
    for i in range(start // BS, len(request.blocks)):
        fill_kv(kv, request.blocks[i], 1000 * id(request) % 997 + i)
    for n in range(start + 1, len(tokens)):  # commit token by token (the last one is never fed)
        _, (dst,) = mamba.launch(request.state)
        mamba.conv_states[:, dst] = n
        mamba.commit(request.state, (dst,))
        if n >= commit_at:
            commit_at = cache.commit(request, n)
    computed = len(tokens) - 1
    cache.finish(request, computed)
    kv.release(reversed(request.blocks))
    mamba.free(request.state)
    return request


def test_resumes_at_the_deepest_checkpoint_below_the_last_token():
    kv, mamba, cache = make()
    prompt = list(range(10, 21))  # 11 tokens: checkpoints at 8 (interval) and 11 (prompt end)
    run_request(kv, mamba, cache, prompt + [50, 51, 52], prompt_len=11)  # finish checkpoint at 13
    assert cache.num_checkpoints == 3
    positions = []
    for tokens in (prompt + [50, 51, 52, 53], prompt + [50, 51, 52], prompt + [99], prompt, prompt[:9], prompt[:8],
                   [1, 2, 3]):
        hit = cache.acquire(tokens)
        positions.append(None if hit is None else hit.position)
        if hit is not None:
            cache.cancel(hit)
    # An identical prompt resumes before its last token (8, not at its prompt end 11).
    assert positions == [13, 13, 11, 8, 8, None, None]


def test_nothing_past_a_requests_cache_limit_is_cached():
    """Content past `Request.cache_limit` (generated tokens computed with a dt the prompt-only
    limit would have clamped) is not what an uncached request computes: no block past it is
    registered and no finish checkpoint is taken; the prompt's checkpoints stay."""
    kv, mamba, cache = make()
    prompt = list(range(10, 21))  # 11 tokens: checkpoints at 8 (interval) and 11 (prompt end)
    answer = [50, 51, 52, 53, 54]  # computed through 15, in the 4th block of 4 like the limit
    run_request(kv, mamba, cache, prompt + answer, prompt_len=11, cache_limit=13)
    # The 3 full blocks below 13, and the prompt-end checkpoint's copy of its partial block.
    assert cache.num_checkpoints == 2 and kv.num_cached == 3 + 1
    hit = cache.acquire(prompt + answer + [1])
    assert hit.position == 11
    cache.cancel(hit)
    # The same tokens with no limit: a finish checkpoint at 15 (with its partial block), so
    # a later request resumes past the answer.
    run_request(kv, mamba, cache, prompt + answer, prompt_len=11)
    assert cache.num_checkpoints == 3 and kv.num_cached == 3 + 2
    hit = cache.acquire(prompt + answer + [1])
    assert hit.position == len(prompt + answer) - 1
    cache.cancel(hit)


def test_hit_shares_full_blocks_and_copies_the_partial_one():
    kv, mamba, cache = make()
    tokens = list(range(30, 43))  # a 13-token prompt, 2 tokens generated
    run_request(kv, mamba, cache, tokens + [7, 7], prompt_len=13)  # finish at 14: 3 full blocks + 2
    hit = cache.acquire(tokens + [7, 7, 1])
    assert hit.position == 14 and len(hit.blocks) == 4
    checkpoint = hit.checkpoint
    assert checkpoint.tail == (42, 7) and checkpoint.tail_block >= 0
    shared, own = hit.blocks[:3], hit.tail_copy
    assert hit.blocks[3] == own
    assert own != checkpoint.tail_block and own not in shared
    cached = kv.num_cached
    request = FakeRequest(prompt_token_ids=tokens + [7, 7, 1], output_token_ids=[], blocks=hit.blocks)
    mamba.take_new_slots()
    request.state = mamba.allocate(checkpoint.slot)
    assert cache.resume(request, hit) == 16  # next: its 4th block fills
    for k, v in kv.kv_caches:  # copy-on-write: the request's own block has the tail's KV
        assert torch.equal(k[own], k[checkpoint.tail_block]) and torch.equal(v[own], v[checkpoint.tail_block])
    # The Mamba state is not copied: the first row reads the checkpoint slot in place.
    assert request.state.committed == checkpoint.slot and not mamba.take_new_slots()
    assert mamba.launch(request.state) == (checkpoint.slot, (request.state.ring[0],))
    assert kv.num_cached == cached + 1  # the tail's hold is given back: cached (and free) again
    # Shared blocks cannot be evicted while held: allocating everything leaves them alone.
    others = kv.allocate(kv.num_free)
    assert not set(others) & set(hit.blocks)
    kv.release(others)


def test_checkpoint_takes_the_committed_state_without_a_copy():
    kv, mamba, cache = make()
    request = FakeRequest(prompt_token_ids=list(range(8)), output_token_ids=[], blocks=kv.allocate(2))
    request.state = mamba.allocate()
    slot = request.state.committed
    torch.manual_seed(0)
    mamba.conv_states[:, slot] = torch.randn_like(mamba.conv_states[:, slot])
    mamba.ssm_states[:, slot] = torch.randn_like(mamba.ssm_states[:, slot])
    expected = mamba.conv_states[:, slot].clone(), mamba.ssm_states[:, slot].clone()
    cache.start(request)
    spare = mamba._free_checkpoint_slots[-1]
    cache.commit(request, 8)  # prompt end (and an interval position)
    # The checkpoint is the committed slot itself; a spare slot took its place in the ring,
    # and the request reads its state from the checkpoint until its next row commits.
    assert slot not in request.state.ring and spare in request.state.ring and mamba.is_read(slot)
    src, dsts = mamba.launch(request.state)
    assert src == slot and dsts == (spare,)
    mamba.conv_states[:, spare], mamba.ssm_states[:, spare] = -1.0, -1.0  # the row writes its own slot
    mamba.commit(request.state, dsts)
    assert not mamba.is_read(slot) and request.state.committed == spare
    hit = cache.acquire(list(range(8)) + [1])
    assert hit.position == 8 and hit.checkpoint.slot == slot
    assert torch.equal(mamba.conv_states[:, slot], expected[0]) and torch.equal(mamba.ssm_states[:, slot], expected[1])
    cache.cancel(hit)


def test_cached_blocks_count_free_and_are_evicted_lru_with_their_checkpoints():
    kv, mamba, cache = make(num_blocks=8, checkpoints=8)
    a, b = list(range(100, 109)), list(range(200, 209))  # each: 2 full blocks, a checkpoint at 8
    run_request(kv, mamba, cache, a)
    run_request(kv, mamba, cache, b)
    assert kv.num_free == 8 and kv.num_cached == 4  # nothing held: all free, 4 of them cached
    # A live request needing 6 blocks gets them: the 4 free ones, then the least recently
    # released cached ones -- a's (b's were released later) -- and a's checkpoint goes too.
    live = kv.allocate(6)
    assert kv.num_free == 2 and cache.num_checkpoints == 1
    assert cache.acquire(a + [1]) is None
    hit = cache.acquire(b + [1])
    assert hit is not None and hit.position == 8
    cache.cancel(hit)
    kv.release(live)
    assert kv.num_free == 8


def test_checkpoint_budget_evicts_least_recently_used_and_unused_own_checkpoints_first():
    kv, mamba, cache = make(checkpoints=2, interval=4)
    run_request(kv, mamba, cache, list(range(50, 56)))  # checkpoints at 4 (interval) and 5 (finish)
    assert cache.num_checkpoints == 2
    # Its checkpoint at 4, which nobody used, was demoted when it finished deeper on the
    # same prefix: the next save evicts it although it is not the least recently saved.
    run_request(kv, mamba, cache, list(range(60, 63)))  # finish checkpoint at 2
    positions = []
    for tokens in (list(range(50, 56)) + [1], list(range(50, 54)) + [9], list(range(60, 63)) + [1]):
        hit = cache.acquire(tokens)
        positions.append(None if hit is None else hit.position)
        if hit is not None:
            cache.cancel(hit)
    assert positions == [5, None, 2]


def test_a_checkpoint_a_resuming_request_reads_is_not_evicted_for_a_new_one():
    kv, mamba, cache = make(checkpoints=1)
    first = list(range(70, 76))
    run_request(kv, mamba, cache, first)  # its one checkpoint, at 5 (finish)
    hit = cache.acquire(first + [1])
    reader = FakeRequest(prompt_token_ids=first + [1], output_token_ids=[], blocks=hit.blocks)
    reader.state = mamba.allocate(hit.checkpoint.slot)
    cache.resume(reader, hit)  # its first row has not committed: it still reads the checkpoint
    run_request(kv, mamba, cache, list(range(80, 86)))  # would evict it: leaves no checkpoint instead
    assert cache.num_checkpoints == 1 and cache.acquire(list(range(80, 86)) + [1]) is None
    mamba.commit(reader.state, mamba.launch(reader.state)[1])  # no longer read
    run_request(kv, mamba, cache, list(range(80, 86)))
    positions = []
    for tokens in (first + [2], list(range(80, 86)) + [1]):
        found = cache.acquire(tokens)
        positions.append(None if found is None else found.position)
        if found is not None:
            cache.cancel(found)
    assert positions == [None, 5]


def test_chunk_limit_and_commit_schedule():
    kv, mamba, cache = make(interval=8)

    def limit(start: int, num_tokens: int, prompt_len: int) -> int:  # (a request not admitted yet)
        return cache.chunk_limit(FakeRequest(list(range(prompt_len)), []), start, num_tokens)

    assert limit(0, 20, 30) == 20  # interval positions (8, 16) do not cut chunks: saved from inside
    assert limit(3, 4, 30) == 4
    assert limit(20, 4, 24) == 4  # ends at the prompt's end
    # Tokens after the prompt's end (a recomputed request's output, a draft proposal's
    # in-flight drafts): the chunk splits there, where the prompt-end checkpoint goes.
    assert limit(20, 20, 24) == 4
    assert limit(24, 20, 24) == 20
    request = FakeRequest(prompt_token_ids=list(range(10)), output_token_ids=[], blocks=kv.allocate(3))
    request.state = mamba.allocate()
    assert cache.start(request) == 4  # first full block
    assert cache.commit(request, 8) == 10  # prompt end before the 3rd block
    assert cache.commit(request, 10) == 12
    cache.finish(request, 10, save_state=False)  # untrusted state: nothing more saved
    assert cache.num_checkpoints == 2


def launch_chunk(mamba, cache, request, start: int, num_tokens: int):
    """Launch a prefill chunk as the scheduler does: its slots, and the checkpoint slots it
    writes from inside itself (the 'kernel' marks each with its position)."""
    _, dsts = mamba.launch(request.state)
    saves = cache.reserve_saves(request, start, num_tokens)
    for save in saves:
        mamba.conv_states[:, save.slot] = save.position
    return dsts, saves


def test_interval_checkpoints_lie_an_interval_past_where_the_prefill_began():
    """A prefill resuming at 11 (interval 8) gets no checkpoint at 16, five tokens past its
    start: its first interval checkpoint is at 24, written from inside the chunk that
    passes it, and attached when that chunk commits."""
    kv, mamba, cache = make(interval=8)
    first = list(range(100, 112))
    run_request(kv, mamba, cache, first)  # checkpoints at 8 (interval) and 11 (finish)
    second = first + list(range(200, 220))
    hit = cache.acquire(second)
    assert hit.position == 11
    request = FakeRequest(prompt_token_ids=second, output_token_ids=[], blocks=hit.blocks)
    request.state = mamba.allocate(hit.checkpoint.slot)
    commit_at = cache.resume(request, hit)
    request.blocks += kv.allocate(kv.blocks_for(len(second)) - len(request.blocks))
    chunks = [(11, 9), (20, 12)]  # the token budget cuts the prefill at 20
    launched = [launch_chunk(mamba, cache, request, start, n) for start, n in chunks]
    assert [[save.position for save in saves] for _, saves in launched] == [[], [24]]
    for (start, n), (dsts, _) in zip(chunks, launched):
        mamba.commit(request.state, dsts)
        if start + n >= commit_at:
            commit_at = cache.commit(request, start + n)
    cache.finish(request, 31)
    positions = []
    for length in (20, 26):
        found = cache.acquire(second[:length] + [999])
        positions.append(found.position)
        if found.position == 24:
            assert mamba.conv_states[0, found.checkpoint.slot].eq(24).all()  # the state the chunk saved
        cache.cancel(found)
    assert positions == [11, 24]


def test_reserved_checkpoint_slots_always_go_back():
    """A slot reserved for a save inside a launched chunk becomes a checkpoint when the
    chunk commits, and returns to the pool otherwise: the launch is rejected, the request
    ends with the chunk in flight, or a checkpoint got there first. A position already
    checkpointed takes no slot; one reserved by a chunk in flight takes a free slot only
    (a spare), never evicting for it."""
    kv, mamba, cache = make(num_blocks=64, checkpoints=6, interval=8, seqs=6)
    prompt = list(range(300, 340))  # 40 tokens: interval positions 8 .. 32 inside it

    def admitted(tokens):
        request = FakeRequest(prompt_token_ids=tokens, output_token_ids=[], blocks=kv.allocate(kv.blocks_for(40)))
        request.state = mamba.allocate()
        return request, cache.start(request)

    free = mamba._free_checkpoint_slots
    request, _ = admitted(prompt)
    dsts, saves = launch_chunk(mamba, cache, request, 0, 30)
    assert [save.position for save in saves] == [8, 16, 24] and len(free) == 3
    mamba.reject(request.state)
    cache.release_saves(request, saves)  # rejected: relaunched later, reserving again
    assert len(free) == 6
    dsts, saves = launch_chunk(mamba, cache, request, 0, 30)
    cache.finish(request, 0)  # ended (aborted) with the chunk in flight
    assert len(free) == 6 and cache.num_checkpoints == 0
    mamba.free(request.state)
    kv.release(request.blocks)

    first, commit_at = admitted(prompt)
    dsts, saves = launch_chunk(mamba, cache, first, 0, 30)
    assert [save.position for save in saves] == [8, 16, 24] and len(free) == 3
    # The same prefix, admitted while those saves are in flight: a spare for 8 from the
    # free slots; its spare and its prompt-end checkpoint at 16 commit before `first` does.
    short, _ = admitted(prompt[:16])
    short_dsts, short_saves = launch_chunk(mamba, cache, short, 0, 16)
    assert [save.position for save in short_saves] == [8] and len(free) == 2
    mamba.commit(short.state, short_dsts)
    cache.commit(short, 16)
    assert cache.num_checkpoints == 2 and len(free) == 1
    mamba.commit(first.state, dsts)
    assert commit_at <= 30
    cache.commit(first, 30)  # 8 and 16 are checkpoints already: those reserved slots go back
    assert cache.num_checkpoints == 3 and len(free) == 3
    second, _ = admitted(prompt)  # the same prompt again, not resumed: all checkpointed
    assert launch_chunk(mamba, cache, second, 0, 30)[1] == () and len(free) == 3
    other = list(range(500, 540))
    third, _ = admitted(other)
    assert len(launch_chunk(mamba, cache, third, 0, 30)[1]) == 3 and len(free) == 0
    fourth, _ = admitted(other)  # no free slot for a spare: nothing reserved, nothing evicted
    assert launch_chunk(mamba, cache, fourth, 0, 30)[1] == () and cache.num_checkpoints == 3
    hit = cache.acquire(prompt[:27] + [1])
    assert hit.position == 24 and mamba.conv_states[0, hit.checkpoint.slot].eq(24).all()
    cache.cancel(hit)


def test_a_spare_keeps_its_prefix_reserved_when_the_first_reservation_goes():
    """Two requests with one prefix launched together: the first reserves 8, the second
    takes a spare. The first is aborted with its chunk in flight: the spare still marks
    the prefix reserved, so a third request with it evicts no one's checkpoint for it."""
    kv, mamba, cache = make(num_blocks=128, checkpoints=3, interval=8, seqs=6)
    run_request(kv, mamba, cache, list(range(900, 907)))  # another conversation's finish checkpoint

    def launched(tokens):
        request = FakeRequest(prompt_token_ids=tokens, output_token_ids=[], blocks=kv.allocate(kv.blocks_for(12)))
        request.state = mamba.allocate()
        cache.start(request)
        return launch_chunk(mamba, cache, request, 0, 12)[1], request

    shared = list(range(300, 312))
    (first_save,), first = launched(shared)
    (spare,), _ = launched(shared)
    assert first_save.position == spare.position == 8 and not mamba._free_checkpoint_slots
    cache.finish(first, 0)  # aborted with its chunk in flight: its slot goes back
    launched(list(range(500, 512)))  # an unrelated prompt takes that free slot
    assert launched(shared)[0] == ()  # the spare still writes 8: nothing reserved, nothing evicted
    hit = cache.acquire(list(range(900, 907)) + [1])
    assert hit is not None and hit.position == 6
    cache.cancel(hit)


def test_a_checkpoint_a_chunk_passes_is_kept_as_recently_used():
    """A chunk that passes an existing checkpoint (8) and reserves the next position (16)
    must not evict the one it passes to get the slot: the least recently used goes."""
    kv, mamba, cache = make(num_blocks=128, checkpoints=2, interval=8, seqs=6)
    shared = list(range(300, 324))
    request = FakeRequest(prompt_token_ids=shared, output_token_ids=[], blocks=kv.allocate(kv.blocks_for(24)))
    request.state = mamba.allocate()
    cache.start(request)
    run_request(kv, mamba, cache, shared[:8] + [999, 998])  # checkpoints at 8 (the shared prefix) and 9
    dsts, saves = launch_chunk(mamba, cache, request, 0, 20)  # passes 8, reserves 16 (evicting 9)
    assert [save.position for save in saves] == [16]
    mamba.commit(request.state, dsts)
    cache.commit(request, 20)
    assert sorted(c.position for c in cache._checkpoints) == [8, 16]
    hit = cache.acquire(shared[:12] + [7, 7, 7])
    assert hit.position == 8
    cache.cancel(hit)


def test_a_request_may_place_its_prompt_end_checkpoint_later():
    """`checkpoint_at` (a draft proposal: the target's committed end, inside its output)
    moves the prompt-end checkpoint; a later request with those tokens resumes there."""
    kv, mamba, cache = make(interval=8)
    tokens = list(range(20, 36))
    request = FakeRequest(prompt_token_ids=tokens[:6], output_token_ids=tokens[6:], blocks=kv.allocate(4),
                          checkpoint_at=13)
    request.state = mamba.allocate()
    assert cache.start(request) == 4
    assert cache.commit(request, 8) == 12  # (interval 8 is inside [0, 13))
    assert cache.commit(request, 12) == 13
    assert cache.commit(request, 13) == 16
    cache.finish(request, 13, save_state=False)
    hit = cache.acquire(tokens[:13] + [99, 98])
    assert hit is not None and hit.position == 13
    cache.cancel(hit)


def test_rejects_an_interval_that_is_not_a_multiple_of_the_block_size():
    kv = KVBlockAllocator(4, BS, 1, 1, 2, torch.float32, torch.device("cpu"))
    mamba = MambaStateAllocator(1, 1, 3, 2, 2, 2, 2, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="prefix_cache_checkpoint_interval"):
        PrefixCache(kv, mamba, 6)
