"""The Scheduler as the one owner of the request lifecycle, driven directly (no model): each
transition of the table in hybrid_engine/scheduler.py moves exactly the cursors, status and
resources it should."""
import torch

from cache.kv_cache import KVBlockAllocator
from cache.mamba_cache import MambaStateAllocator
from hybrid_engine.detokenizer import IncrementalDetokenizer
from hybrid_engine.request import Request, RequestStatus
from hybrid_engine.sampling_params import SamplingParams
from hybrid_engine.scheduler import Scheduler
from hybrid_engine.tokenizer import build_byte_tokenizer

BLOCK = 4


def make_scheduler(num_blocks=16, max_num_seqs=2, copies=2, budget=64) -> Scheduler:
    cpu = torch.device("cpu")
    kv = KVBlockAllocator(num_blocks, BLOCK, 1, 1, 2, torch.float32, cpu)
    mamba = MambaStateAllocator(max_num_seqs, 1, 2, 2, 1, 1, 1, torch.float32, cpu, banks=copies)
    return Scheduler(kv, mamba, budget, max_model_len=64)


def make_request(rid="r", prompt=(1, 2, 3, 4, 5), tokenizer=None, **params) -> Request:
    params = SamplingParams(**{"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **params})
    detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer, list(prompt), stop=params.stop)
    return Request(rid, None, list(prompt), params, seed=1, eos_token_ids=frozenset(), detokenizer=detok)


def test_admit_launch_retire_commit():
    s = make_scheduler()
    r = make_request()
    s.add(r)
    assert r.status is RequestStatus.WAITING and r.state is None
    out = s.schedule()
    # Admitted and launched: the whole prompt in one chunk, cursors advanced at schedule time.
    assert r.status is RequestStatus.RUNNING and r.state is not None
    assert [(c.start, c.num_tokens, c.samples) for c in out.prefills] == [(0, 5, True)]
    assert (r.num_scheduled, r.pending_samples, r.inflight, r.launch_row, r.num_computed) == (5, 1, 1, 0, 0)
    assert len(r.blocks) == 2
    committed = r.state.committed
    retired = s.retire(out.chunks, [True], [42], None)
    assert retired.advanced == [r] and not retired.finished
    assert r.output_token_ids == [42] and (r.num_computed, r.pending_samples, r.inflight) == (5, 0, 0)
    assert r.state.committed != committed  # the copy the row wrote is now current
    # Next: a decode row whose input (42) is on the host.
    out = s.schedule()
    assert [(c.start, c.num_tokens) for c in out.decodes] == [(5, 1)] and out.decodes[0].prev_row == 0


def test_reject_rolls_back_and_commits_nothing():
    s = make_scheduler()
    r = make_request()
    s.add(r)
    first = s.schedule()
    ahead = s.schedule(allow_evict=False)  # launch-ahead: the decode row of the in-flight sample
    assert [(c.start, c.num_tokens) for c in ahead.decodes] == [(5, 1)] and r.inflight == 2
    s.retire(first.chunks, [True], [42], None)
    after_first = r.state.committed
    s.reject(ahead.decodes[0])
    assert (r.num_scheduled, r.pending_samples) == (5, 0)
    s.retire(ahead.chunks, [False], [7], None)
    assert r.output_token_ids == [42] and r.inflight == 0
    assert r.state.committed == after_first


def test_pause_then_evict_when_nothing_fits():
    s = make_scheduler(num_blocks=3, max_num_seqs=2, copies=1)
    a, b = make_request("a", prompt=(1, 2, 3, 4), max_tokens=8), make_request("b", prompt=(5, 6, 7, 8), max_tokens=8)
    s.add(a)
    s.add(b)
    out = s.schedule()
    s.retire(out.chunks, [True, True], [9, 9], None)
    assert s.kv.num_free == 1
    out = s.schedule()  # both need a new block for position 4: a takes the last one, b pauses
    assert [c.request for c in out.decodes] == [a] and b.status is RequestStatus.PAUSED and s.num_pauses == 1
    s.retire(out.chunks, [True], [9], None)
    # a at position 5: mid-block (no new block needed), b still paused.
    out = s.schedule()
    assert [c.request for c in out.decodes] == [a]
    s.retire(out.chunks, [True], [9], None)
    for _ in range(2):  # positions 6 and 7: the block's last slots
        s.retire(s.schedule().chunks, [True], [9], None)
    # a now needs a block too: nothing fits, so the newest (b) is evicted and requeued first.
    out = s.schedule()
    assert s.num_evictions == 1 and b.status is RequestStatus.WAITING and s.waiting[0] is b
    assert b.state is None and b.blocks == [] and b.num_scheduled == b.num_computed == 0
    assert [c.request for c in out.decodes] == [a]


def test_finish_flushes_a_stop_string_found_only_at_the_end():
    """A trailing incomplete UTF-8 byte flushes as U+FFFD; if that completes a stop string,
    the request ends with reason "stop" and the string, not "length"."""
    s = make_scheduler()
    r = make_request(tokenizer=build_byte_tokenizer(), stop=["\ufffd"], max_tokens=1)
    s.add(r)
    out = s.schedule()
    retired = s.retire(out.chunks, [True], [0xE2], None)  # a lead byte: withheld, max_tokens reached
    assert retired.finished == [r]
    assert (r.finish_reason, r.stop_reason) == ("stop", "\ufffd")
    assert s.kv.num_free == s.kv.num_blocks and s.mamba.num_free == s.mamba.max_num_seqs


def test_fail_ends_live_requests_and_releases_everything_once():
    s = make_scheduler()
    a, b = make_request("a"), make_request("b")
    s.add(a)
    s.add(b)
    s.schedule()
    s.schedule(allow_evict=False)  # each has two rows in flight
    s.finish(b, "abort")  # aborted in flight: keeps its resources until its rows are gone
    assert b.blocks and b.state is not None
    failed = s.fail([a, b, a], "boom")
    assert failed == [a] and (a.finish_reason, a.error) == ("error", "boom") and b.finish_reason == "abort"
    assert a.inflight == b.inflight == 0
    assert s.kv.num_free == s.kv.num_blocks and s.mamba.num_free == s.mamba.max_num_seqs
    assert not s.running and not s.waiting
