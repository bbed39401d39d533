"""Monitoring in k8s/monitoring: the alert rules, the scrape config, the Prometheus Operator
objects and the Grafana dashboard.

Offline and fast: no cluster, no Prometheus server. promtool (Debian's package prometheus,
installed by `make test`) checks the rules and the config and runs unit tests of the alerts
on synthetic series; a missing promtool is a failure, not a skip.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parent.parent / "k8s"
MONITORING = K8S / "monitoring"
NAMESPACE = "inference-fleet"
RULES_FILE = MONITORING / "alerts.rules.yml"
PROMETHEUS_CONFIG = MONITORING / "prometheus.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"

# The metrics the fleet exports (gateway/metrics.py, workers/metrics.py), webhook included.
HISTOGRAMS = {
    "fleet_http_request_duration_seconds",
    "fleet_job_latency_seconds",
    "fleet_job_queue_wait_seconds",
    "fleet_worker_batch_size",
    "fleet_worker_inference_seconds",
}
SERIES = {
    "fleet_jobs_submitted_total",
    "fleet_jobs_finished_total",
    "fleet_batch_requests_submitted_total",
    "fleet_batch_requests_finished_total",
    "fleet_queue_backlog",
    "fleet_queue_oldest_job_age_seconds",
    "fleet_workers_ready",
    "fleet_dead_letters",
    "fleet_worker_prompt_tokens_total",
    "fleet_worker_generated_tokens_total",
    "fleet_worker_jobs_total",
    "fleet_worker_busy",
    "fleet_worker_running_sequences",
    "fleet_worker_gpu_utilization_ratio",
    "fleet_worker_gpu_memory_used_bytes",
    "fleet_worker_gpu_memory_total_bytes",
    "fleet_webhook_deliveries_total",
    "fleet_cache_hits_total",
    "fleet_cache_misses_total",
    "fleet_cache_coalesced_total",
    "fleet_cache_evictions_total",
    "fleet_cache_expired_total",
    "fleet_cache_bytes",
}
KNOWN_METRICS = SERIES | {
    f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")
}
# Fleet-wide values read from Redis: every gateway replica exports the same numbers, so they
# must be aggregated with max, never summed over replicas.
FLEET_WIDE = re.compile(
    r"^(fleet_(jobs|batch_requests)_(submitted|finished)_total"
    r"|fleet_job_(latency|queue_wait)_seconds_\w+"
    r"|fleet_queue_\w+|fleet_workers_ready|fleet_dead_letters|fleet_cache_\w+)$"
)

ALERTS = {
    "FleetJobLatencyP95High": "critical",
    "FleetBacklogGrowing": "warning",
    "FleetOldestQueuedJobTooOld": "warning",
    "FleetNoWorkerReady": "critical",
    "FleetBatchLaneStalled": "warning",
    "FleetWebhookFailureRateHigh": "warning",
}
PANELS = {
    "End-to-end latency (p50 / p95 / p99)",
    "Jobs finished per second by status",
    "Generated tokens per second",
    "Backlog (undelivered / pending)",
    "Backlog by lane (interactive / batch)",
    "Batch requests per second (submitted / finished by status)",
    "Oldest queued job age",
    "Result cache hit ratio (hits / coalesced)",
    "Result cache size and evictions",
    "Micro-batch size (p50 / mean) and running sequences",
    "Tokens per second per worker",
    "GPU utilisation per worker",
    "GPU memory per worker",
    "HTTP request rate by route",
    "HTTP latency p95 by route",
    "Workers ready",
}

AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile",
}  # fmt: skip
FUNCTIONS = AGGREGATIONS | {
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp",
    "clamp_max", "clamp_min", "count_over_time", "delta", "deriv", "exp", "floor",
    "histogram_quantile", "idelta", "increase", "irate", "label_join", "label_replace",
    "last_over_time", "ln", "log10", "log2", "max_over_time", "min_over_time",
    "predict_linear", "quantile_over_time", "rate", "resets", "round", "scalar", "sgn",
    "sort", "sort_desc", "sqrt", "stddev_over_time", "sum_over_time", "time", "timestamp",
    "vector",
}  # fmt: skip
KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan",
}  # fmt: skip


def _load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _yaml_files() -> list[Path]:
    return sorted([*MONITORING.glob("*.yaml"), *MONITORING.glob("*.yml")])


KUSTOMIZATION = _load_all(MONITORING / "kustomization.yaml")[0]
OBJECTS = [
    obj
    for name in KUSTOMIZATION.get("resources", [])
    if (MONITORING / name).is_file()
    for obj in _load_all(MONITORING / name)
]
RULES = yaml.safe_load(RULES_FILE.read_text())
DASHBOARD_JSON = json.loads(DASHBOARD.read_text())


def _objects(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in OBJECTS if o.get("kind") == kind}


def _rules() -> list[dict]:
    return [rule for group in RULES["groups"] for rule in group["rules"]]


def _panels(panels: list[dict] | None = None) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for panel in DASHBOARD_JSON["panels"] if panels is None else panels:
        out.append(panel)
        out.extend(_panels(panel.get("panels", [])))
    return out


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _panels() for t in p.get("targets", []) if t.get("expr")]


def _without_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana variables allowed in it)."""
    s = _without_strings(expr)
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # range and subquery durations
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", "", s)
    names = set()
    for match in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", s):
        word = match.group(0)
        if s[match.end() :].lstrip().startswith("("):
            assert word in FUNCTIONS, f"unknown PromQL function {word!r} in {expr!r}"
        elif word not in KEYWORDS:
            names.add(word)
    return names


