"""Stop strings (across byte-token boundaries and inside multi-byte characters), stop token
ids, EOS, and aborts of waiting / prefilling / decoding requests.

The embedded model is random, so stop strings are cut from its known greedy output: with
greedy decoding the stop run produces the same tokens up to the match. Its byte tokenizer
splits every multi-byte UTF-8 character into one token per byte.
"""
import pytest

from hybrid_engine import SamplingParams
from tests.engine.engine_helpers import assert_drained, assert_mode_ran, byte_prompt, drive, greedy, seeded

PROMPTS = ["hello", "The quick brown fox", "Once upon a time", "naïve café", "日本語のテキスト", "abc",
           "Ünïcödé ✓", "lorem ipsum dolor sit amet", "0123456789", "stop here"]
EOS_IDS = (258, 260)  # <|eos|>, <|im_end|>
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def greedy_runs():
    """prompt -> (output token ids, text) of a plain greedy run (ignore_eos, 48 tokens)."""
    from tests.conftest import _make_llm

    llm = _make_llm(max_num_seqs=len(PROMPTS))
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    return {p: (o.output_token_ids, o.text) for p, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="module")
def tokenizer():
    from hybrid_engine.tokenizer import build_byte_tokenizer

    return build_byte_tokenizer()


def _tokens_to_stop(tokenizer, tokens, stop):
    """Tokens generated until the decoded text first contains `stop` (the stopping token incl.)."""
    for n in range(1, len(tokens) + 1):
        if stop in tokenizer.decode(tokens[:n], skip_special_tokens=True):
            return n
    raise AssertionError(f"{stop!r} never appears")


def _find(greedy_runs, predicate, width):
    """(prompt, index) of the first `width`-char window of some greedy text satisfying `predicate`
    (index >= 2, so there is text before the stop string)."""
    for prompt in PROMPTS:
        text = greedy_runs[prompt][1]
        for i in range(2, len(text) - width):
            if predicate(text[i:i + width]):
                return prompt, i
    raise AssertionError("no greedy output has the wanted content; pick other prompts")


def _ascii(s):
    return all(32 < ord(c) < 127 for c in s)


def _find_char(greedy_runs, nbytes):
    """(prompt, char): a `nbytes`-byte character produced as `nbytes` consecutive byte tokens,
    not at the very start of the output."""
    for prompt in PROMPTS:
        tokens = greedy_runs[prompt][0]
        for j in range(2, len(tokens) - nbytes):
            chunk = tokens[j:j + nbytes]
            if all(t < 256 for t in chunk):
                try:
                    char = bytes(chunk).decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if len(char) == 1:
                    return prompt, char
    raise AssertionError(f"no {nbytes}-byte character in the greedy outputs; pick other prompts")


def _stop_for(case, greedy_runs):
    """(prompt, stop string) for a stop-string case."""
    if case == "ascii_across_tokens":  # 3 ASCII chars = 3 byte tokens
        prompt, i = _find(greedy_runs, _ascii, 3)
        return prompt, greedy_runs[prompt][1][i:i + 3]
    if case in ("two_byte_char", "three_byte_char"):  # the char alone: its lead byte must not match or leak
        return _find_char(greedy_runs, 2 if case == "two_byte_char" else 3)
    # "mixed": the 2-byte char with its neighbours in the text
    prompt, char = _find_char(greedy_runs, 2)
    text = greedy_runs[prompt][1]
    i = text.find(char)
    return prompt, text[i - 1:i + 2]


STOP_CASES = ["ascii_across_tokens", "two_byte_char", "three_byte_char", "mixed"]


@pytest.mark.parametrize("include", [False, True], ids=["trimmed", "included"])
@pytest.mark.parametrize("case", STOP_CASES)
def test_stop_string(make_llm, greedy_runs, tokenizer, case, include):
    prompt, stop = _stop_for(case, greedy_runs)
    tokens, text = greedy_runs[prompt]
    idx = text.find(stop)
    assert idx > 0
    if case != "ascii_across_tokens":
        assert len(stop.encode()) > len(stop)  # contains a multi-byte character
    llm = make_llm()
    params = greedy(MAX_TOKENS, stop=[stop, "\x00never\x00"], include_stop_str_in_output=include)
    run = drive(llm.engine, [(0, "r", prompt, params)])
    out = run.finals["r"]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (text[:idx + len(stop)] if include else text[:idx])
    assert out.output_token_ids == tokens[:_tokens_to_stop(tokenizer, tokens, stop)]
    assert_drained(llm.engine)


