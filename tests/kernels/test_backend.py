"""The op contract and op-set selection: every implementation keeps the `KernelOps`
signatures, `select_ops` picks per device and env without global state, `OpSet` is whole
and immutable. CPU; the one check that imports Triton skips without it."""
import ast
import importlib.util
import inspect
import sys
import types
from pathlib import Path

import pytest

from layers.kernels import KERNELS_ENV, OP_NAMES, REFERENCE_OPS, KernelOps, OpSet, reference, select_ops
from layers.kernels import fast, ops as ops_module


def _signature_text(func: ast.FunctionDef, drop_self: bool = False) -> list[tuple[str, str | None, str | None]]:
    """(name, annotation, default) of every parameter, as source text, then ('->', return)."""
    args = func.args
    params = args.posonlyargs + args.args
    defaults = [None] * (len(params) - len(args.defaults)) + list(args.defaults)
    rows = [(a.arg, a.annotation and ast.unparse(a.annotation), d and ast.unparse(d)) for a, d in zip(params, defaults)]
    rows += [(a.arg, a.annotation and ast.unparse(a.annotation), d and ast.unparse(d))
             for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if drop_self:
        assert rows[0][0] == "self"
        rows = rows[1:]
    return rows + [("->", func.returns and ast.unparse(func.returns), None)]


def _functions(path: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(Path(path).read_text())
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


PROTOCOL = {name: _signature_text(f, drop_self=True) for name, f in _functions(ops_module.__file__).items()
            if name in OP_NAMES}


def _implementations() -> list[tuple[str, str]]:
    """(op, source file) of every reference and Triton implementation, found without
    importing Triton (its modules are located, not executed)."""
    found = [(op, inspect.getsourcefile(getattr(reference, op))) for op in OP_NAMES]
    for module, op_names in fast.FAMILIES.items():
        origin = importlib.util.find_spec(f"layers.kernels.triton.{module}").origin
        found += [(op, origin) for op in op_names]
    return found


def test_protocol_lists_every_op_once() -> None:
    assert set(PROTOCOL) == set(OP_NAMES) and len(OP_NAMES) == len(set(OP_NAMES))
    assert set(reference.__all__) == set(OP_NAMES)  # the reference module is exactly one op set


@pytest.mark.parametrize("op,path", [pytest.param(op, path, id=f"{Path(path).parent.name}.{Path(path).stem}.{op}")
                                     for op, path in _implementations()])
def test_implementation_has_the_protocol_signature(op: str, path: str) -> None:
    """Parameter names, order, annotations and defaults equal `KernelOps`'s, as written."""
    assert _signature_text(_functions(path)[op]) == PROTOCOL[op]


def test_fast_families_cover_every_op() -> None:
    offered = [op for op_names in fast.FAMILIES.values() for op in op_names]
    assert len(offered) == len(set(offered))
    assert set(offered) == set(OP_NAMES)


def test_reference_module_and_op_set_satisfy_the_protocol() -> None:
    assert isinstance(reference, KernelOps)
    assert isinstance(REFERENCE_OPS, KernelOps)
    assert all(getattr(REFERENCE_OPS, op) is getattr(reference, op) for op in OP_NAMES)
    assert not isinstance(types.SimpleNamespace(rms_norm=len), KernelOps)


def test_op_set_is_whole_and_immutable() -> None:
    impls = REFERENCE_OPS.implementations()
    with pytest.raises(ValueError, match="missing ops \\['moe_experts'\\]"):
        OpSet("partial", {op: f for op, f in impls.items() if op != "moe_experts"})
    with pytest.raises(ValueError, match="unknown ops \\['fused_everything'\\]"):
        OpSet("extra", {**impls, "fused_everything": len})
    with pytest.raises(AttributeError, match="immutable"):
        REFERENCE_OPS.rms_norm = len
    assert REFERENCE_OPS.rms_norm is reference.rms_norm
    derived = REFERENCE_OPS.with_ops("custom", {"rms_norm": len})
    assert derived.name == "custom" and derived.rms_norm is len and derived.moe_experts is reference.moe_experts
    assert REFERENCE_OPS.rms_norm is reference.rms_norm and REFERENCE_OPS.name == "reference"


@pytest.mark.parametrize("env", [None, "auto", "fast", "reference", "REFERENCE"])
def test_cpu_always_gets_the_reference(monkeypatch: pytest.MonkeyPatch, env: str | None) -> None:
    if env is None:
        monkeypatch.delenv(KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(KERNELS_ENV, env)
    assert select_ops("cpu") is REFERENCE_OPS


def test_env_rejects_unknown_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNELS_ENV, "fastest")
    with pytest.raises(ValueError, match=f"{KERNELS_ENV}.*'fastest'"):
        select_ops("cpu")


def _fake_norm_family() -> types.ModuleType:
    """A stand-in Triton norm module: the only family that 'imports' in the test below."""
    module = types.ModuleType("layers.kernels.triton.norm")

    def rms_norm(x, weight, eps, weight_in_fp32=True):
        raise AssertionError("not called")

    def add_rms_norm(x, residual, weight, eps, weight_in_fp32=True, residual_scale=None):
        raise AssertionError("not called")

    def gated_rms_norm(x, z, weight, eps, group_size):
        raise AssertionError("not called")

    for func in (rms_norm, add_rms_norm, gated_rms_norm):
        func.__module__ = module.__name__
        setattr(module, func.__name__, func)
    return module


def test_cuda_choice_per_family_and_env_read_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA each family that imports is fast and the rest stay reference; the env var is
    read at each choice, and a later choice leaves an earlier op set as it was. (Only the
    device type matters to `select_ops`, so this runs without a GPU.)"""
    for module in fast.FAMILIES:
        monkeypatch.setitem(sys.modules, f"layers.kernels.triton.{module}", None)  # import raises
    fake = _fake_norm_family()
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.delenv(KERNELS_ENV, raising=False)

    chosen = select_ops("cuda")
    assert chosen.name == "fast"
    norm_ops = fast.FAMILIES["norm"]
    assert all(getattr(chosen, op) is getattr(fake, op) for op in norm_ops)
    others = set(OP_NAMES) - set(norm_ops)
    assert all(getattr(chosen, op) is getattr(reference, op) for op in others)

    monkeypatch.setenv(KERNELS_ENV, "reference")
    assert select_ops("cuda:0") is REFERENCE_OPS
    assert chosen.rms_norm is fake.rms_norm  # the earlier choice is untouched
    assert REFERENCE_OPS.rms_norm is reference.rms_norm


def test_fast_ops_import_with_the_protocol_signatures() -> None:
    """With Triton installed, the imported fast ops have `KernelOps`'s runtime signatures
    (the source-level check above runs everywhere; this one also evaluates annotations)."""
    pytest.importorskip("triton", reason="Triton is not installed (CPU CI): the Triton modules cannot import")
    found = fast.available_ops()
    assert set(found) == set(OP_NAMES)
    for op, impl in found.items():
        want = inspect.signature(getattr(KernelOps, op))
        want = want.replace(parameters=list(want.parameters.values())[1:])  # drop self
        assert inspect.signature(impl) == want, op
