"""The Grafana dashboard, built with grafana-foundation-sdk (Grafana 11.6 types).

``scripts/gen_manifests.py`` writes it to ``charts/ladle/dashboards/ladle.json``, which the
chart ships in a ConfigMap for Grafana's sidecar. Panels read the chart's recording rules where
one exists, so the dashboard and the alerts agree on every number; the rest read raw series.
Every query filters by the ``namespace`` and ``inferenceservice`` variables (the gateway calls
the latter ``service``), the pool panels by ``gpupool``.

This module is a build-time generator (grafana-foundation-sdk is a dev dependency); nothing in
the operator, gateway or runtime imports it.
"""

from __future__ import annotations

import json

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import stat, statetimeline, table
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from ladle.monitoring.flow_panels import flow_control
from ladle.monitoring.panels import (
    DATASOURCE,
    GW,
    ISVC,
    POOL,
    WIDTH,
    percentiles,
    query,
    row,
    series,
    targets,
)

UID = "ladle-overview"


def build() -> model.Dashboard:
    svc = "{{namespace}}/{{inferenceservice}}"
    gw_svc = "{{namespace}}/{{service}}"
    dash = (
        db.Dashboard("Ladle")
        .uid(UID)
        .description(
            "Ladle InferenceServices: traffic, errors, latency, engine saturation, replicas, "
            "circuit breakers, canary rollouts and GPU pools."
        )
        .tags(["ladle", "llm", "inference"])
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .time("now-3h", "now")
        .refresh("30s")
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            db.QueryVariable("namespace")
            .label("Namespace")
            .datasource(DATASOURCE)
            .query("label_values(ladle:num_requests_running, namespace)")
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
        .with_variable(
            db.QueryVariable("inferenceservice")
            .label("InferenceService")
            .datasource(DATASOURCE)
            .query(
                'label_values(ladle:num_requests_running{namespace=~"$namespace"}, '
                "inferenceservice)"
            )
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
        .with_variable(
            db.QueryVariable("gpupool")
            .label("GPUPool")
            .datasource(DATASOURCE)
            .query("label_values(ladle_operator_gpupool_capacity_gpus, gpupool)")
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    )

    dash = dash.with_row(row("Traffic and errors (gateway)"))
    dash = dash.with_panel(
        series(
            "Requests by service",
            "Requests answered by the gateway per second, by the service that served them.",
            "reqps",
            [
                (
                    "sum by (namespace, inferenceservice) "
                    f"(namespace_inferenceservice_code:ladle_gateway_requests:rate5m{{{ISVC}}})",
                    svc,
                )
            ],
        )
    )
    dash = dash.with_panel(
        series(
            "Requests by status code",
            "Per second, by HTTP status (client disconnects, 499, excluded).",
            "reqps",
            [
                (
                    "sum by (code) "
                    f"(namespace_inferenceservice_code:ladle_gateway_requests:rate5m{{{ISVC}}})",
                    "{{code}}",
                )
            ],
        )
    )
    dash = dash.with_panel(
        series(
            "Error ratio (5xx)",
            "The availability SLI over 5 minutes: the share of requests answered 5xx.",
            "percentunit",
            [
                (
                    f"namespace_inferenceservice:ladle_slo_availability_errors:ratio_rate5m{{{ISVC}}}",
                    svc,
                )
            ],
            width=8,
        )
    )
    dash = dash.with_panel(
        series(
            "Fallback traffic",
            "Requests per second sent to the fallback service while the breaker was open.",
            "reqps",
            [(f"namespace_inferenceservice:ladle_gateway_fallbacks:rate5m{{{ISVC}}}", svc)],
            width=8,
        )
    )
    breaker = (
        statetimeline.Panel()
        .title("Circuit breaker")
        .description("Each service's breaker as the gateway replicas see it (the worst wins).")
        .datasource(DATASOURCE)
        .span(8)
        .height(8)
        .mappings(
            [
                model.ValueMap(
                    {
                        "0": model.ValueMappingResult(text="Closed", color="green", index=0),
                        "1": model.ValueMappingResult(text="HalfOpen", color="yellow", index=1),
                        "2": model.ValueMappingResult(text="Open", color="red", index=2),
                    }
                )
            ]
        )
        .with_target(
            query(
                "2 * max by (namespace, service) "
                f'(ladle_gateway_breaker_state{{{GW}, state="Open"}})'
                " + max by (namespace, service) "
                f'(ladle_gateway_breaker_state{{{GW}, state="HalfOpen"}})',
                gw_svc,
                "A",
            )
        )
    )
    dash = dash.with_panel(breaker)

    dash = dash.with_row(row("Flow control (gateway)"))
    for panel in flow_control():
        dash = dash.with_panel(panel)

    dash = dash.with_row(row("Latency (runtime)"))
    dash = dash.with_panel(
        percentiles(
            "Time to first token",
            "Arrival to the first token, measured by the runtime (queue and prefill included).",
            "namespace_inferenceservice_le:ladle_time_to_first_token_seconds_bucket:rate5m",
        )
    )
    dash = dash.with_panel(
        percentiles(
            "Time per output token",
            "Per request: (end - first token) / (generated tokens - 1).",
            "namespace_inferenceservice_le:ladle_request_time_per_output_token_seconds_bucket:rate5m",
        )
    )
    dash = dash.with_panel(
        percentiles(
            "Inter-token latency",
            "The gaps between one request's consecutive tokens.",
            "namespace_inferenceservice_le:ladle_inter_token_latency_seconds_bucket:rate5m",
        )
    )
    dash = dash.with_panel(
        series(
            "Requests with a slow first token",
            "The latency SLI over 5 minutes: the share of requests whose first token missed the "
            "chart's target (monitoring.slo.latency.ttftSeconds).",
            "percentunit",
            [(f"namespace_inferenceservice:ladle_slo_latency_errors:ratio_rate5m{{{ISVC}}}", svc)],
        )
    )
    dash = dash.with_panel(
        percentiles(
            "Queue time",
            "Arrival to first scheduling.",
            "namespace_inferenceservice_le:ladle_request_queue_time_seconds_bucket:rate5m",
        )
    )

    dash = dash.with_row(row("Engine saturation (runtime)"))
    dash = dash.with_panel(
        series(
            "Queue: waiting and running requests",
            "Requests waiting for a batch slot, and in the running batch, over a service's pods.",
            "short",
            [
                (
                    f"namespace_inferenceservice:ladle_num_requests_waiting:sum{{{ISVC}}}",
                    f"waiting {svc}",
                ),
                (
                    f"namespace_inferenceservice:ladle_num_requests_running:sum{{{ISVC}}}",
                    f"running {svc}",
                ),
            ],
        )
    )
    dash = dash.with_panel(
        series(
            "KV-cache usage",
            "The share of KV blocks held by live sequences, per pod.",
            "percentunit",
            [
                (
                    "max by (namespace, inferenceservice, pod) "
                    f"(ladle:kv_cache_usage_perc{{{ISVC}}})",
                    "{{inferenceservice}} {{pod}}",
                )
            ],
        )
    )
    dash = dash.with_panel(
        series(
            "Prefix-cache hit rate",
            "Prompt tokens found in the prefix cache, of those looked up.",
            "percentunit",
            [(f"namespace_inferenceservice:ladle_prefix_cache_hits:ratio_rate5m{{{ISVC}}}", svc)],
            width=8,
        )
    )
    dash = dash.with_panel(
        series(
            "Tokens per second",
            "Prompt tokens prefilled and tokens generated.",
            "short",
            [
                (
                    f"namespace_inferenceservice:ladle_prompt_tokens:rate5m{{{ISVC}}}",
                    f"prompt {svc}",
                ),
                (
                    f"namespace_inferenceservice:ladle_generation_tokens:rate5m{{{ISVC}}}",
                    f"generated {svc}",
                ),
            ],
            width=8,
        )
    )
    dash = dash.with_panel(
        series(
            "Preemptions",
            "Sequences preempted (and recomputed later) for lack of KV blocks, per second.",
            "short",
            [
                (
                    "sum by (namespace, inferenceservice) "
                    f"(rate(ladle:num_preemptions_total{{{ISVC}}}[$__rate_interval]))",
                    svc,
                )
            ],
            width=8,
        )
    )

    dash = dash.with_row(row("Replicas and autoscaling (operator)"))
    dash = dash.with_panel(
        series(
            "Replicas: desired and ready",
            "Desired is what the operator applies (the spec or the autoscaler, within quota).",
            "short",
            [
                (
                    f'ladle_operator_inferenceservice_replicas{{{ISVC}, state="desired"}}',
                    f"desired {svc}",
                ),
                (
                    f'ladle_operator_inferenceservice_replicas{{{ISVC}, state="ready"}}',
                    f"ready {svc}",
                ),
            ],
            width=8,
        )
    )
    dash = dash.with_panel(
        series(
            "Autoscaler",
            "Desired replicas against maxReplicas and the ready pods it read, and the "
            "stable-window demand (requests).",
            "short",
            [
                (f"ladle_operator_autoscaler_desired_replicas{{{ISVC}}}", f"desired {svc}"),
                (f"ladle_operator_autoscaler_max_replicas{{{ISVC}}}", f"max {svc}"),
                (f"ladle_operator_autoscaler_ready_replicas{{{ISVC}}}", f"ready {svc}"),
                (f"ladle_operator_autoscaler_demand{{{ISVC}}}", f"demand {svc}"),
            ],
            width=8,
        )
    )
    autoscaler_state = (
        statetimeline.Panel()
        .title("Autoscaler mode")
        .description("Panic (scale-up only) and frozen on missing metrics.")
        .datasource(DATASOURCE)
        .span(8)
        .height(8)
        .mappings(
            [
                model.ValueMap(
                    {
                        "0": model.ValueMappingResult(text="no", color="green", index=0),
                        "1": model.ValueMappingResult(text="yes", color="orange", index=1),
                    }
                )
            ]
        )
    )
    dash = dash.with_panel(
        targets(
            autoscaler_state,
            [
                (f"ladle_operator_autoscaler_panic{{{ISVC}}}", f"panic {svc}"),
                (f"ladle_operator_autoscaler_metrics_frozen{{{ISVC}}}", f"frozen {svc}"),
            ],
        )
    )
    conditions = (
        table.Panel()
        .title("Conditions")
        .description("Each InferenceService's current conditions, as its status says.")
        .datasource(DATASOURCE)
        .span(WIDTH)
        .height(8)
        .with_target(
            query(f"ladle_operator_inferenceservice_condition{{{ISVC}}} == 1", "", "A")
            .instant()
            .format(PromQueryFormat.TABLE)
        )
    )
    dash = dash.with_panel(conditions)

    dash = dash.with_row(row("Canary rollouts (operator)"))
    dash = dash.with_panel(
        series(
            "Canary weight",
            "Percent of a service's requests sent to its canary variant.",
            "percent",
            [(f"ladle_operator_rollout_canary_weight{{{ISVC}}}", svc)],
            width=8,
        )
    )
    dash = dash.with_panel(
        series(
            "Gate results",
            "Analyses per gate and result (pass, fail, inconclusive) over the last hour.",
            "short",
            [
                (
                    "sum by (namespace, inferenceservice, gate, result) "
                    f"(increase(ladle_operator_rollout_analysis_total{{{ISVC}}}[1h]))",
                    "{{inferenceservice}} {{gate}} {{result}}",
                ),
                (
                    "sum by (namespace, inferenceservice, gate) "
                    f"(increase(ladle_operator_rollout_rollbacks_total{{{ISVC}}}[1h]))",
                    "{{inferenceservice}} rolled back on {{gate}}",
                ),
            ],
            width=8,
        )
    )
    phase = (
        statetimeline.Panel()
        .title("Rollout phase")
        .description("Idle, Progressing, Paused, Promoted, RolledBack or Failed, with the step.")
        .datasource(DATASOURCE)
        .span(8)
        .height(8)
    )
    dash = dash.with_panel(
        targets(
            phase,
            [
                (
                    f"ladle_operator_rollout_phase{{{ISVC}}} == 1",
                    "{{inferenceservice}} {{phase}}",
                ),
                (f"ladle_operator_rollout_step{{{ISVC}}}", "{{inferenceservice}} step"),
            ],
        )
    )

    dash = dash.with_row(row("GPU pools (operator)"))
    dash = dash.with_panel(
        series(
            "GPU pool usage",
            "Capacity and allocatable GPUs of each pool's nodes, against what its "
            "InferenceServices request, are granted (claimed) and the quota.",
            "short",
            [
                (f"ladle_operator_gpupool_{metric}_gpus{{{POOL}}}", f"{metric} {{{{gpupool}}}}")
                for metric in ("capacity", "allocatable", "requested", "claimed", "quota")
            ],
            width=WIDTH,
        )
    )

    dash = dash.with_row(row("Control plane"))
    dash = dash.with_panel(
        stat.Panel()
        .title("Targets up")
        .description("Scraped pods answering, per component.")
        .datasource(DATASOURCE)
        .span(6)
        .height(6)
        .with_target(
            query(
                'sum by (job) (up{job=~"ladle-operator|ladle-gateway|ladle-runtime"})',
                "{{job}}",
                "A",
            )
        )
    )
    dash = dash.with_panel(
        series(
            "Operator leader",
            "1 for the replica that holds the leader Lease and reconciles.",
            "short",
            [('ladle_operator_leader{job="ladle-operator"}', "{{pod}}")],
            width=6,
        )
    )
    dash = dash.with_panel(
        series(
            "Reconciles",
            "Reconciles per second by kind and result.",
            "ops",
            [
                (
                    "sum by (kind, result) "
                    "(rate(ladle_operator_reconcile_total[$__rate_interval]))",
                    "{{kind}} {{result}}",
                )
            ],
            width=6,
        )
    )
    return dash.with_panel(
        series(
            "Gateway added latency",
            "p99 of the time the gateway itself adds to a request.",
            "s",
            [
                (
                    "histogram_quantile(0.99, sum by (le) "
                    "(rate(ladle_gateway_added_latency_seconds_bucket[$__rate_interval])))",
                    "p99",
                )
            ],
            width=6,
        )
    ).build()


def render() -> str:
    """The dashboard as the JSON Grafana imports (stable key order, so diffs stay small)."""
    text = json.dumps(build(), cls=JSONEncoder, indent=2, sort_keys=True)
    return text + "\n"
