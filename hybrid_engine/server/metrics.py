"""Prometheus metrics of the server (GET /metrics).

Two kinds: what the server itself observes (finished requests by reason, prompt and
generated tokens, step time, queue-full rejections), kept as ordinary prometheus-client
instruments updated on the engine thread; and a mirror of `LLMEngine.stats()` (pool
occupancy, scheduler, launch-ahead, speculative and prefix-cache counters), read at
scrape time from the latest snapshot the engine thread published, so scraping never
touches the engine.

Each server gets its own registry, so several can live in one process (tests).
"""
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "hybrid_engine"

# stats() key -> (metric name, help). Counters only ever grow in the engine.
_STAT_COUNTERS = {
    "steps": ("engine_steps", "Engine steps launched."),
    "launch_ahead_steps": ("launch_ahead_steps", "Steps launched ahead of the previous step's bookkeeping."),
    "rejected_launches": ("rejected_launches", "Launch-ahead steps with rows rejected (rolled back)."),
    "state_restores": ("state_restores", "Mamba states restored by a rollback."),
    "pauses": ("pauses", "Requests paused for lack of a free KV block."),
    "evictions": ("evictions", "Requests evicted (to be recomputed)."),
    "prefill_tokens": ("prefill_tokens", "Prompt (and recomputed) tokens processed."),
    "decode_tokens": ("decode_tokens", "Decode tokens processed (verified drafts included)."),
    "spec_steps": ("spec_decode_steps", "Retired steps that verified speculative drafts."),
    "spec_proposed_tokens": ("spec_decode_num_draft_tokens", "Speculative draft tokens verified."),
    "spec_accepted_tokens": ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."),
    "prefix_cache_queries": ("prefix_cache_queries", "Tokens looked up in the prefix cache at admission."),
    "prefix_cache_hits": ("prefix_cache_hits", "Looked-up tokens resumed from the prefix cache, not computed."),
    "prefix_cache_dt_limited_requests": ("prefix_cache_dt_limited_requests", "Requests whose generated tokens the "
                                         "prefix cache did not take: a dt outside the prompt-only limit."),
}
_STAT_GAUGES = {
    "running": ("num_requests_running", "Requests in the running batch."),
    "waiting": ("num_requests_waiting", "Requests waiting for admission."),
    "paused": ("num_requests_paused", "Requests paused until a KV block frees."),
    "in_flight": ("num_requests_in_flight", "Requests the server admitted and has not finished."),
    "free_kv_blocks": ("kv_blocks_free", "Free KV cache blocks."),
    "total_kv_blocks": ("kv_blocks_total", "KV cache blocks."),
    "free_mamba_slots": ("mamba_slots_free", "Free Mamba state slots."),
    "total_mamba_slots": ("mamba_slots_total", "Mamba state slots."),
    "prefix_cache_checkpoints": ("prefix_cache_checkpoints", "Mamba state checkpoints the prefix cache holds."),
    "cached_kv_blocks": ("kv_blocks_cached", "KV blocks only the prefix cache holds (counted as free)."),
}

# The gauges that count requests (not pool sizes).
REQUEST_GAUGES = ("running", "waiting", "paused", "in_flight")

StatsSource = Callable[[], dict[str, int]]


class _EngineStatsCollector(Collector):
    """Exposes the latest engine stats snapshot (counters, gauges and usage ratios)."""

    def __init__(self, source: StatsSource):
        self._source = source

    def collect(self) -> Iterator[Metric]:
        """Metric families for the current snapshot (called at scrape time)."""
        stats = self._source()
        for key, value in stats.items():
            if key in _STAT_COUNTERS:
                name, doc = _STAT_COUNTERS[key]
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
            elif key in _STAT_GAUGES:
                name, doc = _STAT_GAUGES[key]
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
            else:
                # Keys the engine adds later still show up, untyped, rather than vanish.
                yield GaugeMetricFamily(f"{PREFIX}_engine_{key}", f"LLMEngine.stats()['{key}']", value=value)
        if stats.get("spec_proposed_tokens"):
            yield GaugeMetricFamily(f"{PREFIX}_spec_decode_draft_acceptance_rate",
                                    "Accepted / verified speculative draft tokens (0..1).",
                                    value=stats["spec_accepted_tokens"] / stats["spec_proposed_tokens"])
        for used_name, free, total in (("kv_cache_usage", "free_kv_blocks", "total_kv_blocks"),
                                       ("mamba_slot_usage", "free_mamba_slots", "total_mamba_slots")):
            if stats.get(total):
                usage = 1.0 - stats[free] / stats[total]
                yield GaugeMetricFamily(f"{PREFIX}_{used_name}", f"Fraction of {total} in use (0..1).", value=usage)


class ServerMetrics:
    """The server's metric registry and the instruments the engine loop updates."""

    def __init__(self, stats: StatsSource):
        self.registry = CollectorRegistry()
        self.finished = Counter(f"{PREFIX}_requests", "Finished requests by finish reason.", ["finish_reason"],
                                registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.", registry=self.registry)
        self.queue_full = Counter(f"{PREFIX}_queue_full_rejections", "Requests refused with 429 (queue full).",
                                  registry=self.registry)
        self.step_seconds = Histogram(
            f"{PREFIX}_step_seconds", "Wall time of one engine step.", registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.registry.register(_EngineStatsCollector(stats))