def test_earliest_stop_string_wins_and_partial_match_is_released(make_llm, greedy_runs):
    prompt, i = _find(greedy_runs, _ascii, 4)
    tokens, text = greedy_runs[prompt]
    late, early = text[i + 1:i + 4], text[i:i + 2]  # `early` ends first
    # A stop string that starts like the text but never completes: held back, then released.
    teaser = text[i - 2:i] + "\x00never"
    assert teaser not in text
    params = greedy(MAX_TOKENS, stop=[late, teaser, early])
    llm = make_llm()
    out = drive(llm.engine, [(0, "r", prompt, params)]).finals["r"]
    first = min((s for s in (late, early)), key=lambda s: (text.find(s) + len(s), text.find(s)))
    assert out.stop_reason == first
    assert out.text == text[:text.find(first)]


def test_stop_string_absent_keeps_full_text(make_llm, greedy_runs):
    prompt = PROMPTS[1]
    tokens, text = greedy_runs[prompt]
    near = text[3:5] + "\x00never"  # its first chars appear, so they are held back a while
    assert near not in text
    out = drive(make_llm().engine, [(0, "r", prompt, greedy(MAX_TOKENS, stop=near))]).finals["r"]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.output_token_ids == tokens and out.text == text


def test_stop_token_ids(make_llm, greedy_runs):
    prompt = PROMPTS[2]
    tokens, _ = greedy_runs[prompt]
    target = tokens[9]
    never = next(t for t in range(256) if t not in tokens)
    llm = make_llm()
    out = drive(llm.engine, [(0, "r", prompt, greedy(MAX_TOKENS, stop_token_ids=[never, target]))]).finals["r"]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.output_token_ids == tokens[:tokens.index(target) + 1]
    assert_drained(llm.engine)
    # A seeded sampled run stops on one of its own tokens too.
    sampled = drive(make_llm().engine, [(0, "s", prompt, seeded(MAX_TOKENS, seed=3))]).finals["s"].output_token_ids
    stop_tok = sampled[5]
    out = drive(make_llm().engine,
                [(0, "s", prompt, seeded(MAX_TOKENS, seed=3, stop_token_ids=[stop_tok]))]).finals["s"]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.output_token_ids == sampled[:sampled.index(stop_tok) + 1]


def test_editing_the_callers_lists_after_add_request_changes_nothing(make_llm, greedy_runs):
    """The engine keeps its own copies of `stop_token_ids` and `stop`: a token id or string
    the caller appends to its lists after adding the request does not stop it."""
    prompt = PROMPTS[2]
    tokens, text = greedy_runs[prompt]
    params = greedy(MAX_TOKENS, stop_token_ids=[], stop=[])
    llm = make_llm()
    llm.engine.add_request("r", prompt, params)
    llm.engine.step()
    params.stop_token_ids.append(tokens[10])
    params.stop.append(text[-5:])
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    final = [o for o in outs if o.finished][0]
    assert final.finish_reason == "length" and final.output_token_ids == tokens
    assert_drained(llm.engine)


def test_eos_stops_unless_ignored(make_llm, greedy_runs, tokenizer):
    found = [(p, next(i for i, t in enumerate(greedy_runs[p][0]) if t in EOS_IDS)) for p in PROMPTS
             if any(t in EOS_IDS for t in greedy_runs[p][0])]
    assert found, "no greedy output reaches EOS within 48 tokens; pick other prompts"
    prompt, at = found[0]
    tokens, text = greedy_runs[prompt]
    llm = make_llm()
    run = drive(llm.engine, [(0, "eos", prompt, greedy(MAX_TOKENS, ignore_eos=False)),
                             (0, "ign", prompt, greedy(MAX_TOKENS, ignore_eos=True))])
    eos = run.finals["eos"]
    assert eos.finish_reason == "stop" and eos.stop_reason is None
    assert eos.output_token_ids == tokens[:at + 1]
    assert eos.text == tokenizer.decode(tokens[:at + 1], skip_special_tokens=True)
    ign = run.finals["ign"]
    assert ign.finish_reason == "length" and ign.output_token_ids == tokens
    assert_drained(llm.engine)


