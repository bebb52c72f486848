"""Every Triton kernel of ours is a programmatic dependent launch on Hopper and later, and
waits for the kernel before it (`layers/kernels/triton/device.py`)."""
import importlib
import pkgutil

import pytest
import torch
from triton.runtime.jit import JITFunction

import layers.kernels.triton as triton_package
from hybrid_engine import LLM, SamplingParams
from layers.kernels.triton.device import pdl
from tests.models.conftest import make_hf_checkpoint


def _kernels() -> dict[str, JITFunction]:
    """Our launched Triton kernels (the `*_kernel` functions; helpers are inlined into them)."""
    found = {}
    for info in pkgutil.iter_modules(triton_package.__path__):
        module = importlib.import_module(f"{triton_package.__name__}.{info.name}")
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction) and name.endswith("_kernel"):
                found[f"{info.name}.{name}"] = fn
    return found


def test_every_kernel_takes_the_pdl_flag():
    kernels = _kernels()
    assert len(kernels) >= 20
    assert [name for name, fn in kernels.items() if "PDL" not in fn.arg_names] == []


def test_pdl_is_off_without_cuda():
    assert pdl(torch.zeros(1)) == {"launch_pdl": False, "PDL": False}


@pytest.mark.gpu
def test_kernels_of_a_hybrid_moe_run_launch_dependent_on_hopper(tmp_path):
    make_hf_checkpoint(tmp_path, "nemotron_moe_sharp_open")
    llm = LLM(model=str(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=4)
    prompts = [[3 + (7 * i + j) % 90 for j in range(5 + 9 * i)] for i in range(3)]
    serial = LLM(model=str(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=4, async_scheduling=False,
                 cuda_graphs=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs == [o.output_token_ids for o in serial.generate(prompts, params, use_tqdm=False)]
    expected = torch.cuda.get_device_capability()[0] >= 9
    device = torch.cuda.current_device()
    compiled = {name: [k.metadata.launch_pdl for k in fn.device_caches[device][0].values()]
                for name, fn in _kernels().items() if device in fn.device_caches}
    ran = {name for name, flags in compiled.items() if flags}
    assert {"norm._add_rms_norm_kernel", "conv1d._conv_update_kernel", "ssm_update._ssm_update_kernel",
            "ssd._ssd_varlen_kernel", "attention._attn_decode_kernel", "moe._moe_gemm_kernel",
            "moe_routing._sigmoid_grouped_kernel", "moe_align._align_kernel"} <= ran
    assert {name: flags for name, flags in compiled.items() if set(flags) - {expected}} == {}
