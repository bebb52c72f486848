"""Engine memory: the paged KV block pool, the Mamba state slot pool and the per-step
bookkeeping buffer (CPU source of truth, mirrored to the device)."""
from cache.kv_cache import KVBlockAllocator
from cache.mamba_cache import MambaStateAllocator, RequestState
from cache.step_buffer import StepBuffer

__all__ = ["KVBlockAllocator", "MambaStateAllocator", "RequestState", "StepBuffer"]
