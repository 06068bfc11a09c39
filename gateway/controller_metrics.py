"""`/metrics` series of the SLO controller: its decisions by action and reason, and the
split it aims at beside the split that serves."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdserve.gateway.series import SeriesBuilder

POOLS = ("prefill", "decode")


class ControllerSeries:
    def __init__(self, registry: CollectorRegistry) -> None:
        series = SeriesBuilder(registry)
        self.decisions = series.counter(
            "controller_decisions",
            "The SLO controller's decisions, one per interval: what it did and why",
            ("action", "reason"),
        )
        self.target = series.gauge(
            "controller_target_instances",
            "Instances per pool the SLO controller's latest decision aims at",
            ("role",),
        )
        self.actual = series.gauge(
            "controller_actual_instances",
            "Instances per pool serving at the SLO controller's latest look",
            ("role",),
        )
        for role in POOLS:  # both pools show from the start, at zero
            self.target.labels(role)
            self.actual.labels(role)

    def count(self, action: str, reason: str) -> None:
        self.decisions.labels(action, reason).inc()

    def show_target(self, prefill: int, decode: int) -> None:
        self.target.labels("prefill").set(prefill)
        self.target.labels("decode").set(decode)

    def show_actual(self, prefill: int, decode: int) -> None:
        self.actual.labels("prefill").set(prefill)
        self.actual.labels("decode").set(decode)