@pytest.mark.parametrize("include", [False, True], ids=["text_left_out", "include_stop_str_in_output"])
def test_stop_token_text_only_with_include_stop_str_in_output(make_llm, greedy_runs, tokenizer, include):
    """vLLM's rule: a stop token that ends the output (one of stop_token_ids; EOS, here shown
    with skip_special_tokens off) leaves its text out unless include_stop_str_in_output; its
    id stays among the output's tokens."""
    prompt = PROMPTS[2]
    tokens, _ = greedy_runs[prompt]
    at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i] and _ascii(tokenizer.decode([tokens[i]])))
    eos_prompt, eos_at = next((p, next(i for i, t in enumerate(greedy_runs[p][0]) if t in EOS_IDS)) for p in PROMPTS
                              if any(t in EOS_IDS for t in greedy_runs[p][0]))
    eos_tokens = greedy_runs[eos_prompt][0]
    llm = make_llm()
    run = drive(llm.engine, [
        (0, "ids", prompt, greedy(MAX_TOKENS, stop_token_ids=[tokens[at]], include_stop_str_in_output=include)),
        (0, "eos", eos_prompt, greedy(MAX_TOKENS, ignore_eos=False, skip_special_tokens=False,
                                      include_stop_str_in_output=include)),
    ])
    kept = 1 if include else 0
    by_id = run.finals["ids"]
    assert by_id.stop_reason == tokens[at] and by_id.output_token_ids == tokens[:at + 1]
    assert by_id.text == tokenizer.decode(tokens[:at + kept], skip_special_tokens=True)
    eos = run.finals["eos"]
    assert eos.finish_reason == "stop" and eos.output_token_ids == eos_tokens[:eos_at + 1]
    assert eos.text == tokenizer.decode(eos_tokens[:eos_at + kept], skip_special_tokens=False)
    assert eos.text.endswith(tokenizer.decode([eos_tokens[eos_at]], skip_special_tokens=False)) == include
    assert_drained(llm.engine)


# ---- aborts ----------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_abort_waiting_prefilling_decoding(make_llm, solo, async_scheduling):
    """max_num_seqs=3, budget 8: 'dec', 'keep1' and 'pre' run while 'wait' and 'keep2' queue;
    'pre' has a 120-token prompt (~20 prefill steps next to two decoders). Aborted: 'wait'
    while queued, then 'pre' mid-prompt, then 'dec' mid-decode; 'keep1' / 'keep2' must match
    their solo runs."""
    llm = make_llm(max_num_seqs=3, max_num_batched_tokens=8, async_scheduling=async_scheduling)
    eng = llm.engine
    work = [
        (0, "dec", byte_prompt(6, 1), greedy(40)),
        (0, "keep1", byte_prompt(5, 2), seeded(30, seed=9)),
        (1, "pre", byte_prompt(120, 3), greedy(10)),
        (2, "wait", byte_prompt(9, 4), greedy(10)),
        (2, "keep2", byte_prompt(11, 5), seeded(12, seed=10)),
    ]
    seen = {}

    def abort_when_ready(engine, run):
        reqs = engine.requests
        if not seen and run.steps >= 2:
            assert reqs["wait"] in engine.scheduler.waiting
            seen["wait"] = run.steps
            engine.abort_request("wait")
        elif len(seen) == 1 and 16 <= reqs["pre"].num_computed < 100:
            assert not reqs["pre"].output_token_ids
            seen["pre"] = run.steps
            engine.abort_request("pre")
        elif len(seen) == 2 and len(reqs["dec"].output_token_ids) >= 25:
            seen["dec"] = run.steps
            engine.abort_request("dec")

    run = drive(eng, work, on_step=abort_when_ready)
    assert list(seen) == ["wait", "pre", "dec"], seen
    for rid in seen:
        out = run.finals[rid]
        assert out.finish_reason == "abort" and out.finished, rid
        assert run.streams[rid][-1] is out
    assert run.finals["wait"].output_token_ids == [] and run.finals["pre"].output_token_ids == []
    assert run.streams["wait"] == [run.finals["wait"]]
    dec = run.finals["dec"].output_token_ids
    assert 25 <= len(dec) < 40 and dec == solo(work[0][2], work[0][3]).output_token_ids[:len(dec)]
    for _, rid, prompt, params in work:
        if rid.startswith("keep"):
            assert run.finals[rid].output_token_ids == solo(prompt, params).output_token_ids, rid
            assert run.finals[rid].finish_reason == "length"
    assert_mode_ran(eng)
    assert_drained(eng)
    # Aborting unknown or finished requests is a no-op, and the engine keeps serving.
    eng.abort_request("dec")
    eng.abort_request("no-such-request")
    assert eng.step() == []
    again = drive(eng, [(0, "after", byte_prompt(5, 2), seeded(30, seed=9))]).finals["after"]
    assert again.output_token_ids == solo(byte_prompt(5, 2), seeded(30, seed=9)).output_token_ids


