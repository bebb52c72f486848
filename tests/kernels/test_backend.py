"""Backend selection and fast-op signatures (CPU; runs in CI)."""
import importlib.util
import inspect
import sys

import pytest

from layers.kernels import KERNELS_ENV, REFERENCE_OPS, reference, select_backend


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    select_backend("cpu")


def test_cpu_selects_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    ops = select_backend("cpu")
    assert ops is REFERENCE_OPS and ops.name == "reference"


def test_env_forces_reference_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNELS_ENV, "reference")
    assert select_backend("cuda") is REFERENCE_OPS


def test_env_rejects_unknown_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNELS_ENV, "fastest")
    with pytest.raises(ValueError):
        select_backend("cpu")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_fast_ops_have_reference_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every offered fast op takes exactly the reference op's parameters; a family whose
    module fails to import drops out alone, the others stay fast."""
    from layers.kernels import fast

    monkeypatch.setitem(sys.modules, "layers.kernels.triton.ssd", None)  # its import now raises ImportError
    found = fast.available_ops()
    assert "ssd_chunk_scan_varlen" not in found
    assert {"paged_attention", "ssm_state_update", "moe_experts", "causal_conv1d_update"} <= set(found)
    monkeypatch.delitem(sys.modules, "layers.kernels.triton.ssd")
    found = fast.available_ops()
    for name, op in found.items():
        want = inspect.signature(getattr(reference, name))
        assert list(inspect.signature(op).parameters) == list(want.parameters), name
