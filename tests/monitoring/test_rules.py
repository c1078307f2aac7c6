"""The chart's PrometheusRule: promtool checks it and runs a unit test of every alert (one case
that fires it, one that must not), every alert carries what on-call needs, and the SLO targets
are chart values."""

from __future__ import annotations

import ast
import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ladle.monitoring import promconfig

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RUNBOOKS = ROOT / "docs" / "runbooks"
RUNBOOK_BASE = "https://github.com/ladle-dev/ladle/blob/main/docs/runbooks"
SECTIONS = ("Meaning", "First three commands", "Likely causes", "Mitigations", "Escalation")


def alerts(rule: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]


def promtool_run(promtool: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(promtool), *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def rules_dir(prometheus_rule: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rule file as shipped, one without annotations (the firing logic), and the tests."""
    folder = tmp_path_factory.mktemp("rules")
    groups = copy.deepcopy(promconfig.rule_groups(prometheus_rule))
    (folder / "ladle-rules.yaml").write_text(yaml.safe_dump(groups, sort_keys=False))
    for group in groups["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (folder / "ladle-rules-logic.yaml").write_text(yaml.safe_dump(groups, sort_keys=False))
    for name in ("alerts_test.yaml", "annotations_test.yaml"):
        shutil.copyfile(HERE / name, folder / name)
    return folder


def test_promtool_checks_the_rules(promtool: Path, rules_dir: Path) -> None:
    result = promtool_run(promtool, "check", "rules", "ladle-rules.yaml", cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_of_every_alert_pass(promtool: Path, rules_dir: Path) -> None:
    result = promtool_run(
        promtool, "test", "rules", "alerts_test.yaml", "annotations_test.yaml", cwd=rules_dir
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_rule_fails_its_unit_test(promtool: Path, rules_dir: Path) -> None:
    """The unit tests can fail: the KV-cache alert at 99% misses the 95% case that must fire."""
    logic = yaml.safe_load((rules_dir / "ladle-rules-logic.yaml").read_text())
    (rule,) = [
        r for g in logic["groups"] for r in g["rules"] if r.get("alert") == "LadleKVCacheHigh"
    ]
    assert rule["expr"].endswith("> 0.9")
    rule["expr"] = rule["expr"].replace("> 0.9", "> 0.99")
    (rules_dir / "broken").mkdir()
    (rules_dir / "broken" / "ladle-rules-logic.yaml").write_text(yaml.safe_dump(logic))
    shutil.copyfile(rules_dir / "alerts_test.yaml", rules_dir / "broken" / "alerts_test.yaml")
    result = promtool_run(
        promtool, "test", "rules", "--run", "KV cache above", "alerts_test.yaml",
        cwd=rules_dir / "broken",
    )  # fmt: skip
    assert result.returncode != 0
    assert "LadleKVCacheHigh" in result.stdout + result.stderr


def test_every_alert_has_a_case_that_fires_it_and_one_that_must_not(
    prometheus_rule: dict[str, Any],
) -> None:
    cases = yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
    fired: dict[str, set[str]] = {}
    held: set[str] = set()
    for case in cases:
        for check in case.get("alert_rule_test") or ():
            name = check["alertname"]
            if check.get("exp_alerts"):
                windows = {a["exp_labels"].get("long_window", "") for a in check["exp_alerts"]}
                fired.setdefault(name, set()).update(windows)
            else:
                held.add(name)
    for rule in alerts(prometheus_rule):
        name, window = rule["alert"], rule["labels"].get("long_window", "")
        assert window in fired.get(name, set()), f"no case fires {name} {window}"
        assert name in held, f"no case shows {name} staying quiet"


def test_every_alert_says_how_bad_what_and_where_the_runbook_is(
    prometheus_rule: dict[str, Any],
) -> None:
    rules = alerts(prometheus_rule)
    assert len({r["alert"] for r in rules}) == 18
    for rule in rules:
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        annotations = rule["annotations"]
        assert annotations["summary"], name
        assert annotations["description"], name
        assert annotations["runbook_url"] == f"{RUNBOOK_BASE}/{name}.md"


@pytest.mark.parametrize(
    "page", sorted(p.name for p in RUNBOOKS.glob("Ladle*.md")), ids=lambda p: p[:-3]
)
def test_each_runbook_page_has_meaning_commands_causes_mitigations_and_escalation(
    page: str,
) -> None:
    text = (RUNBOOKS / page).read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings == list(SECTIONS), page
    commands = text.split("## First three commands")[1].split("## ")[0]
    block = re.search(r"```sh\n(.*?)```", commands, re.S)
    assert block is not None, page
    lines = [line for line in block.group(1).splitlines() if line and not line.startswith("#")]
    assert len(lines) == 3, page


def test_every_alert_has_a_runbook_page_and_every_page_an_alert(
    prometheus_rule: dict[str, Any],
) -> None:
    names = {r["alert"] for r in alerts(prometheus_rule)}
    pages = {p.stem for p in RUNBOOKS.glob("Ladle*.md")}
    assert names == pages
    index = (RUNBOOKS / "README.md").read_text()
    assert all(f"({name}.md)" in index for name in names)


def expr(rendered: str, record: str) -> str:
    for doc in yaml.safe_load_all(rendered):
        if doc and doc["kind"] == "PrometheusRule":
            for group in doc["spec"]["groups"]:
                for rule in group["rules"]:
                    if rule.get("record") == record or rule.get("alert") == record:
                        return str(rule["expr"])
    raise AssertionError(f"{record} not rendered")


@pytest.mark.parametrize(("seconds", "le"), [("0.5", "0.5"), ("1", "1.0"), ("2", "2.0")])
def test_the_ttft_target_is_a_chart_value_read_at_its_exact_bucket(
    helm_template: Any, seconds: str, le: str
) -> None:
    rendered = helm_template(
        "monitoring.prometheusRule.enabled=true", f"monitoring.slo.latency.ttftSeconds={seconds}"
    )
    assert rendered.returncode == 0, rendered.stderr
    ratio = expr(
        rendered.stdout, "namespace_inferenceservice:ladle_slo_latency_errors:ratio_rate1h"
    )
    assert f'ladle:time_to_first_token_seconds_bucket{{le="{le}"}}[1h]' in ratio


def runtime_ttft_buckets() -> tuple[float, ...]:
    """runtime/server/metrics.py's LATENCY_BUCKETS, read without importing the engine."""
    source = (ROOT / "runtime" / "server" / "metrics.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [
            "LATENCY_BUCKETS"
        ]:
            return tuple(float(x) for x in ast.literal_eval(node.value))
    raise AssertionError("LATENCY_BUCKETS not found in runtime/server/metrics.py")


def test_the_charts_ttft_bucket_edges_are_the_runtimes(helm_template: Any) -> None:
    """ladle.ttftLe (charts/ladle/templates/_helpers.tpl) keeps a copy of the runtime's TTFT
    buckets to refuse a target that is not an edge; Helm's own list must stay the runtime's."""
    rendered = helm_template(
        "monitoring.prometheusRule.enabled=true", "monitoring.slo.latency.ttftSeconds=0.7"
    )
    assert rendered.returncode != 0
    listed = re.search(r"use one of \[([^\]]*)\]", rendered.stderr)
    assert listed is not None, rendered.stderr
    assert tuple(float(x) for x in listed.group(1).split()) == runtime_ttft_buckets()


def test_objectives_are_chart_values(helm_template: Any) -> None:
    rendered = helm_template(
        "monitoring.prometheusRule.enabled=true",
        "monitoring.slo.availability.objectivePercent=99.9",
        "monitoring.slo.latency.objectivePercent=95",
    )
    assert rendered.returncode == 0, rendered.stderr
    assert "(14.4 * (1 - 99.9 / 100))" in expr(rendered.stdout, "LadleAvailabilityBudgetBurn")
    assert "(14.4 * (1 - 95 / 100))" in expr(rendered.stdout, "LadleLatencyBudgetBurn")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("monitoring.slo.latency.ttftSeconds=0.7", "0.7 is not a bucket edge"),
        ("monitoring.slo.availability.objectivePercent=100", "must be above 0 and below 100"),
    ],
)
def test_a_target_that_cannot_work_is_refused_with_a_reason(
    helm_template: Any, value: str, message: str
) -> None:
    rendered = helm_template("monitoring.prometheusRule.enabled=true", value)
    assert rendered.returncode != 0
    assert message in rendered.stderr


def test_plain_prometheus_files_pass_promtool_check_config(promtool: Path, tmp_path: Path) -> None:
    """manifests/prometheus/ as a Prometheus without the operator would load it."""
    plain = ROOT / "manifests" / "prometheus"
    scrape = yaml.safe_load((plain / "ladle-scrape-configs.yaml").read_text())
    shutil.copyfile(plain / "ladle-rules.yaml", tmp_path / "ladle-rules.yaml")
    config = {"rule_files": ["ladle-rules.yaml"], **scrape}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = promtool_run(promtool, "check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {c["job_name"] for c in scrape["scrape_configs"]}
    assert jobs == {
        f"podMonitor/ladle-system/{name}/0"
        for name in ("ladle-runtime", "ladle-gateway", "ladle-operator")
    }
