"""Structured outputs through the engine, with transformers (CPU float32) as the oracle:
HF's greedy `generate` with a logits processor that masks each step with the same grammar
gives the tokens every engine path must give (batched beside unconstrained requests,
staggered, chunked prefill, serial, launch-ahead, injected rejections, KV pressure,
speculative decoding). The grammar masks themselves are checked against independent
oracles in tests/structured/.

The checkpoint is a tiny random NemotronH with the embedded model's byte tokenizer saved
beside it (vocabulary 272: the tokenizer's 261 ids and padding the grammar never allows).
"""
import json
import re

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.sampling_params import ParameterError, StructuredOutputsParams
from hybrid_engine.structured.grammar import GrammarCompiler
from hybrid_engine.structured.vocabulary import TokenVocabulary
from hybrid_engine.tokenizer import EOS_ID, build_byte_tokenizer
from hybrid_engine.structured import automaton
from tests.engine.engine_helpers import assert_drained, drive
from tests.models.conftest import NEMOTRON_MOE_SHARP, make_hf_checkpoint, skip_unless_hf_oracle

VOCAB = 272
MODEL = ("NemotronHConfig", "NemotronHForCausalLM", dict(NEMOTRON_MOE_SHARP, vocab_size=VOCAB, eos_token_id=EOS_ID))
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"]}
# (A tiny random model likes newlines: runs of whitespace would use up max_tokens.)
PERSON_COMPACT = {"json": PERSON, "disable_any_whitespace": True}
# (prompt text, structured outputs, max_tokens): constrained requests and two free ones.
REQUESTS = [
    ("Name and age: ", PERSON_COMPACT, 60),
    ("Pick one: ", {"choice": ["red", "green", "blue"]}, 10),
    ("The free one ", None, 12),
    ("Code: ", {"regex": r"[A-Z]{2}-\d{2,4}"}, 10),
    ("Anything: ", {"json_object": True, "disable_any_whitespace": True}, 24),
    ("Another free one, longer, so that it prefills in chunks ", None, 9),
]
TOGETHER, STAGGERED = (0,) * len(REQUESTS), (0, 1, 0, 3, 5, 2)
MIN_TOP1_MARGIN = 1e-4  # HF's masked greedy choice must be unambiguous far above fp32 rounding


class GrammarMask(LogitsProcessor):
    """transformers-side masking: the engine's grammar, advanced by HF's own tokens."""

    def __init__(self, compiler: GrammarCompiler, params: dict, prompt_len: int):
        self.state = compiler.start(StructuredOutputsParams(**params), frozenset({EOS_ID}))
        self.seen = prompt_len
        self.bits = np.zeros(compiler.vocabulary.mask_bytes, dtype=np.uint8)
        self.margins: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for token in input_ids[0, self.seen:].tolist():
            self.state.advance(token)
        self.seen = input_ids.shape[1]
        self.state.write_mask(self.bits)
        allowed = torch.from_numpy(np.unpackbits(self.bits, bitorder="little")[: scores.shape[-1]].astype(bool))
        masked = scores.masked_fill(~allowed, float("-inf"))
        top2 = masked[0].topk(2).values
        self.margins.append(float(top2[0] - top2[1]) if torch.isfinite(top2[1]) else float("inf"))
        return masked


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """(checkpoint, prompts, HF's constrained greedy tokens per request)."""
    path = tmp_path_factory.mktemp("structured")
    hf = make_hf_checkpoint(path, MODEL)
    skip_unless_hf_oracle(hf)
    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(path)
    compiler = GrammarCompiler(TokenVocabulary.of_tokenizer(tokenizer, VOCAB))
    prompts, expected = [], []
    for text, structured, max_tokens in REQUESTS:
        ids = tokenizer.encode(text)
        processors = LogitsProcessorList()
        if structured is not None:
            processors.append(GrammarMask(compiler, structured, len(ids)))
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=max_tokens, do_sample=False, eos_token_id=EOS_ID, pad_token_id=0,
                          logits_processor=processors)
        tokens = out[0, len(ids):].tolist()
        if structured is not None:
            assert min(processors[0].margins) > MIN_TOP1_MARGIN, "near-tie in HF's masked choice: change the seed"
            if processors[0].state.terminated and tokens[-1] == EOS_ID:
                # (after a whole text the mask allows only EOS; the engine stops without it)
                tokens = tokens[:-1]
        prompts.append(ids)
        expected.append(tokens)
    return str(path), prompts, expected


