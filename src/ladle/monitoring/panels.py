"""The dashboard's building blocks: the variables every query filters by, and panels in the
few shapes the dashboard uses (time series of queries, latency percentiles, row headers)."""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.models import dashboard as model

DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
# Runtime and operator series, and gateway series (which name the InferenceService `service`).
ISVC = 'namespace=~"$namespace", inferenceservice=~"$inferenceservice"'
GW = 'namespace=~"$namespace", service=~"$inferenceservice"'
POOL = 'gpupool=~"$gpupool"'
WIDTH = 24


def query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return (
        prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)
    )


def targets(panel: Any, queries: list[tuple[str, str]]) -> Any:
    for index, (expr, legend) in enumerate(queries):
        panel = panel.with_target(query(expr, legend, chr(ord("A") + index)))
    return panel


def series(
    title: str, description: str, unit: str, queries: list[tuple[str, str]], width: int = 12
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(8)
        .fill_opacity(10)
    )
    return targets(panel, queries)  # type: ignore[no-any-return]


def percentiles(title: str, description: str, recorded: str) -> timeseries.Panel:
    """p50/p95/p99 per service from a recorded ``namespace_inferenceservice_le`` bucket rate."""
    rate = f"{recorded}{{{ISVC}}}"
    return series(
        title,
        description,
        "s",
        [
            (
                f"histogram_quantile({q}, sum by (namespace, inferenceservice, le) ({rate}))",
                f"p{round(q * 100)} {{{{namespace}}}}/{{{{inferenceservice}}}}",
            )
            for q in (0.5, 0.95, 0.99)
        ],
        width=8,
    )


def row(title: str) -> db.Row:
    return db.Row(title)
