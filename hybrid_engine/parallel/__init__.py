"""Tensor and expert parallelism across processes: the group (group.py), the per-step
message and the worker's loop (channel.py), the worker process (worker.py). The layers'
side -- shards, collectives -- is `layers/parallel.py`."""