def enclosing_aggregations(expr: str, position: int) -> list[str]:
    """The aggregation operators around `position` in `expr`, innermost first."""
    out, depth = [], 0
    for i in range(position - 1, -1, -1):
        if expr[i] == ")":
            depth += 1
        elif expr[i] == "(":
            if depth:
                depth -= 1
                continue
            head = re.search(r"(\w+)\s*(?:(?:by|without)\s*\([^()]*\))?\s*$", expr[:i])
            if head and head.group(1) in AGGREGATIONS:
                out.append(head.group(1))
    return out


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: `make promtool` installs it (Debian's prometheus)")
    return path


def _promtool_run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_promtool(), *map(str, args)], capture_output=True, text=True, timeout=60, cwd=cwd
    )


# --- files and kustomization ------------------------------------------------------------


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: p.name)
def test_every_yaml_file_parses(path):
    docs = _load_all(path)
    assert docs, f"{path.name} holds no document"
    assert all(isinstance(doc, dict) for doc in docs)


def test_kustomization_lists_every_file():
    assert KUSTOMIZATION["kind"] == "Kustomization"
    assert KUSTOMIZATION["namespace"] == NAMESPACE
    listed = list(KUSTOMIZATION.get("resources", []))
    for generator in KUSTOMIZATION.get("configMapGenerator", []):
        listed += [entry.split("=", 1)[-1] for entry in generator.get("files", [])]
    assert len(listed) == len(set(listed)), "a file is listed twice"
    missing = [name for name in listed if not (MONITORING / name).is_file()]
    assert not missing, f"listed in kustomization.yaml but absent: {missing}"
    present = {p.name for p in MONITORING.iterdir() if p.is_file()} - {"kustomization.yaml"}
    unlisted = sorted(present - set(listed))
    assert not unlisted, f"not listed in k8s/monitoring/kustomization.yaml: {unlisted}"


def test_kustomization_carries_the_operator_objects():
    kinds = sorted(o["kind"] for o in OBJECTS)
    assert kinds == [
        "PodMonitor", "PodMonitor", "PrometheusRule", "ServiceMonitor", "ServiceMonitor"
    ]  # fmt: skip
    for obj in OBJECTS:
        assert obj["apiVersion"] == "monitoring.coreos.com/v1", obj["kind"]
        assert obj["metadata"]["namespace"] == NAMESPACE, obj["kind"]
    pairs = {}
    for entry in KUSTOMIZATION.get("labels", []):
        pairs |= entry["pairs"]
    assert pairs.get("app.kubernetes.io/part-of") == NAMESPACE


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar():
    (generator,) = [
        g for g in KUSTOMIZATION["configMapGenerator"] if "grafana-dashboard.json" in g["files"]
    ]
    assert generator["options"]["labels"]["grafana_dashboard"] == "1"
    assert generator["options"]["disableNameSuffixHash"] is True


