"""The per-step message from the driver to the tensor-parallel workers, and the worker's
loop that follows it.

Every step the driver's runner writes the step into its pinned host buffer
(`cache/step_buffer.py`); the workers hold runners with buffers of the same layout. The
message is ONE message of the group's transport (`transport.py`: a shared-memory ring on
one node, gloo broadcasts across nodes): the step's shape (`StepHeader`, a few ints: which
engine, the plan's sizes and sampler flags), then the bytes of the host buffer that the
step uses (each field's leading rows, `StepBuffer.pack`: a few hundred bytes for a decode
step, where the whole buffer holds every field's largest step), then the device
operations logged since the last step. Each rank writes the rows into its own buffer,
makes its own single host-to-device copy and launches the same step.

Device operations the driver's bookkeeping issues between steps -- a Mamba state copy
(prefix-cache checkpoint, resume), a KV block copy (copy-on-write), a request's token
history written from a cached prefix -- are logged by `DeviceOpLog` as they run on the
driver and travel (pickled) at the end of the next step's message; the worker replays
them before that step, which is where stream order put them on the driver (after every
step launched before them, before every later one).

Samples come back from rank 0 only: every rank samples the same gathered logits with the
same seeds, so each keeps identical on-device samples (a launch-ahead step reads them),
and only the driver copies them to the host.
"""
import pickle
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np

from cache.step_buffer import StepBuffer
from hybrid_engine.parallel.group import TensorParallelGroup
from hybrid_engine.scheduler import SchedulerOutput
from hybrid_engine.step import StepPlan

KIND_STEP, KIND_STOP = 1, 2


@dataclass(frozen=True)
class StepHeader:
    """What a worker needs besides the host buffer to run the driver's step."""

    kind: int
    engine: int  # 0: the target engine, 1: its draft-model engine
    num_decode: int
    num_prefill: int
    num_tokens: int
    max_seqlen_q: int
    num_logprobs: int
    all_greedy: int
    use_penalties: int
    num_from_prev: int
    decode_width: int
    num_new_slots: int
    num_saves: int
    num_masks: int
    buffer_bytes: int  # the sender's step-buffer size: the rows are laid out for it
    step_bytes: int  # size of the packed step-buffer rows that follow
    device_ops_bytes: int  # size of the pickled device-op log after them (0: none)

    @classmethod
    def of_plan(cls, engine: int, plan: StepPlan, buffer_bytes: int, step_bytes: int,
                device_ops_bytes: int) -> "StepHeader":
        return cls(KIND_STEP, engine, plan.num_decode, plan.num_prefill, plan.num_tokens, plan.max_seqlen_q,
                   plan.num_logprobs, int(plan.all_greedy), int(plan.use_penalties), plan.num_from_prev,
                   plan.decode_width, plan.num_new_slots, plan.num_saves, plan.num_masks, buffer_bytes, step_bytes,
                   device_ops_bytes)

    def plan(self) -> StepPlan:
        """The device-side plan of the step (no requests: a worker never sees them)."""
        return StepPlan(sched=SchedulerOutput(), num_decode=self.num_decode, num_prefill=self.num_prefill,
                        num_tokens=self.num_tokens, max_seqlen_q=self.max_seqlen_q, num_logprobs=self.num_logprobs,
                        all_greedy=bool(self.all_greedy), use_penalties=bool(self.use_penalties),
                        num_from_prev=self.num_from_prev, decode_width=self.decode_width,
                        num_new_slots=self.num_new_slots, num_saves=self.num_saves, num_masks=self.num_masks)


_HEADER_BYTES = 8 * len(StepHeader.__dataclass_fields__)


def _header_bytes(header: StepHeader) -> np.ndarray:
    return np.array(astuple(header), dtype=np.int64).view(np.uint8)


class DeviceOpLog:
    """Device operations of the driver's bookkeeping, to be replayed by the workers.

    `record(target, op, *args)` is called by the object that just ran `op` on its own
    device tensors (`"mamba"`: the state allocator, `"kv"`: the KV allocator, `"runner"`:
    the model runner); the worker calls the same method of its own object with the same
    arguments.
    """

    def __init__(self):
        self.ops: list[tuple[str, str, tuple]] = []

    def record(self, target: str, op: str, *args: Any) -> None:
        self.ops.append((target, op, args))

    def take(self) -> bytes:
        """The ops logged since the last call, pickled (b"" when none)."""
        if not self.ops:
            return b""
        ops, self.ops = self.ops, []
        return pickle.dumps(ops)


class StepSender:
    """Driver side of one engine's steps (`engine`: 0 target, 1 draft)."""

    def __init__(self, group: TensorParallelGroup, engine: int):
        self.group, self.engine = group, engine
        self.device_ops = DeviceOpLog()

    def send(self, plan: StepPlan, buffer: StepBuffer) -> None:
        """Send a prepared step: header, the step's rows of the host buffer, and the device
        ops logged before it. A failure here leaves the ranks out of step: the group is
        marked broken."""
        self.group.check_workers()
        ops = self.device_ops.take()
        rows = buffer.pack(plan.extent)
        header = StepHeader.of_plan(self.engine, plan, buffer.nbytes, len(rows), len(ops))
        message = np.concatenate([_header_bytes(header), rows, np.frombuffer(ops, dtype=np.uint8)])
        try:
            self.group.messages.send(message, self.group.check_workers)
        except BaseException as error:  # (an interrupt too: the workers wait for the rest)
            self.group.mark_broken(error)
            raise

    def send_stop(self) -> None:
        """Tell every worker to leave its loop."""
        fields = dict.fromkeys(StepHeader.__dataclass_fields__, 0)
        self.group.messages.send(_header_bytes(StepHeader(**{**fields, "kind": KIND_STOP})),
                                 self.group.check_workers)


def follow(group: TensorParallelGroup, targets: dict[int, dict[str, Any]]) -> None:
    """Worker: run the driver's steps until it says stop.

    `targets[engine]` maps the names of `DeviceOpLog.record` to that engine's objects whose
    methods replay them (`LLMEngine.device_op_targets`; its "runner" runs the steps).
    """
    while True:
        message = group.messages.receive()
        header = StepHeader(*message[:_HEADER_BYTES].view(np.int64).tolist())
        if header.kind == KIND_STOP:
            return
        runner = targets[header.engine]["runner"]
        if header.buffer_bytes != runner.buffer.nbytes:  # (pools are sized alike on every rank)
            raise RuntimeError(f"engine {header.engine}: the driver's step buffer is {header.buffer_bytes} bytes, "
                               f"this rank's {runner.buffer.nbytes}: their layouts differ")
        plan = header.plan()
        rows_end = _HEADER_BYTES + header.step_bytes
        runner.buffer.unpack(plan.extent, message[_HEADER_BYTES:rows_end], scramble_stale=runner.check_steady_decode)
        if header.device_ops_bytes:
            for target, op, args in pickle.loads(message[rows_end:rows_end + header.device_ops_bytes].tobytes()):
                getattr(targets[header.engine][target], op)(*args)
        runner.buffer.sync(plan.num_masks)
        runner.launch(plan)
