"""Every layer runs the op set its model was built with: two engines in one process each
run only their own kernels, and building one never changes another's (there is no
process-wide kernel backend)."""
import pytest

from hybrid_engine import LLM, SamplingParams
from hybrid_engine import engine as engine_module
from layers.kernels import KERNELS_ENV, OP_NAMES, REFERENCE_OPS, OpSet

PROMPTS = [[5, 17, 33, 9, 41, 12, 7], list(range(40, 90))]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# Every op the embedded NemotronH model calls (it has no softmax-routed MoE layer).
# (the verify ops run only with speculative decoding)
# The model's norms all run `add_rms_norm` (the first layer's with no residual), never `rms_norm` itself.
# (No RoPE in the embedded model: its keys and values go to the cache from `linear_write_kv`.)
EMBEDDED_MODEL_OPS = set(OP_NAMES) - {"rms_norm", "route_softmax_topk", "causal_conv1d_verify", "ssm_state_verify",
                                      "write_kv_cache"}


def recording_ops(name: str, log: list[tuple[str, str]]) -> OpSet:
    """The reference ops under another name; every call is logged as (set name, op)."""

    def wrap(op, impl):
        def call(*args, **kwargs):
            log.append((name, op))
            return impl(*args, **kwargs)

        return call

    return OpSet(name, {op: wrap(op, impl) for op, impl in REFERENCE_OPS.implementations().items()})


def layer_op_sets(llm: LLM) -> list[OpSet]:
    """The op set of every kernel-calling layer of the engine's model."""
    found = [m.ops for m in llm.engine.model.modules() if hasattr(m, "ops")]
    assert found, "no layer holds an op set"
    return found


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.output_token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_two_engines_run_only_their_own_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two CPU engines built with different (recording) op sets, stepped in turns: each
    step calls only its own engine's ops, all of them, and the tokens are the reference's."""
    log: list[tuple[str, str]] = []
    choices = iter([recording_ops("a", log), recording_ops("b", log)])
    monkeypatch.setattr(engine_module, "select_ops", lambda device: next(choices))
    llms = {"a": LLM(device="cpu", dtype="float32", max_num_batched_tokens=32)}
    op_set_a = llms["a"].engine.kernels
    llms["b"] = LLM(device="cpu", dtype="float32", max_num_batched_tokens=32)
    monkeypatch.undo()
    assert llms["b"].engine.kernels.name == "b"
    assert all(ops is op_set_a for ops in layer_op_sets(llms["a"]))  # building b changed nothing in a
    assert all(ops is llms["b"].engine.kernels for ops in layer_op_sets(llms["b"]))

    for name, llm in llms.items():
        for i, prompt in enumerate(PROMPTS):
            llm.engine.add_request(f"{name}{i}", prompt, GREEDY)
    tokens: dict[str, dict[str, list[int]]] = {"a": {}, "b": {}}
    called: dict[str, set[str]] = {"a": set(), "b": set()}
    while any(llm.engine.has_unfinished_requests() for llm in llms.values()):
        for name, llm in llms.items():  # alternate steps: a, b, a, b, ...
            if not llm.engine.has_unfinished_requests():
                continue
            log.clear()
            for out in llm.engine.step():
                if out.finished:
                    tokens[name][out.request_id] = out.output_token_ids
            assert {set_name for set_name, _ in log} <= {name}, f"a step of engine {name} ran other ops"
            called[name].update(op for _, op in log)
    assert called == {"a": EMBEDDED_MODEL_OPS, "b": EMBEDDED_MODEL_OPS}

    reference = greedy_tokens(LLM(device="cpu", dtype="float32"))
    for name in llms:
        assert [tokens[name][f"{name}{i}"] for i in range(len(PROMPTS))] == reference


@pytest.mark.gpu
def test_reference_engine_keeps_its_ops_beside_a_fast_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU engine built with HYBRID_ENGINE_KERNELS=reference keeps the reference ops after
    a fast engine is built and run in the same process, and its greedy tokens equal those
    of a fresh reference engine."""
    pytest.importorskip("triton", reason="the fast ops need Triton")
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=4, num_kv_blocks=64)
    monkeypatch.setenv(KERNELS_ENV, "reference")
    reference_llm = LLM(**kwargs)
    monkeypatch.delenv(KERNELS_ENV)
    fast_llm = LLM(**kwargs)
    fast_ops = fast_llm.engine.kernels
    assert fast_ops.name == "fast"
    assert any(".triton." in module for module in fast_ops.describe().values())
    assert all(ops is fast_ops for ops in layer_op_sets(fast_llm))
    greedy_tokens(fast_llm)

    assert reference_llm.engine.kernels is REFERENCE_OPS
    assert all(ops is REFERENCE_OPS for ops in layer_op_sets(reference_llm))
    tokens = greedy_tokens(reference_llm)
    monkeypatch.setenv(KERNELS_ENV, "reference")
    assert greedy_tokens(LLM(**kwargs)) == tokens