# --- monitors against the base ----------------------------------------------------------


def _base_objects() -> list[dict]:
    base = _load_all(K8S / "kustomization.yaml")[0]
    return [obj for name in base["resources"] for obj in _load_all(K8S / name)]


def _base(kind: str, name: str) -> dict:
    (obj,) = [o for o in _base_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


@pytest.mark.parametrize(("monitor", "port"), [("gateway", 8000), ("flower", 5555)])
def test_service_monitor_selects_its_service_and_port(monitor, port):
    spec = _objects("ServiceMonitor")[monitor]["spec"]
    services = [
        o
        for o in _base_objects()
        if o["kind"] == "Service"
        and spec["selector"]["matchLabels"].items() <= o["metadata"].get("labels", {}).items()
    ]
    assert [s["metadata"]["name"] for s in services] == [monitor]
    ports = {p["name"]: p["port"] for p in services[0]["spec"]["ports"]}
    (endpoint,) = spec["endpoints"]
    assert ports[endpoint["port"]] == port
    assert endpoint.get("path", "/metrics") == "/metrics"
    assert "namespaceSelector" not in spec  # its own namespace, wherever an overlay puts it


@pytest.mark.parametrize(("monitor", "port"), [("worker", 9400), ("webhooks", 9450)])
def test_pod_monitor_selects_its_pods_and_their_metrics_port(monitor, port):
    spec = _objects("PodMonitor")[monitor]["spec"]
    deployment = _base("Deployment", monitor)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    for other in {"gateway", "flower", "worker", "webhooks"} - {monitor}:
        labels = _base("Deployment", other)["spec"]["template"]["metadata"]["labels"]
        assert not spec["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint.get("path", "/metrics") == "/metrics"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    declared = {p["containerPort"]: p.get("name") for p in container.get("ports", [])}
    assert declared[port] == endpoint["port"] == "metrics"


# --- alert rules --------------------------------------------------------------------------


def test_promtool_accepts_the_rules():
    result = _promtool_run("check", "rules", RULES_FILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_prometheus_rule_carries_exactly_the_plain_rule_file():
    rule = _objects("PrometheusRule")
    assert len(rule) == 1
    (obj,) = rule.values()
    assert obj["spec"] == {"groups": RULES["groups"]}
    assert set(RULES) == {"groups"}


def test_every_alert_has_a_severity_and_tells_what_to_look_at():
    rules = _rules()
    assert {r["alert"]: r["labels"]["severity"] for r in rules} == ALERTS
    for rule in rules:
        annotations = rule["annotations"]
        assert set(annotations) >= {"summary", "description"}, rule["alert"]
        assert len(annotations["description"]) > 100, rule["alert"]


def test_rules_use_only_the_fleet_metrics():
    used = set()
    for rule in _rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        unknown = names - KNOWN_METRICS
        assert not unknown, f"{rule['alert']} uses unknown metrics {sorted(unknown)}"
        used |= names
    assert "fleet_webhook_deliveries_total" in used


def _rules_without_annotations(path: Path) -> None:
    # promtool compares annotations exactly: the tests below check labels only.
    groups = [
        {**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
        for g in RULES["groups"]
    ]
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))


def _replicas(series: str, values: str) -> list[dict]:
    """The same fleet-wide series (`name{labels}`) exported by two gateway replicas."""
    assert series.endswith("}")
    return [{"series": f'{series[:-1]},instance="gw-{i}"}}', "values": values} for i in (0, 1)]


def _backlog(model: str, lane: str, undelivered: str, pending: str) -> list[dict]:
    """One lane of a model's fleet_queue_backlog, both states, from two gateway replicas."""
    return [
        *_replicas(
            f'fleet_queue_backlog{{model="{model}",lane="{lane}",state="undelivered"}}',
            undelivered,
        ),
        *_replicas(
            f'fleet_queue_backlog{{model="{model}",lane="{lane}",state="pending"}}', pending
        ),
    ]


def _age(model: str, lane: str, values: str) -> list[dict]:
    return _replicas(f'fleet_queue_oldest_job_age_seconds{{model="{model}",lane="{lane}"}}', values)


def _latency(model: str, per_minute: dict[str, int]) -> list[dict]:
    out, total = [], 0
    for le in ("0.5", "1", "2.5", "+Inf"):
        total += per_minute.get(le, 0)
        out += _replicas(
            f'fleet_job_latency_seconds_bucket{{model="{model}",le="{le}"}}', f"0+{total}x30"
        )
    return out


ALERT_TESTS = [
    # p95 above 1 s: every job of "slow" takes between 1 s and 2.5 s; "fast" under 0.5 s.
    {
        "interval": "1m",
        "input_series": _latency("slow", {"2.5": 10}) + _latency("fast", {"0.5": 10}),
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "FleetJobLatencyP95High", "exp_alerts": []},
            {
                "eval_time": "10m",
                "alertname": "FleetJobLatencyP95High",
                "exp_alerts": [{"exp_labels": {"severity": "critical", "model": "slow"}}],
            },
        ],
    },
    # The interactive backlog of "growing" rises by 5 a minute; "steady" stays at 40 while
    # its batch lane grows (a batch lane may: it is not counted).
    {
        "interval": "1m",
        "input_series": [
            *_backlog("growing", "interactive", "0+5x40", "16x40"),
            *_backlog("growing", "batch", "0x40", "0x40"),
            *_backlog("steady", "interactive", "40x40", "16x40"),
            *_backlog("steady", "batch", "0+500x40", "8x40"),
        ],
        "alert_rule_test": [
            {"eval_time": "8m", "alertname": "FleetBacklogGrowing", "exp_alerts": []},
            {
                "eval_time": "20m",
                "alertname": "FleetBacklogGrowing",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "model": "growing"}}],
            },
        ],
    },
    # The oldest interactive job of "stuck" ages a minute a minute; that of "moving" stays at
    # 20 s while its oldest batch request waits for hours (as a big batch's may).
    {
        "interval": "1m",
        "input_series": [
            *_age("stuck", "interactive", "0+60x20"),
            *_age("stuck", "batch", "0x20"),
            *_age("moving", "interactive", "20x20"),
            *_age("moving", "batch", "7200+60x20"),
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "FleetOldestQueuedJobTooOld", "exp_alerts": []},
            {
                "eval_time": "10m",
                "alertname": "FleetOldestQueuedJobTooOld",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "model": "stuck"}}],
            },
        ],
    },
    # No worker and jobs queued: "down"; batch requests only: "batch-down". No worker,
    # nothing queued: "idle". A worker: "up".
    {
        "interval": "1m",
        "input_series": [
            *_replicas('fleet_workers_ready{model="down"}', "0x20"),
            *_backlog("down", "interactive", "3x20", "0x20"),
            *_backlog("down", "batch", "0x20", "0x20"),
            *_replicas('fleet_workers_ready{model="batch-down"}', "0x20"),
            *_backlog("batch-down", "interactive", "0x20", "0x20"),
            *_backlog("batch-down", "batch", "100x20", "0x20"),
            *_replicas('fleet_workers_ready{model="idle"}', "0x20"),
            *_backlog("idle", "interactive", "0x20", "0x20"),
            *_backlog("idle", "batch", "0x20", "0x20"),
            *_replicas('fleet_workers_ready{model="up"}', "1x20"),
            *_backlog("up", "interactive", "3x20", "2x20"),
            *_backlog("up", "batch", "3x20", "0x20"),
        ],
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "FleetNoWorkerReady", "exp_alerts": []},
            {
                "eval_time": "10m",
                "alertname": "FleetNoWorkerReady",
                "exp_alerts": [
                    {"exp_labels": {"severity": "critical", "model": "down"}},
                    {"exp_labels": {"severity": "critical", "model": "batch-down"}},
                ],
            },
        ],
    },
    # Batch requests wait and none runs: "starved" (the interactive lane takes every worker).
    # "draining" has one batch micro-batch running at times; "idle" has nothing waiting.
    {
        "interval": "1m",
        "input_series": [
            *_backlog("starved", "interactive", "50x60", "16x60"),
            *_backlog("starved", "batch", "1000x60", "0x60"),
            *_backlog("draining", "interactive", "0x60", "0x60"),
            *_backlog("draining", "batch", "5000-50x60", "0 8 0 0 8 0 0 0 8 " * 6 + "0"),
            *_backlog("idle", "interactive", "0x60", "0x60"),
            *_backlog("idle", "batch", "0x60", "0x60"),
        ],
        "alert_rule_test": [
            {"eval_time": "25m", "alertname": "FleetBatchLaneStalled", "exp_alerts": []},
            {
                "eval_time": "40m",
                "alertname": "FleetBatchLaneStalled",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "model": "starved"}}],
            },
        ],
    },
    # 20% of the deliveries that ended failed or were gone (retries do not count).
    {
        "interval": "1m",
        "input_series": [
            {"series": 'fleet_webhook_deliveries_total{outcome="delivered"}', "values": "0+80x30"},
            {"series": 'fleet_webhook_deliveries_total{outcome="retrying"}', "values": "0+50x30"},
            {"series": 'fleet_webhook_deliveries_total{outcome="failed"}', "values": "0+15x30"},
            {"series": 'fleet_webhook_deliveries_total{outcome="gone"}', "values": "0+5x30"},
        ],
        "alert_rule_test": [
            {
                "eval_time": "20m",
                "alertname": "FleetWebhookFailureRateHigh",
                "exp_alerts": [{"exp_labels": {"severity": "warning"}}],
            },
        ],
    },
    # 5% failed, many retries: no alert.
    {
        "interval": "1m",
        "input_series": [
            {"series": 'fleet_webhook_deliveries_total{outcome="delivered"}', "values": "0+95x30"},
            {"series": 'fleet_webhook_deliveries_total{outcome="retrying"}', "values": "0+90x30"},
            {"series": 'fleet_webhook_deliveries_total{outcome="failed"}', "values": "0+5x30"},
        ],
        "alert_rule_test": [
            {"eval_time": "20m", "alertname": "FleetWebhookFailureRateHigh", "exp_alerts": []},
        ],
    },
]


