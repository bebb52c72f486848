"""Every Triton kernel of ours is a programmatic dependent launch on Hopper and later, and
waits for the kernel before it before touching memory (`layers/kernels/triton/device.py`)."""
import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (CPU CI): the kernel modules cannot import")

from triton.runtime.jit import KernelInterface  # noqa: E402

import layers.kernels.triton as triton_package  # noqa: E402
import layers.kernels.triton.device as device_module  # noqa: E402
from hybrid_engine import LLM, SamplingParams  # noqa: E402
from layers.kernels.triton.device import pdl  # noqa: E402
from tests.models.conftest import make_hf_checkpoint  # noqa: E402


def _kernels() -> dict[str, KernelInterface]:
    """Our launched Triton kernels: the private `_*_kernel` functions (the others are
    helpers inlined into them)."""
    found = {}
    for info in pkgutil.iter_modules(triton_package.__path__):
        module = importlib.import_module(f"{triton_package.__name__}.{info.name}")
        for name, fn in vars(module).items():
            if isinstance(fn, KernelInterface) and name.startswith("_") and name.endswith("_kernel"):
                found[f"{info.name}.{name}"] = fn
    return found


def _first_statement(fn: KernelInterface) -> str:
    """The kernel's first statement after its docstring, as source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(fn.fn))).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.unparse(body[0])


def test_every_kernel_waits_first_under_its_pdl_flag():
    kernels = _kernels()
    assert len(kernels) >= 20
    assert [name for name, fn in kernels.items() if "PDL" not in fn.arg_names] == []
    assert {name: first for name, fn in kernels.items()
            if (first := _first_statement(fn)) != "wait_for_previous_kernel(PDL)"} == {}


def test_pdl_is_off_without_cuda():
    assert pdl(torch.zeros(1)) == {"launch_pdl": False, "PDL": False}


@pytest.mark.gpu
def test_kernels_of_a_hybrid_moe_run_launch_dependent_on_hopper(tmp_path, monkeypatch):
    """An async, graphed run compiles every kernel it uses with `launch_pdl` on Hopper, and
    gives the tokens of a serial eager run with PDL off."""
    make_hf_checkpoint(tmp_path, "nemotron_moe_sharp_open")
    prompts = [[3 + (7 * i + j) % 90 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def run(**kwargs) -> list[list[int]]:
        llm = LLM(model=str(tmp_path), device="cuda", dtype="float32", max_num_seqs=4, **kwargs)
        return [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    launched = run()
    expected = torch.cuda.get_device_capability()[0] >= 9 and torch.version.hip is None
    device = torch.cuda.current_device()
    compiled = {name: [k.metadata.launch_pdl for k in fn.device_caches[device][0].values()]
                for name, fn in _kernels().items() if device in fn.device_caches}
    ran = {name for name, flags in compiled.items() if flags}
    assert {"norm._add_rms_norm_kernel", "conv1d._conv_update_kernel", "ssm_update._ssm_update_kernel",
            "ssd._ssd_varlen_kernel", "attention._attn_decode_kernel", "moe._moe_gemm_kernel",
            "moe_routing._gemm_route_kernel", "moe_routing._route_kernel", "moe_align._align_kernel"} <= ran
    assert {name: flags for name, flags in compiled.items() if set(flags) - {expected}} == {}
    monkeypatch.setattr(device_module, "_pdl_on", lambda device: False)
    assert launched == run(async_scheduling=False, cuda_graphs=False)
