"""The dashboard's flow-control row: what waits at the gateway for a pod's free slot, for how
long, by priority band and tenant, and what the full queue sheds (docs/gateway.md)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import timeseries

from ladle.monitoring.panels import GW, ISVC, series


def flow_control() -> list[timeseries.Panel]:
    tenant_rate = "sum by (tenant) (rate({name}{{{gw}}}[$__rate_interval]))"
    return [
        series(
            "Waiting at the gateway, by band",
            "Requests waiting for a pod's free slot (or a ready pod, at zero), summed over the "
            "gateway replicas; the autoscaler reads the total as demand.",
            "short",
            [(f"sum by (band) (ladle_gateway_held_requests{{{GW}}})", "{{band}}")],
            width=6,
        ),
        series(
            "Queue wait p99, by band",
            "The time a request waited at the gateway for a slot.",
            "s",
            [
                (
                    "histogram_quantile(0.99, sum by (band, le) "
                    f"(rate(ladle_gateway_queue_wait_seconds_bucket{{{GW}}}[$__rate_interval])))",
                    "{{band}}",
                )
            ],
            width=6,
        ),
        series(
            "Mean queue wait, by tenant",
            "Each tenant's mean wait (API key, or x-gateway-inference-fairness-id): with fair "
            "shares, a light tenant's stays low while a heavy one's grows.",
            "s",
            [
                (
                    tenant_rate.format(name="ladle_gateway_queue_tenant_wait_seconds_total", gw=GW)
                    + " / "
                    + tenant_rate.format(name="ladle_gateway_queued_total", gw=GW),
                    "{{tenant}}",
                )
            ],
            width=6,
        ),
        series(
            "Shed, by band and reason",
            "Requests the queue gave up on per second: queue_full and displaced are 429s (the "
            "lowest band first), deadline a 504, no_ready_pods a 503.",
            "reqps",
            [
                (
                    "sum by (band, reason) "
                    f"(namespace_inferenceservice_band_reason:ladle_gateway_shed:rate5m{{{ISVC}}})",
                    "{{band}} {{reason}}",
                )
            ],
            width=6,
        ),
    ]
