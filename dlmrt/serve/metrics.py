"""`/metrics`: the server's Prometheus metrics, through prometheus_client.

    dlmrt_queue_depth                   requests waiting to join the batch
    dlmrt_running_rows                  rows in the running batch
    dlmrt_tokens_per_second             tokens committed per second, over the last 10 s
    dlmrt_tokens_per_forward            tokens per forward per sequence, since start (TPF)
    dlmrt_generated_tokens_total        tokens committed into completions
    dlmrt_forwards_total                forwards of the batch
    dlmrt_cancelled_rows_total          rows that left the batch cancelled (client gone, or timed out)
    dlmrt_request_latency_seconds       histogram, arrival to last token, of answered requests
    dlmrt_time_to_first_block_seconds   histogram, arrival to first streamed block
    dlmrt_rejected_requests_total       by reason: the error code of each 4xx/5xx answer

The scheduler's figures are read when Prometheus scrapes; each app has a registry of its own.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dlmrt.runtime.scheduler import Scheduler

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _SchedulerCollector:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):
        scheduler, stats = self.scheduler, self.scheduler.stats
        yield GaugeMetricFamily("dlmrt_queue_depth", "Requests waiting to join the batch.", value=scheduler.waiting)
        yield GaugeMetricFamily("dlmrt_running_rows", "Rows in the running batch.", value=scheduler.running_rows)
        yield GaugeMetricFamily("dlmrt_tokens_per_second", "Tokens committed per second over the last 10 s.",
                                value=scheduler.tokens_per_second())
        yield GaugeMetricFamily("dlmrt_tokens_per_forward", "Tokens per forward per sequence since start.",
                                value=stats.generated_tokens / max(1, stats.sequence_forwards))
        yield CounterMetricFamily("dlmrt_generated_tokens", "Tokens committed into completions.",
                                  value=stats.generated_tokens)
        yield CounterMetricFamily("dlmrt_forwards", "Forwards of the batch.", value=stats.forwards)
        yield CounterMetricFamily("dlmrt_cancelled_rows", "Rows that left the batch cancelled.", value=stats.cancelled)


class ServerMetrics:
    def __init__(self, scheduler: Scheduler):
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(scheduler))
        self.latency = Histogram("dlmrt_request_latency_seconds", "Arrival to last token, of answered requests.",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.first_block = Histogram("dlmrt_time_to_first_block_seconds", "Arrival to first streamed block.",
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self.rejected = Counter("dlmrt_rejected_requests", "Requests answered with an error, by its code.",
                                ["reason"], registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
