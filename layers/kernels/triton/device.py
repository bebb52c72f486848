"""What the Triton ops ask of the device they run on."""
import functools

import torch
import triton
import triton.language as tl

INTERPRETER_SMS = 132  # off CUDA (the Triton interpreter): an H100's count; any value works


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The device's number of SMs, which grid sizes are chosen against (cached)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _pdl_on(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl(tensor: torch.Tensor) -> dict[str, bool]:
    """Launch options that make a kernel on `tensor`'s device a programmatic dependent
    launch where the device has it (Hopper and later): the kernel is set up while the
    kernel before it finishes and starts the moment that one's programs exit, instead of
    after its whole completion. Every kernel of ours takes them, and its `PDL` flag makes
    it wait (`wait_for_previous_kernel`) before touching memory: without that wait the
    previous kernel's writes need not be visible yet. Measured on the H100 (one decode step
    in a CUDA graph, docs/kernels.md): about 0.3 ms of 2.7 at batch 1 on granite-4.0-h-tiny.
    Off CUDA (the Triton interpreter) both are off."""
    on = _pdl_on(tensor.device)
    return {"launch_pdl": on, "PDL": on}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """A kernel's first statement: under a programmatic dependent launch, wait until the
    kernel before it has completed and its writes are visible, then let the kernel after
    it launch (a no-op otherwise).

    The release comes right after the wait, so at most one kernel waits ahead of the one
    running, and the next kernel's programs start as soon as this one's are all running:
    they take SM slots this kernel's programs have no use for (the release counts only once
    every program of this kernel has made it), and wait there for it to complete. Released
    at exit instead, granite-4.0-h-tiny's decode step took 2.45 / 7.68 ms at batch 1 / 32
    against 2.41 / 7.50 (H100, docs/benchmarks.md)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
