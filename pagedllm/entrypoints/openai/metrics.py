"""Prometheus metrics: vLLM's names under the `pagedllm_` prefix, each labelled `model_name`.

Two sources, each read where it is exact:
- queue sizes, KV usage and the engine's token/preemption/prefix-cache counters are read from
  each engine's stats snapshot at scrape time (a custom collector, so an unloaded model's
  series disappear with it);
- per-request latencies and finish reasons are observed on the engine thread from every step's
  outputs, which — unlike the coalesced stream a client sees — include every token.

Every app owns its CollectorRegistry, so two servers in one process (tests) never mix numbers.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.outputs import RequestOutput

PREFIX = "pagedllm_"
LABEL = "model_name"

# (metric name, engine stats key, help) — gauges, then counters (exposed with a _total suffix).
GAUGES = [
    ("num_requests_running", "num_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled (new or preempted by recompute)."),
    ("num_requests_swapped", "num_swapped", "Requests whose KV blocks are swapped out to host memory."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV blocks in use (0-1); cached free blocks count as free."),
]
COUNTERS = [
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "num_preemptions", "Sequences preempted (recompute or swap)."),
    ("prompt_tokens", "prompt_tokens_total", "Prompt tokens of admitted requests."),
    ("generation_tokens", "generation_tokens_total", "Generated tokens."),
]
# Speculative decoding (vLLM's spec_decode_* names); exposed for engines that speculate.
SPEC_COUNTERS = [
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Decodes that verified proposed tokens."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Proposed tokens verified."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Proposed tokens accepted."),
    ("spec_decode_draft_seconds", "spec_decode_draft_time_s", "Time spent proposing (draft model passes or n-gram lookup)."),
    ("spec_decode_target_seconds", "spec_decode_target_time_s", "Time spent in the target model's steps."),
]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class EngineStatsCollector(Collector):
    """Reads `(model name, stats dict)` pairs at scrape time."""

    def __init__(self, snapshots: Callable[[], Iterable[tuple[str, dict]]]):
        self._snapshots = snapshots

    def describe(self) -> list[Metric]:
        return []  # dynamic: names are fixed but label sets come and go with models

    def collect(self) -> Iterator[Metric]:
        snapshots = list(self._snapshots())
        for name, key, doc in GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=[LABEL])
            for model, stats in snapshots:
                family.add_metric([model], float(stats.get(key, 0)))
            yield family
        for name, key, doc in COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=[LABEL])
            for model, stats in snapshots:
                family.add_metric([model], float(stats.get(key, 0)))
            yield family
        for name, key, doc in SPEC_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=[LABEL])
            for model, stats in snapshots:
                if key in stats:
                    family.add_metric([model], float(stats[key]))
            yield family
        per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                           "Proposed tokens accepted, by position in the proposal.", labels=[LABEL, "position"])
        for model, stats in snapshots:
            for position, count in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", [])):
                per_position.add_metric([model, str(position)], float(count))
        yield per_position


class ReplicaStatsCollector(Collector):
    """The same gauges and engine counters per replica of the data-parallel models (`pagedllm_replica_*`,
    labelled model_name and replica; the model's own series are their sums), requests routed to each
    replica by reason (prefix: its cache should hold the prompt's first blocks; load: the least loaded),
    restarts, and whether it is up."""

    def __init__(self, snapshots: Callable[[], Iterable[dict]]):
        self._snapshots = snapshots

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        replicas = list(self._snapshots())
        labels = [LABEL, "replica"]
        for kind, table in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
            for name, key, doc in table:
                family = kind(PREFIX + "replica_" + name, doc, labels=labels)
                for r in replicas:
                    if r["stats"]:
                        family.add_metric([r["model"], str(r["replica"])], float(r["stats"].get(key, 0)))
                yield family
        routed = CounterMetricFamily(PREFIX + "router_requests", "Request groups sent to each replica, by the reason "
                                     "it was chosen (prefix or load).", labels=[*labels, "reason"])
        restarts = CounterMetricFamily(PREFIX + "replica_restarts", "Times a replica was started again after it died.", labels=labels)
        up = GaugeMetricFamily(PREFIX + "replica_up", "1 while the replica serves, 0 while it is down.", labels=labels)
        for r in replicas:
            for reason, count in r["routed"].items():
                routed.add_metric([r["model"], str(r["replica"]), reason], float(count))
            restarts.add_metric([r["model"], str(r["replica"])], float(r["restarts"]))
            up.add_metric([r["model"], str(r["replica"])], 1.0 if r["alive"] else 0.0)
        yield from (routed, restarts, up)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first generated token.", [LABEL], registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between a request's consecutive engine steps that produced tokens.", [LABEL], registry=r, buckets=_ITL_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish.", [LABEL], registry=r, buckets=_E2E_BUCKETS)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.", [LABEL], registry=r, buckets=_LATENCY_BUCKETS)
        self.prefill = Histogram(PREFIX + "request_prefill_time_seconds", "First scheduled to first token.", [LABEL], registry=r, buckets=_LATENCY_BUCKETS)
        self.decode = Histogram(PREFIX + "request_decode_time_seconds", "First token to finish.", [LABEL], registry=r, buckets=_E2E_BUCKETS)
        self.preemptions = Counter(PREFIX + "request_preemptions", "Preemptions of finished requests' samples.", [LABEL], registry=r)
        self.success = Counter(PREFIX + "request_success", "Finished completions (one per returned choice) by finish reason.", [LABEL, "finished_reason"], registry=r)

    def collect_engine_stats(self, snapshots: Callable[[], Iterable[tuple[str, dict]]]) -> None:
        """Expose the gauges and engine counters of whatever `snapshots()` returns at scrape time."""
        self.registry.register(EngineStatsCollector(snapshots))

    def collect_replica_stats(self, snapshots: Callable[[], Iterable[dict]]) -> None:
        self.registry.register(ReplicaStatsCollector(snapshots))

    def searched(self, model_name: str, outputs: list[RequestOutput]) -> None:
        """A finished beam search: one success per returned choice, as for any request."""
        for output in outputs:
            for completion in output.outputs:
                self.success.labels(model_name, completion.finish_reason or "abort").inc()

    def observer(self, model_name: str) -> "RequestObserver":
        return RequestObserver(self, model_name)

    def latency_totals(self, model_name: str) -> dict[str, dict[str, float]]:
        """Sum and count of each latency histogram of one model, e.g. {"ttft": {"sum", "count"}}:
        a client polling them gets the mean latency of any interval from two readings."""
        histograms = {"ttft": self.ttft, "itl": self.itl, "e2e": self.e2e, "queue": self.queue}
        totals = {}
        for key, histogram in histograms.items():
            found = {"sum": 0.0, "count": 0.0}
            for family in histogram.collect():
                for sample in family.samples:
                    if sample.labels.get(LABEL) == model_name and sample.name.endswith(("_sum", "_count")):
                        found[sample.name.rpartition("_")[2]] = sample.value
            totals[key] = found
        return totals

    def render(self) -> bytes:
        return generate_latest(self.registry)


# Beam search's rounds are engine requests of their own (serving_beam_search.py); their ids carry
# this mark so that the request metrics count the search once, not once per round and beam.
BEAM_ROUND_MARK = "-beam-round"


def is_beam_round(request_id: str) -> bool:
    return BEAM_ROUND_MARK in request_id


class RequestObserver:
    """Observes one model's step outputs (called on its engine thread)."""

    def __init__(self, metrics: ServerMetrics, model_name: str):
        self.m = metrics
        self.model = model_name
        self._last: dict[str, tuple[int, float]] = {}  # request id -> (tokens so far, last token time)

    def __call__(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if is_beam_round(output.request_id):
                continue  # the search is counted once, when it ends (ServerMetrics.searched)
            self._tokens(output)
            if output.finished:
                self._finished(output)

    def _tokens(self, output: RequestOutput) -> None:
        metrics = output.metrics
        if metrics is None or metrics.first_token_time is None:
            return
        previous = self._last.get(output.request_id)
        if previous is None:
            self.m.ttft.labels(self.model).observe(metrics.first_token_time - metrics.arrival_time)
        elif metrics.num_generation_tokens > previous[0] and metrics.last_token_time is not None:
            self.m.itl.labels(self.model).observe(metrics.last_token_time - previous[1])
        self._last[output.request_id] = (metrics.num_generation_tokens, metrics.last_token_time or metrics.first_token_time)

    def _finished(self, output: RequestOutput) -> None:
        self._last.pop(output.request_id, None)
        metrics = output.metrics
        if metrics is not None:
            if metrics.finished_time is not None:
                self.m.e2e.labels(self.model).observe(metrics.finished_time - metrics.arrival_time)
            if metrics.first_scheduled_time is not None:
                self.m.queue.labels(self.model).observe(metrics.first_scheduled_time - metrics.arrival_time)
                if metrics.first_token_time is not None:
                    self.m.prefill.labels(self.model).observe(metrics.first_token_time - metrics.first_scheduled_time)
            if metrics.first_token_time is not None and metrics.finished_time is not None:
                self.m.decode.labels(self.model).observe(metrics.finished_time - metrics.first_token_time)
        if output.num_preemptions:
            self.m.preemptions.labels(self.model).inc(output.num_preemptions)
        for completion in output.outputs:
            self.m.success.labels(self.model, completion.finish_reason or "abort").inc()
