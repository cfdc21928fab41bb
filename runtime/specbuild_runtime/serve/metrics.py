"""What `GET /metrics` shows, in Prometheus' text format (prometheus_client, one registry per server).

Counters are totals since start; tokens/s is `rate(specbuild_generation_tokens_total[1m])`. α and τ are
also given as gauges over all requests so far, for a person reading the page: α NaN until a draft was proposed (Stats'
rule; a gauge is a float, which prometheus_client writes `NaN` and Prometheus stores), as vLLM's
spec_decode_draft_acceptance_rate gauge was.
"""

from __future__ import annotations

import math

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..decode import Stats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SPEED_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, slots: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specbuild_requests", "Requests by endpoint and outcome: ok, invalid (400/404), "
                                "rejected (queue full, 429), cancelled (client went away), timeout, shutdown, error (500)",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("specbuild_prompt_tokens", "Prompt tokens of decoded requests", registry=r)
        # vLLM's name (vllm:prefix_cache_hits, in tokens); its hit rate here is over specbuild_prompt_tokens_total.
        self.prefix_cache_hits = Counter("specbuild_prefix_cache_hits", "Prompt tokens taken from a slot's cache "
                                         "(prefix reuse) instead of computed", registry=r)
        self.generation_tokens = Counter("specbuild_generation_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("specbuild_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specbuild_accepted_draft_tokens", "Draft tokens the target accepted", registry=r)
        self.rounds = Counter("specbuild_target_calls", "Target calls after each prompt's first (one per round)", registry=r)
        # α and τ over all requests so far, from these totals (prometheus_client's own values are private)
        self._totals = dict(drafted=0, accepted=0, rounds=0, after_first=0)  # after_first: a request's tokens but its first
        t = self._totals
        Gauge("specbuild_acceptance_rate", "α: accepted / proposed draft tokens, all requests so far", registry=r) \
            .set_function(lambda: t["accepted"] / t["drafted"] if t["drafted"] else math.nan)
        Gauge("specbuild_mean_accepted_tokens", "τ: tokens per target call after the prompt's, all requests so far",
              registry=r).set_function(lambda: t["after_first"] / t["rounds"] if t["rounds"] else 0.0)
        self.ttft = Histogram("specbuild_time_to_first_token_seconds", "Arrival to first token, queueing included",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specbuild_inter_token_latency_seconds", "Time between consecutive tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.speed = Histogram("specbuild_request_decode_tokens_per_second", "Decode speed of each request after its first token",
                               buckets=SPEED_BUCKETS, registry=r)
        # Answered 503 by the HTTP protocol before the app (app._refusing_beyond), so in no endpoint's outcomes: without
        # it a client counted 176 503s of 1200 connections at once that the metrics showed nowhere.
        self.refused_connections = Counter("specbuild_refused_connections", "Connections beyond --max-connections, "
                                           "answered 503 as they opened", registry=r)
        self.queue_depth = Gauge("specbuild_queue_depth", "Requests waiting for a slot or for their check "
                                 "(tokenizing; /tokenize and /detokenize too)", registry=r)
        self.slots_busy = Gauge("specbuild_slots_busy", "Slots decoding a request", registry=r)
        Gauge("specbuild_slots", "Slots (--parallel)", registry=r).set(slots)

    def outcome(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def decoded(self, stats: Stats) -> None:
        """A request's decoding ended (finished or stopped early): count what it did."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prefix_cache_hits.inc(stats.cached_prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.rounds.inc(stats.rounds)
        for key, value in dict(drafted=stats.drafted, accepted=stats.accepted, rounds=stats.rounds,
                               after_first=max(stats.generated_tokens - 1, 0)).items():
            self._totals[key] += value
        for gap in np.diff(stats.token_times):
            self.itl.observe(gap)
        if stats.generated_tokens > 1:
            self.speed.observe(stats.tokens_per_second)

    def render(self) -> bytes:
        return generate_latest(self.registry)

