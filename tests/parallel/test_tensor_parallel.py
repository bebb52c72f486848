"""Tensor / expert parallelism end to end on CPU (gloo, 2 and 4 processes): the engine
starts its own workers, every scheduling path reproduces transformers (CPU float32), and
a dead worker ends every request with an error instead of a hang.

The tiny checkpoints have 2 KV heads and 2 Mamba groups, so at 4 ranks both are
replicated (each rank keeps the ones its heads use). Each test builds its engine and shuts
it down: one tensor-parallel engine at a time per process (torch.distributed's default
group)."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from hybrid_engine import LLM, SamplingParams
from tests.parallel.conftest import (
    GREEDY, generate, kill_a_worker_mid_generation, speculative_then_cached_turns, tp_llm,
)


def _llm(path: str, size: int, **kwargs) -> LLM:
    return tp_llm(path, size, "cpu", **kwargs)


@pytest.mark.parametrize("model", ["nemotron", "granite"])
def test_four_ranks_replicated_kv_heads_and_groups_match_hf_async_with_rejections(model, request):
    """4 ranks (KV heads and Mamba groups replicated), launch-ahead with injected
    rejections, a token budget that chunks the prefills, prefix caching on: == HF."""
    oracle = request.getfixturevalue(model)
    llm = _llm(oracle.path, 4, inject_rejection_rate=0.3, max_num_seqs=4, max_num_batched_tokens=8)
    try:
        oracle.check(generate(llm, oracle.prompts))
        stats = llm.engine.stats()
        assert stats["rejected_launches"] > 0 and stats["launch_ahead_steps"] > 0
    finally:
        llm.shutdown()


def test_a_step_message_longer_than_the_ring_laps_it_and_equals_one_process(nemotron, monkeypatch):
    """A 3,000-token prompt in one step, through a ring of 4 KiB slots (the driver's shape
    reaches the workers in the file): its message spans more chunks than the ring has
    slots, so the driver waits for the workers to free them; the tokens and logprobs equal
    one process's."""
    from hybrid_engine.parallel import transport

    monkeypatch.setattr(transport, "SLOT_BYTES", 4096)
    lengths = []
    send = transport.SharedMemoryTransport.send
    monkeypatch.setattr(transport.SharedMemoryTransport, "send",
                        lambda self, message, check=None: (lengths.append(len(message)), send(self, message, check)))
    prompt = torch.randint(3, 96, (3000,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    options = dict(max_num_batched_tokens=4096, max_model_len=3100, enable_prefix_caching=False)
    llm = _llm(nemotron.path, 2, **options)
    try:
        [parallel] = generate(llm, [prompt], params)
    finally:
        llm.shutdown()
    assert max(lengths) > 4096 * transport.NUM_SLOTS
    [single] = generate(LLM(model=nemotron.path, device="cpu", dtype="float32", kv_block_size=4, **options),
                        [prompt], params)
    assert parallel.output_token_ids == single.output_token_ids
    for a, b in zip(parallel.logprobs, single.logprobs):
        assert max(abs(a[t] - b[t]) for t in a) < 1e-5


def test_expert_parallel_equals_tensor_parallel(nemotron):
    """Whole experts per rank (EP) give TP's tokens, and logprobs within 1e-5."""
    runs = {}
    for ep in (False, True):
        llm = _llm(nemotron.path, 2, enable_expert_parallel=ep, async_scheduling=False)
        try:
            runs[ep] = generate(llm, nemotron.prompts)
        finally:
            llm.shutdown()
    nemotron.check(runs[True])
    for tp, ep in zip(runs[False], runs[True]):
        assert tp.output_token_ids == ep.output_token_ids
        for a, b in zip(tp.logprobs, ep.logprobs):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-5


def test_granite_two_ranks_speculative_and_prefix_cache_match_hf(granite):
    """Granite (RoPE, shared MLP, logit scaling) at 2 ranks: drafts, then cached next turns."""
    speculative_then_cached_turns(granite, lambda **options: _llm(granite.path, 2, **options),
                                  lambda: LLM(model=granite.path, device="cpu", dtype="float32", kv_block_size=4,
                                              enable_prefix_caching=False))


def test_nemotron_next_turn_resumes_at_the_previous_prompt_under_tensor_parallel(nemotron):
    """Where the prompt-only dt limit can bind, no rank sees every head's dt, so the driver
    keeps every request's generated tokens out of the prefix cache: the next turn resumes
    at the previous prompt's end, and its tokens equal an uncached single-rank run's."""
    llm = _llm(nemotron.path, 2)
    try:
        first = generate(llm, nemotron.prompts)
        nemotron.check(first)
        turns = [p + o.output_token_ids + [7, 8, 9] for p, o in zip(nemotron.prompts, first)]
        cached = generate(llm, turns)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert [o.num_cached_tokens for o in cached] == [len(p) for p in nemotron.prompts]
    assert stats["prefix_cache_dt_limited_requests"] == 2 * len(turns)
    single = LLM(model=nemotron.path, device="cpu", dtype="float32", kv_block_size=4, enable_prefix_caching=False)
    fresh = generate(single, turns)
    assert [o.output_token_ids for o in cached] == [o.output_token_ids for o in fresh]


def test_draft_model_under_tensor_parallel(nemotron):
    """The draft engine is sharded too (it follows its own steps on the workers): the
    checkpoint drafting for itself is accepted and the output is HF's."""
    llm = _llm(nemotron.path, 2, speculative_config={"method": "draft_model", "model": nemotron.path,
                                                      "num_speculative_tokens": 3})
    try:
        nemotron.check(generate(llm, nemotron.prompts))
        stats = llm.engine.stats()
        assert stats["spec_accepted_tokens"] >= 0.99 * stats["spec_proposed_tokens"] > 0
    finally:
        llm.shutdown()


def test_engines_one_after_another_and_garbage_collected(nemotron):
    """shutdown() frees the process group for the next engine; so does dropping an LLM."""
    import gc

    llm = _llm(nemotron.path, 2)
    workers = list(llm.engine.group.workers)
    del llm
    gc.collect()
    assert all(w.poll() is not None for w in workers) and not dist.is_initialized()
    llm = _llm(nemotron.path, 2)
    try:
        nemotron.check(generate(llm, nemotron.prompts[:1]))
    finally:
        llm.shutdown()
    llm.shutdown()  # idempotent
    assert not dist.is_initialized()


def test_a_dead_worker_fails_every_request_and_the_engine_says_so(nemotron):
    kill_a_worker_mid_generation(nemotron, _llm(nemotron.path, 2, max_num_seqs=2), max_tokens=200)


def test_errors_name_the_field_before_any_worker_starts(nemotron):
    with pytest.raises(ValueError, match="num_attention_heads"):
        _llm(nemotron.path, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        _llm(nemotron.path, 0)
    assert not dist.is_initialized()


_UNGUARDED_SCRIPT = """
from hybrid_engine import LLM, SamplingParams
llm = LLM(model={path!r}, device="cpu", dtype="float32", tensor_parallel_size=2)
out = llm.generate([{prompt!r}], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
print("TOKENS", out[0].output_token_ids)
"""


def test_unguarded_top_level_script(nemotron, tmp_path):
    """A script with no `if __name__ == "__main__"` guard: the workers are fresh
    interpreters running the worker module, not re-imports of the script. They exit
    quietly with it (a worker once died at interpreter shutdown on its stdin watch)."""
    script = tmp_path / "script.py"
    script.write_text(_UNGUARDED_SCRIPT.format(path=nemotron.path, prompt=nemotron.prompts[0]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("TOKENS"))
    assert line == f"TOKENS {nemotron.tokens[0][:6]}"
    assert "Fatal Python error" not in done.stderr, done.stderr[-2000:]


def test_env_rendezvous_across_two_nodes(nemotron, monkeypatch):
    """Multi-node launch through env://, two "nodes" on this machine: the driver's node
    runs rank 0 (and its own local ranks), the other node's launcher starts rank 1."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)  # a free port
    port = store.port
    del store
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    node = subprocess.Popen([sys.executable, "-m", "hybrid_engine.parallel.worker", "--node-rank", "1",
                             "--nproc-per-node", "1", "--device-type", "cpu"],
                            env=dict(os.environ, **env, PYTHONPATH=os.getcwd()))
    for name, value in {**env, "RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    try:
        llm = _llm(nemotron.path, 2)
        try:
            nemotron.check(generate(llm, nemotron.prompts[:2]))
        finally:
            llm.shutdown()
        assert node.wait(timeout=60) == 0
    finally:
        if node.poll() is None:
            node.kill()


def test_an_aborted_request_gets_one_final_output_when_the_group_breaks(nemotron):
    llm = _llm(nemotron.path, 2, max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(nemotron.prompts):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()
    engine.abort_request("r0")
    os.kill(engine.group.workers[0].pid, signal.SIGKILL)
    finals = []
    while engine.has_unfinished_requests():
        finals += [(o.request_id, o.finish_reason) for o in engine.step() if o.finished]
    assert sorted(finals) == [("r0", "abort"), ("r1", "error"), ("r2", "error")]
    llm.shutdown()


def test_an_interrupted_step_breaks_the_group_instead_of_desynchronizing_it(nemotron):
    """A KeyboardInterrupt inside the driver's forward (between two collectives) leaves the
    workers mid-step: the step fails every request and the engine is dead, instead of a
    later step pairing collectives wrongly. Through the engine's step (the failed outputs
    come with the next step), then through `generate` (which clears its requests)."""
    llm = _llm(nemotron.path, 2)
    layer = llm.engine.model.model.layers[3]  # an attention block: an all-reduce inside
    forward, calls = layer.forward, [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    layer.forward = interrupted
    try:
        llm.engine.add_request("r", nemotron.prompts[0], GREEDY)
        with pytest.raises(KeyboardInterrupt):
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        layer.forward = forward
        assert llm.engine.group.broken is not None and llm.engine.dead is not None
        outputs = []
        while llm.engine.has_unfinished_requests():
            outputs += [o for o in llm.engine.step() if o.finished]
        assert [o.finish_reason for o in outputs] == ["error"]
    finally:
        llm.shutdown()
    llm = _llm(nemotron.path, 2)
    layer = llm.engine.model.model.layers[3]
    forward, calls[0] = layer.forward, 0
    layer.forward = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            generate(llm, nemotron.prompts[:1])
        assert llm.engine.dead is not None and not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_a_worker_that_cannot_load_its_shard_fails_the_constructor_naming_it(nemotron, tmp_path):
    """NaN in embedding rows only rank 1 holds: LLM() raises, naming rank 1 and the key."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(nemotron.path, bad)
    weights = load_file(bad / "model.safetensors")
    key = next(k for k in weights if k.endswith("embeddings.weight"))
    weights[key][-1, 0] = float("nan")  # the last vocabulary row: rank 1's half
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"worker rank 1 failed to start: CheckpointError.*NaN"):
        _llm(str(bad), 2)
    assert not dist.is_initialized()


def test_a_worker_that_exits_before_joining_fails_the_start_at_once(nemotron, monkeypatch):
    from hybrid_engine.parallel import group

    spawn = group._spawn_worker
    monkeypatch.setattr(group, "_spawn_worker", lambda args, env, **kw: spawn([*args, "--no-such-flag"], env, **kw))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with code 2 before joining"):
        _llm(nemotron.path, 2)
    assert time.monotonic() - start < 60 and not dist.is_initialized()


def test_built_in_one_thread_used_from_another(nemotron):
    """The workers outlive the thread that started them (a server builds its engine on a
    thread; a notebook may too)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        llm = pool.submit(_llm, nemotron.path, 2).result()
    try:
        nemotron.check(generate(llm, nemotron.prompts[:1]))
    finally:
        llm.shutdown()
    with pytest.raises(RuntimeError, match="engine is dead.*shut down"):
        generate(llm, nemotron.prompts[:1])
