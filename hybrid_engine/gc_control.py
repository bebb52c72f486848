"""Python's cyclic garbage collector, run where its pauses cannot starve the GPU.

Left to the interpreter, a collection starts at whatever allocation crosses a threshold;
a full one walks every tracked object (requests, their lists, outputs) and takes up to
~1 ms with a large batch. Under launch-ahead the host loop must enqueue step N+2 before
the device finishes step N+1, so such a pause shows up as device idle time: measured on
the H100 host, 0.4-0.9 ms gaps and 0.5-4% idle at batch 8-128 with automatic collection,
none without it.

So while the engine has requests, automatic collection is off and the engine collects
itself, at a point of the step where the device still has queued work: the youngest
generation every few steps, the middle one now and then, everything rarely (a bound on
what reference cycles can hold; that one may still cost ~1 ms, once per 8192 steps).
When the engine runs out of requests, automatic collection resumes as the process had it.
Nothing is frozen (`gc.freeze`): frozen objects are never collected, so a frozen
reference cycle -- the caller's or a dropped engine's -- would leak.
"""
import gc

YOUNG_EVERY = 8  # steps between collections of generation 0
MIDDLE_EVERY = 256  # ... of generations 0-1
FULL_EVERY = 8192  # ... of everything


class StepGarbageCollector:
    """Owns automatic garbage collection while the engine is busy (see the module doc)."""

    def __init__(self) -> None:
        self._owned = False  # we turned automatic collection off and must turn it back on
        self._steps = 0

    def busy(self) -> None:
        """The engine has requests: take over collection (if the process had it on)."""
        if not self._owned and gc.isenabled():
            gc.disable()
            self._owned = True

    def collect_in_slack(self) -> None:
        """Called once per step while the device still has queued work."""
        if not self._owned:
            return
        self._steps += 1
        if self._steps % FULL_EVERY == 0:
            gc.collect()
        elif self._steps % MIDDLE_EVERY == 0:
            gc.collect(1)
        elif self._steps % YOUNG_EVERY == 0:
            gc.collect(0)

    def idle(self) -> None:
        """The engine has no requests (or stops): automatic collection resumes."""
        if self._owned:
            gc.enable()
            self._owned = False
