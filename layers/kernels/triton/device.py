"""What the Triton ops ask of the device they run on."""
import functools

import torch

INTERPRETER_SMS = 132  # off CUDA (the Triton interpreter): an H100's count; any value works


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The device's number of SMs, which grid sizes are chosen against (cached)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