def _params(structured: dict | None, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=structured)


PATHS = {
    "batched-async": (dict(kv_block_size=16), TOGETHER, lambda s: s["launch_ahead_steps"] > 0),
    "staggered-serial": (dict(kv_block_size=4, async_scheduling=False), STAGGERED,
                         lambda s: s["launch_ahead_steps"] == 0),
    "chunked-budget5-async": (dict(kv_block_size=4, max_num_batched_tokens=5, max_num_seqs=4), STAGGERED,
                              lambda s: s["launch_ahead_steps"] > 0),
    "rejections-kv-pressure": (dict(kv_block_size=4, inject_rejection_rate=0.5, num_kv_blocks=30, max_num_seqs=4),
                               STAGGERED, lambda s: s["rejected_launches"] > 0 and s["pauses"] > 0),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_matches_hf_with_the_same_grammar(oracle, path):
    checkpoint, prompts, expected = oracle
    engine_kwargs, arrivals, took_path = PATHS[path]
    engine = LLM(model=checkpoint, device="cpu", dtype="float32", seed=0, **engine_kwargs).engine
    run = drive(engine, [(step, f"r{i}", prompt, _params(structured, max_tokens))
                         for i, (step, prompt, (_, structured, max_tokens)) in enumerate(zip(arrivals, prompts,
                                                                                             REQUESTS))])
    assert took_path(engine.stats()), engine.stats()
    for i, (want, (_, structured, _)) in enumerate(zip(expected, REQUESTS)):
        out = run.finals[f"r{i}"]
        assert out.output_token_ids == want, f"r{i} {structured}: {out.output_token_ids} != HF's {want}"
    # The grammars held: each finished output is a whole text of its grammar.
    texts = {i: run.finals[f"r{i}"].text for i in range(len(REQUESTS))}
    assert [run.finals[f"r{i}"].finish_reason for i in (0, 1, 3, 4)] == ["stop"] * 4
    assert json.loads(texts[4]) == {} or isinstance(json.loads(texts[4]), dict)
    person = json.loads(texts[0])
    assert set(person) <= {"name", "age", "tags"} and 0 <= person["age"] <= 120 and len(person["name"]) <= 6
    assert texts[1] in ("red", "green", "blue") and run.finals["r1"].finish_reason == "stop"
    assert re.fullmatch(r"[A-Z]{2}-\d{2,4}", texts[3])


def test_constrained_request_is_independent_of_its_batch(oracle):
    """Output independence with sampling: a seeded constrained request draws the same tokens
    alone (serial) and among others under launch-ahead."""
    checkpoint, prompts, _ = oracle
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7, structured_outputs={"json": PERSON})
    alone = LLM(model=checkpoint, device="cpu", dtype="float32", seed=0, async_scheduling=False).engine
    solo = drive(alone, [(0, "x", prompts[0], params)]).finals["x"].output_token_ids
    busy = LLM(model=checkpoint, device="cpu", dtype="float32", seed=0).engine
    arrivals = [(0, "x", prompts[0], params)] + [(k, f"o{k}", prompts[2], _params(None, 30)) for k in range(4)]
    assert drive(busy, arrivals).finals["x"].output_token_ids == solo
    assert busy.stats()["launch_ahead_steps"] > 0


def test_free_requests_still_launch_ahead_beside_a_constrained_one(oracle):
    """The constrained request sits out the launch-ahead steps taken while its sample is in
    flight; the others are launched ahead as always (most steps are launch-ahead)."""
    checkpoint, prompts, _ = oracle
    engine = LLM(model=checkpoint, device="cpu", dtype="float32", seed=0).engine
    arrivals = [(0, "c", prompts[0], _params(PERSON_COMPACT, 60)), (0, "f", prompts[2], _params(None, 120))]
    finals = drive(engine, arrivals).finals
    assert len(finals["c"].output_token_ids) < 60 < len(finals["f"].output_token_ids)  # (both decode together)
    stats = engine.stats()
    assert stats["launch_ahead_steps"] >= stats["steps"] - 2, stats


