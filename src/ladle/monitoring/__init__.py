"""Monitoring artefacts built from the chart: the Grafana dashboard and plain Prometheus
configuration (scrape configs from the chart's PodMonitors, rule files from its PrometheusRule)
for Prometheus installs without the Prometheus operator."""
