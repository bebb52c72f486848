"""The per-step message from the driver to the tensor-parallel workers, and the worker's
loop that follows it.

Every step the driver's runner writes the step into its pinned host buffer
(`cache/step_buffer.py`); the workers hold runners with buffers of the same layout. The
message is ONE broadcast of a fixed size: the step's shape (`StepHeader`, a few ints:
which engine, the plan's sizes and sampler flags) followed by the bytes of the host buffer
that the step uses (each field's leading rows, `StepBuffer.pack`: a few KB for a decode
step, where the whole buffer holds every field's largest step); what does not fit
(a prompt step's tokens, long contexts' block tables) follows in a second broadcast. Each
rank writes the rows into its own buffer, makes its own single host-to-device copy and
launches the same step. (A broadcast's latency, not its bytes, is most of its cost:
measured on the CPU test machine, two broadcasts of 120 and 205 bytes took 1.4 ms a step,
one of 64 KB 0.8 ms.)

Device operations the driver's bookkeeping issues between steps -- a Mamba state copy
(prefix-cache checkpoint, resume), a KV block copy (copy-on-write), a request's token
history written from a cached prefix -- are logged by `DeviceOpLog` as they run on the
driver and travel with the next step message (a third broadcast, only when there are
some); the worker replays them before that step, which is where stream order put them on
the driver (after every step launched before them, before every later one).

Samples come back from rank 0 only: every rank samples the same gathered logits with the
same seeds, so each keeps identical on-device samples (a launch-ahead step reads them),
and only the driver copies them to the host.
"""
import pickle
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

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
    buffer_bytes: int  # the sender's step-buffer size: the rows are laid out for it
    step_bytes: int  # size of the packed step-buffer rows that follow
    device_ops_bytes: int  # size of the pickled device-op log after them (0: none)

    @classmethod
    def of_plan(cls, engine: int, plan: StepPlan, buffer_bytes: int, step_bytes: int,
                device_ops_bytes: int) -> "StepHeader":
        return cls(KIND_STEP, engine, plan.num_decode, plan.num_prefill, plan.num_tokens, plan.max_seqlen_q,
                   plan.num_logprobs, int(plan.all_greedy), int(plan.use_penalties), plan.num_from_prev,
                   plan.decode_width, plan.num_new_slots, plan.num_saves, buffer_bytes, step_bytes, device_ops_bytes)

    def plan(self) -> StepPlan:
        """The device-side plan of the step (no requests: a worker never sees them)."""
        return StepPlan(sched=SchedulerOutput(), num_decode=self.num_decode, num_prefill=self.num_prefill,
                        num_tokens=self.num_tokens, max_seqlen_q=self.max_seqlen_q, num_logprobs=self.num_logprobs,
                        all_greedy=bool(self.all_greedy), use_penalties=bool(self.use_penalties),
                        num_from_prev=self.num_from_prev, decode_width=self.decode_width,
                        num_new_slots=self.num_new_slots, num_saves=self.num_saves)


_HEADER_BYTES = 8 * len(StepHeader.__dataclass_fields__)
# The step's rows that ride in the header's broadcast (the rest follow in a second one).
STEP_MESSAGE_ROW_BYTES = 1 << 16


def _message_buffer() -> torch.Tensor:
    return torch.empty(_HEADER_BYTES + STEP_MESSAGE_ROW_BYTES, dtype=torch.uint8)


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
        self._message = _message_buffer()  # (a broadcast returns once sent: reused every step)

    def send(self, plan: StepPlan, buffer: StepBuffer) -> None:
        """Send a prepared step: header, the step's rows of the host buffer, and the device
        ops logged before it. A failure here leaves the ranks out of step: the group is
        marked broken."""
        self.group.check_workers()
        ops = self.device_ops.take()
        rows = buffer.pack(plan.extent)
        first = min(len(rows), STEP_MESSAGE_ROW_BYTES)
        header = StepHeader.of_plan(self.engine, plan, buffer.nbytes, len(rows), len(ops))
        message = self._message.numpy()
        message[:_HEADER_BYTES] = np.array(astuple(header), dtype=np.int64).view(np.uint8)
        message[_HEADER_BYTES:_HEADER_BYTES + first] = rows[:first]
        try:
            _broadcast(self._message, self.group)
            if len(rows) > first:
                _broadcast(torch.from_numpy(rows[first:]), self.group)
            if ops:
                _broadcast(torch.frombuffer(bytearray(ops), dtype=torch.uint8), self.group)
        except BaseException as error:  # (an interrupt too: the workers wait for the rest)
            self.group.mark_broken(error)
            raise

    def send_stop(self) -> None:
        """Tell every worker to leave its loop."""
        fields = dict.fromkeys(StepHeader.__dataclass_fields__, 0)
        self._message.numpy()[:_HEADER_BYTES] = np.array(astuple(StepHeader(**{**fields, "kind": KIND_STOP})),
                                                         dtype=np.int64).view(np.uint8)
        _broadcast(self._message, self.group)


def _broadcast(t: torch.Tensor, group: TensorParallelGroup) -> None:
    dist.broadcast(t, src=0, group=group.channel_group)


def follow(group: TensorParallelGroup, targets: dict[int, dict[str, Any]]) -> None:
    """Worker: run the driver's steps until it says stop.

    `targets[engine]` maps the names of `DeviceOpLog.record` to that engine's objects whose
    methods replay them (`LLMEngine.device_op_targets`; its "runner" runs the steps).
    """
    message = _message_buffer()
    while True:
        _broadcast(message, group)
        raw = message.numpy()
        header = StepHeader(*raw[:_HEADER_BYTES].view(np.int64).tolist())
        if header.kind == KIND_STOP:
            return
        runner = targets[header.engine]["runner"]
        if header.buffer_bytes != runner.buffer.nbytes:  # (pools are sized alike on every rank)
            raise RuntimeError(f"engine {header.engine}: the driver's step buffer is {header.buffer_bytes} bytes, "
                               f"this rank's {runner.buffer.nbytes}: their layouts differ")
        plan = header.plan()
        rows = raw[_HEADER_BYTES:_HEADER_BYTES + min(header.step_bytes, STEP_MESSAGE_ROW_BYTES)]
        if header.step_bytes > STEP_MESSAGE_ROW_BYTES:
            rest = torch.empty(header.step_bytes - STEP_MESSAGE_ROW_BYTES, dtype=torch.uint8)
            _broadcast(rest, group)
            rows = np.concatenate([rows, rest.numpy()])
        runner.buffer.unpack(plan.extent, rows, scramble_stale=runner.check_steady_decode)
        if header.device_ops_bytes:
            ops = torch.empty(header.device_ops_bytes, dtype=torch.uint8)
            _broadcast(ops, group)
            for target, op, args in pickle.loads(np.asarray(ops).tobytes()):
                getattr(targets[header.engine][target], op)(*args)
        runner.buffer.sync()
        runner.launch(plan)
