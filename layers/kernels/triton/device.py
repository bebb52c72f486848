"""What the Triton ops ask of the device they run on."""
import functools

import torch
import triton
import triton.language as tl

INTERPRETER_SMS = 132  # off CUDA (the Triton interpreter): an H100's count; any value works
MAX_ARRIVAL_COUNTERS = 128


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The device's number of SMs, which grid sizes are chosen against (cached)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _pdl_on(device: torch.device) -> bool:
    """NVIDIA Hopper or later (ROCm reports its own capability numbers: never)."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's MAX_ARRIVAL_COUNTERS zeroed int32 counters for kernels whose last program
    to arrive finishes the work (split-K projections, NemotronH's router, the one-token MoE
    down GEMM's combine, the greedy argmax): a kernel counts
    its programs on them and leaves them zero again. Every such kernel waits for the kernel
    before it (`wait_for_previous_kernel`), and the engine runs its forward passes, graphed
    or not, on one stream, so two kernels never use them at once. Made at the first call,
    which is eager (graphs are captured after a warm-up)."""
    return torch.zeros(MAX_ARRIVAL_COUNTERS, dtype=torch.int32, device=device)


def pdl(tensor: torch.Tensor) -> dict[str, bool]:
    """Launch options that make a kernel on `tensor`'s device a programmatic dependent
    launch where the device has it (NVIDIA Hopper and later): the kernel is set up while
    the kernel before it still runs, and starts when that one releases it instead of after
    its whole completion. Every kernel of ours takes them; their `PDL` flag makes it wait
    (`wait_for_previous_kernel`) before touching memory, since without that wait the
    previous kernel's writes need not be visible yet. Off CUDA (the Triton interpreter)
    both are off. What it saves: docs/kernels.md, "Programmatic dependent launch"."""
    on = _pdl_on(tensor.device)
    return {"launch_pdl": on, "PDL": on}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """A kernel's first statement: under a programmatic dependent launch, wait until the
    kernel before it has completed and its writes are visible, then let the kernel after
    it launch (a no-op otherwise).

    The release comes right after the wait, so at most one kernel waits ahead of the one
    running, and it takes effect once every program of this kernel has made it, i.e. once
    all of them run: the next kernel's programs take only SM slots this kernel has no use
    for, and wait there for it to complete. Releasing at exit instead was slower
    (docs/benchmarks.md, session 13)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
