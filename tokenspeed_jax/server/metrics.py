"""Prometheus metrics of the server (`/metrics`, text format via `prometheus_client`).

Latency histograms and token counters are observed as requests finish (the queue time when a
request is first scheduled: `AsyncEngine`'s on_scheduled); everything the
schedulers and runners already count (running / waiting requests, pages per group, prefix hits,
retractions, evictions, compiles) is read from `Engine.stats()` at scrape time by a custom
collector, one sample per data-parallel replica (label `replica`).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenspeed_jax.outputs import CompletionOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# Engine.stats() counters exported as Prometheus counters: stats key -> (metric name, help)
_COUNTERS = {
    "num_retractions": ("tokenspeed_retractions", "requests retracted (preempted) to free pages"),
    "num_evictions": ("tokenspeed_evictions", "cached prefix pages evicted from the pool"),
    "num_compiles": ("tokenspeed_compiles", "XLA compilations of the device step"),
    "prefix_hit_tokens": ("tokenspeed_prefix_hit_tokens", "prompt tokens served by the prefix cache"),
    "prefix_query_tokens": ("tokenspeed_prefix_query_tokens", "prompt tokens looked up in the cache"),
    "num_engine_steps": ("tokenspeed_engine_steps", "device steps run"),
    "num_prefill_tokens": ("tokenspeed_prefill_tokens", "prompt tokens computed (cache hits excluded)"),
    # the host KV tier (issue 49); 0 without one
    "host_hit_tokens": ("tokenspeed_host_hit_tokens", "prompt tokens served by the host KV tier"),
    "resume_hit_tokens": ("tokenspeed_resume_hit_tokens", "tokens resumed requests took from the cache"),
    "host_pages_saved": ("tokenspeed_host_pages_saved", "pages copied to the host KV tier"),
    "host_pages_loaded": ("tokenspeed_host_pages_loaded", "pages loaded back from the host KV tier"),
    "host_bytes_saved": ("tokenspeed_host_bytes_saved", "bytes copied to the host KV tier"),
    "host_bytes_loaded": ("tokenspeed_host_bytes_loaded", "bytes loaded from the host KV tier"),
    "host_copy_s": ("tokenspeed_host_copy_seconds", "host time spent on host-tier copies"),
    "num_aborted": ("tokenspeed_aborted_requests", "requests aborted (client gone, stop string)"),
    "spec_draft_tokens": ("tokenspeed_spec_draft_tokens", "speculative draft tokens proposed"),
    "spec_accepted_tokens": ("tokenspeed_spec_accepted_tokens", "speculative draft tokens accepted"),
    "spec_num_rows": (
        "tokenspeed_spec_rows",
        "speculative rows verified (one per request and step that drafted)",
    ),
}
# Engine.startup_stats() keys exported as tokenspeed_startup_seconds{phase=...}
_STARTUP_PHASES = {
    "load": "load_s",
    "warmup": "warmup_s",
    "trace": "trace_s",
    "compile": "compile_s",
    "load_executables": "load_exe_s",
}


class _EngineCollector:
    def __init__(self, stats: Callable[[], list[dict]]) -> None:
        self._stats = stats

    def collect(self):
        per = self._stats()
        gauges = {
            "running": GaugeMetricFamily(
                "tokenspeed_num_requests_running", "requests holding pages", labels=["replica"]
            ),
            "waiting": GaugeMetricFamily(
                "tokenspeed_num_requests_waiting", "requests queued or retracted", labels=["replica"]
            ),
            "free": GaugeMetricFamily(
                "tokenspeed_pages_free",
                "free pages of the pool (shared by all groups, but a state pool's)",
                labels=["replica"],
            ),
            "total": GaugeMetricFamily(
                "tokenspeed_pages_total", "pages of the pool (null page excluded)", labels=["replica"]
            ),
            "state_free": GaugeMetricFamily(
                "tokenspeed_state_pages_free",
                "free pages of a hybrid model's recurrent-state pool (absent: no such pool)",
                labels=["replica"],
            ),
            "state_total": GaugeMetricFamily(
                "tokenspeed_state_pages_total",
                "pages of a hybrid model's recurrent-state pool (null page excluded)",
                labels=["replica"],
            ),
            "group": GaugeMetricFamily(
                "tokenspeed_pages_used",
                "pages held by running requests, per cache group",
                labels=["replica", "group"],
            ),
            "hit": GaugeMetricFamily(
                "tokenspeed_prefix_hit_rate",
                "prefix-cache hit tokens / prompt tokens looked up",
                labels=["replica"],
            ),
            "startup": GaugeMetricFamily(
                "tokenspeed_startup_seconds",
                "start-up time by phase: "
                "load (model + engine), warmup (wall), and summed over "
                "compile threads: trace (+ lowering), compile (XLA), "
                "load_executables (executable cache reads)",
                labels=["replica", "phase"],
            ),
            "shapes": GaugeMetricFamily(
                "tokenspeed_step_shapes_ready",
                "step shapes made ready, "
                "by source: compiled, loaded (executable cache), "
                "background (compiled lazily while serving; also counted "
                "as compiled or loaded)",
                labels=["replica", "source"],
            ),
        }
        counters = {
            k: CounterMetricFamily(name, doc, labels=["replica"]) for k, (name, doc) in _COUNTERS.items()
        }
        for i, st in enumerate(per):
            r = str(i)
            gauges["running"].add_metric([r], st.get("num_running", 0))
            gauges["waiting"].add_metric([r], st.get("num_waiting", 0))
            gauges["free"].add_metric([r], st.get("free_pages", 0))
            gauges["total"].add_metric([r], st.get("total_pages", 0))
            if "state_total_pages" in st:
                gauges["state_free"].add_metric([r], st["state_free_pages"])
                gauges["state_total"].add_metric([r], st["state_total_pages"])
            gauges["hit"].add_metric([r], st.get("prefix_hit_rate", 0.0))
            for group, n in st.get("group_pages", {}).items():
                gauges["group"].add_metric([r, group], n)
            up = st.get("startup", {})
            for phase, key in _STARTUP_PHASES.items():
                gauges["startup"].add_metric([r, phase], up.get(key, 0.0))
            for source in ("compiled", "loaded", "background"):
                gauges["shapes"].add_metric([r, source], up.get(f"shapes_{source}", 0))
            for key, fam in counters.items():
                fam.add_metric([r], st.get(key, 0))
        yield from gauges.values()
        yield from counters.values()


class ServerMetrics:
    """The server's registry: latency histograms, token counters, engine gauges."""

    def __init__(self, stats: Callable[[], list[dict]]) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.ttft = Histogram(
            "tokenspeed_time_to_first_token_seconds",
            "arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "tokenspeed_time_per_output_token_seconds",
            "mean time per output token after the first",
            buckets=_TPOT_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "tokenspeed_queue_time_seconds",
            "time a request (each of its "
            "n samples) waited from submission to the engine until the "
            "first step that scheduled it",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "tokenspeed_e2e_request_latency_seconds",
            "arrival to finish",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "tokenspeed_prompt_tokens", "prompt tokens of finished requests", registry=reg
        )
        self.generation_tokens = Counter(
            "tokenspeed_generation_tokens", "tokens generated by finished requests", registry=reg
        )
        self.requests = Counter(
            "tokenspeed_requests_finished",
            "finished requests by reason (abort: ended by a shutdown; timeout: --request-timeout-s)",
            ["finish_reason"],
            registry=reg,
        )
        reg.register(_EngineCollector(stats))

    def observe(self, out: CompletionOutput) -> None:
        """Record one finished request (called on an engine thread; prometheus_client is
        thread-safe)."""
        m = out.metrics
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        self.requests.labels(out.finish_reason).inc()
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if out.tpot is not None:
            self.tpot.observe(out.tpot)
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)

    def observe_queue_time(self, seconds: float) -> None:
        """Record one sample's queue time (called on an engine thread)."""
        self.queue_time.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