def test_alerts_fire_when_they_should_and_only_then(tmp_path):
    _rules_without_annotations(tmp_path / "rules.yml")
    (tmp_path / "tests.yml").write_text(
        yaml.safe_dump(
            {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": ALERT_TESTS},
            sort_keys=False,
        )
    )
    result = _promtool_run("test", "rules", "tests.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# --- scrape config --------------------------------------------------------------------------


def test_promtool_accepts_the_scrape_config(tmp_path):
    result = _promtool_run("check", "config", PROMETHEUS_CONFIG)
    if result.returncode != 0:
        # Debian's promtool is built without Kubernetes discovery ("Kubernetes support has
        # been completely removed", its NEWS.Debian): that must be its only complaint.
        unknown = set(re.findall(r"field (\w+) not found", result.stdout + result.stderr))
        assert unknown == {"kubernetes_sd_configs"}, result.stdout + result.stderr
    # Everything else, the rule file included, with the Kubernetes discovery left out.
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for job in config["scrape_configs"]:
        job.pop("kubernetes_sd_configs", None)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    for name in config["rule_files"]:
        shutil.copy(MONITORING / name, tmp_path / name)
    result = _promtool_run("check", "config", tmp_path / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert config["rule_files"] == [RULES_FILE.name]


def _scrape_jobs() -> dict[str, dict]:
    return {
        j["job_name"]: j for j in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    }


@pytest.mark.parametrize("app", ["gateway", "worker", "webhooks", "flower"])
def test_kubernetes_jobs_discover_the_pods_by_their_name_label(app):
    job = _scrape_jobs()[app]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": [NAMESPACE]}}]
    keeps = {
        tuple(r["source_labels"]): r["regex"]
        for r in job["relabel_configs"]
        if r.get("action") == "keep"
    }
    assert keeps[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)] == app
    pod_labels = _base("Deployment", app)["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["app.kubernetes.io/name"] == app
    if app == "worker":
        (address,) = [r for r in job["relabel_configs"] if r.get("target_label") == "__address__"]
        assert address["source_labels"] == ["__meta_kubernetes_pod_ip"]
        assert address["replacement"] == "${1}:9400"
    else:
        (container,) = _base("Deployment", app)["spec"]["template"]["spec"]["containers"]
        port_name = keeps[("__meta_kubernetes_pod_container_port_name",)]
        assert port_name in {p["name"] for p in container["ports"]}


def test_local_jobs_scrape_make_up_on_its_default_ports():
    jobs = _scrape_jobs()
    targets = {
        name: [t for c in job["static_configs"] for t in c["targets"]]
        for name, job in jobs.items()
        if "static_configs" in job
    }
    assert targets == {
        "local-gateway": ["127.0.0.1:8000"],
        "local-worker": ["127.0.0.1:9400"],
        "local-webhooks": ["127.0.0.1:9450"],
        "local-flower": ["127.0.0.1:5555"],
    }


# --- dashboard ------------------------------------------------------------------------------


def test_dashboard_has_the_panels():
    assert DASHBOARD_JSON["schemaVersion"] >= 36
    titles = [p["title"] for p in _panels() if p["type"] != "row"]
    assert len(titles) == len(set(titles)), "two panels share a title"
    missing = PANELS - set(titles)
    assert not missing, f"panels missing: {sorted(missing)}"
    ids = [p["id"] for p in _panels()]
    assert len(ids) == len(set(ids)), "two panels share an id"
    for panel in _panels():
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]


def test_dashboard_reads_its_datasource_from_a_variable():
    variables = {v["name"]: v for v in DASHBOARD_JSON["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    datasources = [p["datasource"] for p in _panels() if p["type"] != "row"]
    datasources += [t["datasource"] for p in _panels() for t in p.get("targets", [])]
    datasources += [v["datasource"] for v in variables.values() if "datasource" in v]
    assert datasources
    for datasource in datasources:
        assert datasource == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def test_dashboard_uses_only_the_fleet_metrics():
    used = set()
    for expr in _dashboard_exprs():
        names = metric_names(expr)
        assert names, expr
        unknown = {n for n in names - KNOWN_METRICS if not n.startswith("flower_")}
        assert not unknown, f"unknown metrics {sorted(unknown)} in {expr!r}"
        used |= names
    for variable in DASHBOARD_JSON["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            match = re.fullmatch(r"label_values\((\w+)(\{[^}]*\})?,\s*(\w+)\)", query)
            assert match and match.group(1) in KNOWN_METRICS, query
            used.add(match.group(1))
    histograms_and_series = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    unused = (SERIES | HISTOGRAMS) - histograms_and_series
    assert not unused, f"metrics on no panel: {sorted(unused)}"


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_fleet_wide_series_are_aggregated_with_max_not_sum(source):
    exprs = [r["expr"] for r in _rules()] if source == "rules" else _dashboard_exprs()
    checked = 0
    for expr in exprs:
        s = _without_strings(expr)
        for match in re.finditer(r"(?<![\w:])[A-Za-z_:][\w:]*", s):
            if FLEET_WIDE.match(match.group(0)):
                aggregations = enclosing_aggregations(s, match.start())
                assert aggregations[:1] == ["max"], f"{match.group(0)} not under max in {expr!r}"
                checked += 1
    assert checked


def test_metric_names_parser():
    expr = (
        "histogram_quantile(0.95, max by (model, le) (rate(fleet_job_latency_seconds_bucket"
        '{model=~"$model", le!="x y"}[$__rate_interval]))) > 1 and on (model) '
        "sum by (model) (max by (model, state) (fleet_queue_backlog offset 5m)) > 1e3"
    )
    assert metric_names(expr) == {"fleet_job_latency_seconds_bucket", "fleet_queue_backlog"}
    with pytest.raises(AssertionError, match="unknown PromQL function"):
        metric_names("rat(fleet_queue_backlog[5m])")
    position = expr.index("fleet_queue_backlog")
    assert enclosing_aggregations(expr, position) == ["max", "sum"]
