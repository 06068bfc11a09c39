"""`/metrics` series of instance roles: the role each instance serves in now, its
switches by direction, and how long each took from the request to serving anew."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry

from pdserve.gateway.series import SeriesBuilder

ROLES = ("prefill", "decode", "colocated")
SWITCH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RoleSeries:
    def __init__(self, registry: CollectorRegistry) -> None:
        series = SeriesBuilder(registry)
        self.role = series.gauge(
            "instance_role",
            "1 for the role the instance serves in now (one series per instance)",
            ("instance", "role"),
        )
        self.switches = series.counter(
            "role_switches",
            "Instances that changed role in place (weights and process kept)",
            ("from", "to"),
        )
        self.seconds = series.histogram(
            "role_switch_seconds",
            "From a role switch's request to the instance serving in its new role",
            buckets=SWITCH_BUCKETS,
        )

    def show(self, instance_id: str, role: str) -> None:
        """The instance serves as `role` now: its series for any other role goes."""
        self.forget(instance_id)
        self.role.labels(instance_id, role).set(1)

    def forget(self, instance_id: str) -> None:
        """The instance was stopped for good (drained): it has no role any more."""
        for role in ROLES:
            with contextlib.suppress(KeyError):
                self.role.remove(instance_id, role)

    def record_switch(self, old: str, new: str, seconds: float) -> None:
        self.switches.labels(old, new).inc()
        self.seconds.observe(seconds)