def test_speculative_decoding_leaves_constrained_rows_undrafted(oracle):
    checkpoint, prompts, expected = oracle
    engine = LLM(model=checkpoint, device="cpu", dtype="float32", seed=0,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                     "prompt_lookup_max": 2}).engine
    arrivals = [(0, f"r{i}", prompts[i], _params(REQUESTS[i][1], REQUESTS[i][2])) for i in range(len(REQUESTS))]
    finals = drive(engine, arrivals).finals
    for i in range(len(REQUESTS)):
        assert finals[f"r{i}"].output_token_ids == expected[i], i
    assert engine.stats()["spec_proposed_tokens"] > 0  # (the free requests were drafted)


def test_bad_grammars_are_refused_naming_the_field(oracle):
    checkpoint, prompts, _ = oracle
    engine = LLM(model=checkpoint, device="cpu", dtype="float32", seed=0).engine
    cases = [({"json": {"type": "object", "multipleOf": 3}}, "structured_outputs.json"),
             ({"regex": "(?=a)b"}, "structured_outputs.regex"),
             ({"regex": "a", "choice": ["b"]}, "structured_outputs")]
    for structured, field in cases:
        with pytest.raises(ParameterError) as caught:
            engine.add_request("bad", prompts[0], _params(structured, 5))
        assert caught.value.param == field, (structured, caught.value.param)
    assert not engine.has_unfinished_requests()


def test_a_grammar_out_of_states_fails_its_request_alone(oracle, monkeypatch):
    """The automaton's state limit reached mid-generation ends that request with "error";
    the requests beside it run to their length, and every resource comes back."""
    checkpoint, prompts, _ = oracle
    engine = LLM(model=checkpoint, device="cpu", dtype="float32", seed=0).engine
    start = engine.start_grammar(_params({"regex": "[a-z]{0,50}"}, 1))
    monkeypatch.setattr(automaton, "MAX_STATES", start.grammar.automaton._num_states + 5)
    arrivals = [(0, "c", prompts[0], _params({"regex": "[a-z]{0,50}"}, 40))]
    arrivals += [(0, f"f{k}", prompts[2], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
                 for k in range(3)]
    finals = drive(engine, arrivals).finals
    assert finals["c"].finish_reason == "error" and "automaton states" in finals["c"].error
    assert all(finals[f"f{k}"].finish_reason == "length" and len(finals[f"f{k}"].output_token_ids) == 20
               for k in range(3))
    assert_drained(engine)


def test_a_model_without_tokenizer_refuses_structured_outputs(tmp_path):
    make_hf_checkpoint(tmp_path, MODEL)
    engine = LLM(model=str(tmp_path), device="cpu", dtype="float32").engine
    with pytest.raises(ParameterError, match="need a tokenizer") as caught:
        engine.add_request("r", [5, 6, 7], _params({"choice": ["a"]}, 3))
    assert caught.value.param == "structured_outputs"


@pytest.mark.gpu
def test_cuda_graphs_with_masks_match_hf(oracle):
    """On CUDA (fast kernels, decode graphs, launch-ahead): a decode step with grammar masks
    replays the forward graph and samples eagerly with the masks, and every request's tokens
    are HF's."""
    checkpoint, prompts, expected = oracle
    engine = LLM(model=checkpoint, device="cuda", dtype="float32", seed=0, kv_block_size=16).engine
    run = drive(engine, [(0, f"r{i}", prompt, _params(structured, max_tokens))
                         for i, (prompt, (_, structured, max_tokens)) in enumerate(zip(prompts, REQUESTS))])
    for i, want in enumerate(expected):
        assert run.finals[f"r{i}"].output_token_ids == want, i
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.forward_replays[1] > 0 and graphs.replays[1] > graphs.forward_replays[1]


def test_two_ranks_send_the_masks_to_the_worker(oracle):
    """Tensor parallelism (2 gloo processes, launch-ahead with rejections): the masks travel
    with the step's rows, so the worker samples what the driver samples (a worker that
    sampled unmasked would feed other tokens to the next step's forward) == HF."""
    checkpoint, prompts, expected = oracle
    llm = LLM(model=checkpoint, device="cpu", dtype="float32", seed=0, kv_block_size=4, tensor_parallel_size=2,
              inject_rejection_rate=0.3)
    try:
        run = drive(llm.engine, [(0, f"r{i}", prompt, _params(structured, max_tokens))
                                 for i, (prompt, (_, structured, max_tokens)) in enumerate(zip(prompts, REQUESTS))])
        for i, want in enumerate(expected):
            assert run.finals[f"r{i}"].output_token_ids == want, i
        assert llm.engine.stats()["rejected_launches"] > 0
    finally:
        llm.shutdown()