def test_abort_everything_then_serve(make_llm, solo):
    llm = make_llm(max_num_seqs=2)
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"r{i}", byte_prompt(10 + i, i), greedy(20))
    eng.step()
    eng.step()
    for i in range(4):
        eng.abort_request(f"r{i}")
    outs = eng.step()
    assert sorted(o.request_id for o in outs) == [f"r{i}" for i in range(4)]
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert not eng.has_unfinished_requests() and eng.step() == []
    assert_drained(eng)
    out = llm.generate([byte_prompt(10, 0)], greedy(20), use_tqdm=False)[0]
    assert out.output_token_ids == solo(byte_prompt(10, 0), greedy(20)).output_token_ids


def test_abort_text_is_flushed(make_llm, greedy_runs):
    """An aborted request's text is the decode of what it generated (no held-back bytes lost)."""
    prompt = PROMPTS[3]
    tokens, text = greedy_runs[prompt]
    llm = make_llm()
    eng = llm.engine
    eng.add_request("r", prompt, greedy(MAX_TOKENS, stop="\x00\x00\x00"))
    outs = []
    for _ in range(12):
        outs += eng.step()
    eng.abort_request("r")
    outs += eng.step()
    final = outs[-1]
    assert final.finish_reason == "abort"
    n = len(final.output_token_ids)
    assert final.output_token_ids == tokens[:n]
    from hybrid_engine.tokenizer import build_byte_tokenizer

    assert final.text == build_byte_tokenizer().decode(tokens[:n], skip_special_tokens=True)
    assert "".join(o.new_text for o in outs) == final.text


def test_failing_request_ends_alone_with_error(make_llm):
    """An exception while appending one request's token finishes only that request."""

    llm = make_llm()
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("bad", "boom", params)
    engine.add_request("good", "fine", params)

    class Exploding:
        stop_reason = None
        text_pieces: list[str] = []
        held_text = ""

        def add_tokens(self, ids):
            raise RuntimeError("detokenizer exploded")

        def flush(self):
            return ""

    engine.requests["bad"].detokenizer = Exploding()
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    assert results["bad"].finish_reason == "error" and "exploded" in results["bad"].error
    assert results["good"].finish_reason == "length" and len(results["good"].output_token_ids) == 6
    stats = engine.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["free_mamba_slots"] == stats["total_mamba_slots"]


def test_top_k_zero_or_beyond_vocab_is_off_and_top_k_one_is_greedy(make_llm):
    """top_k=0 means "no top-k": a seeded draw equals the one with top_k = vocab size or any
    larger value (2**40 does not overflow), and differs from top_k=1, which is greedy."""

    llm = make_llm()
    vocab = llm.engine.model_config.vocab_size

    def tokens(**kw) -> list[int]:
        params = SamplingParams(**{"max_tokens": 8, "temperature": 1.0, "seed": 1, "ignore_eos": True, **kw})
        return llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].output_token_ids

    off = tokens(top_k=0)
    assert tokens(top_k=vocab) == off and tokens(top_k=2**40) == off
    greedy = tokens(temperature=0.0)
    assert tokens(top_k=1) == greedy
    assert off != greedy  # the seeded draw really samples (so the equalities above mean something)
