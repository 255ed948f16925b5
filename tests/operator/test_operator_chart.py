"""The Helm chart renders into valid Kubernetes 1.30 objects, and its dashboards use only real metric names.

Rendering uses the `helm` binary when it is on PATH, else Helm's Go SDK through the `helm-python-sdk` wheel
(a dev dependency); with neither, the rendering tests are skipped with a message saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import kubernetes_validate
import promql_parser
import pytest
import yaml

from tandem.metrics import all_metric_names

CHART = Path(__file__).resolve().parents[2] / "charts" / "tandem"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
# Metrics the dashboards may use that Tandem does not export: kube-state-metrics' Deployment replicas.
EXTERNAL_METRICS = {"kube_deployment_status_replicas_ready", "kube_deployment_spec_replicas"}
# Kinds with no schema in kubernetes-validate (they come from CRDs): checked by hand below.
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "KopfPeering", "ClusterKopfPeering"}


def _helm_renderer():
    if shutil.which("helm"):
        def render(values: dict) -> str:
            with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
                yaml.safe_dump(values, f)
                f.flush()
                done = subprocess.run(["helm", "template", "tandem", str(CHART), "--namespace", "tandem-system",
                                       "-f", f.name], capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(done.stderr)  # what helm says, e.g. a template's `fail` message
                return done.stdout
        return render
    try:
        import helm_python
    except ImportError:
        return None

    def render(values: dict) -> str:
        with helm_python.Chart.load(str(CHART)) as chart:
            files = chart.render(values, name="tandem", namespace="tandem-system")
        return "\n---\n".join(text for name, text in sorted(files.items()) if name.endswith(".yaml"))
    return render


RENDER = _helm_renderer()
needs_helm = pytest.mark.skipif(RENDER is None, reason="chart rendering needs the `helm` binary on PATH or the "
                                                       "helm-python-sdk package (pip install -e '.[dev]')")

VALUE_SETS = {
    "defaults": {},
    "one-namespace-ha": {"operator": {"watchNamespace": "llm", "replicas": 2},
                         "networkPolicy": {"namespaces": ["llm"],
                                           "metricsNamespaceSelector": {"matchLabels": {"team": "monitoring"}}}},
    "monitoring": {"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                                  "podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
                   "networkPolicy": {"metricsNamespaceSelector": {"matchLabels": {
                       "kubernetes.io/metadata.name": "monitoring"}}},
                   "dashboards": {"annotations": {"grafana_folder": "Tandem"}}},
}


def _objects(values: dict) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(RENDER(values)) if doc]


@needs_helm
@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_chart_renders_valid_kubernetes_objects(values):
    objects = _objects(VALUE_SETS[values])
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "ServiceAccount", "NetworkPolicy", "ConfigMap"} <= kinds
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            assert obj["apiVersion"] in ("monitoring.coreos.com/v1", "kopf.dev/v1") and obj["metadata"]["name"]
            continue
        kubernetes_validate.validate(obj, "1.30", strict=True)


@needs_helm
def test_helm_lint_finds_no_errors():
    if shutil.which("helm"):
        done = subprocess.run(["helm", "lint", str(CHART)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    else:
        import helm_python

        assert helm_python.lint(str(CHART))["errors"] == []


@needs_helm
def test_operator_pod_is_non_root_read_only_and_watches_as_configured():
    deployment = next(o for o in _objects({}) if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["args"][:2] == ["operator", "--all-namespaces"]
    assert not any(a.startswith("--peering") for a in container["args"])

    ha = next(o for o in _objects(VALUE_SETS["one-namespace-ha"]) if o["kind"] == "Deployment")
    args = ha["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=llm" in args and "--peering=tandem-operator" in args and ha["spec"]["replicas"] == 2


@needs_helm
def test_rbac_is_least_privilege():
    for values, kind in (({}, "ClusterRole"), (VALUE_SETS["one-namespace-ha"], "Role")):
        roles = [o for o in _objects(values) if o["kind"] == kind]
        rules = [rule for role in roles for rule in role["rules"]]
        assert rules
        for rule in rules:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
            assert "delete" not in rule["verbs"] and "deletecollection" not in rule["verbs"]
        granted = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
        assert ("serving.tandem.dev", "llmdeployments/status") in granted
        # Owner references with blockOwnerDeletion need it where OwnerReferencesPermissionEnforcement runs.
        assert ("serving.tandem.dev", "llmdeployments/finalizers") in granted
        assert ("discovery.k8s.io", "endpointslices") in granted  # needed to grant it to the routers
        # The internal-endpoint token's Secret is created once and never changed (patch: an orphaned one is adopted
        # back); list and watch: one deleted is put back at once (operator_settings has the API server send only
        # the operator's own). Never update or delete.
        secret_verbs = {v for rule in rules if "secrets" in rule["resources"] for v in rule["verbs"]}
        assert secret_verbs == {"get", "list", "watch", "create", "patch"}
    namespaced = [o for o in _objects(VALUE_SETS["one-namespace-ha"]) if o["kind"] in ("Role", "RoleBinding")]
    assert {o["metadata"]["namespace"] for o in namespaced} == {"llm"}


@needs_helm
def test_network_policy_admits_only_tandem_routers_workers_and_the_operators_scrapes():
    policy = next(o for o in _objects({}) if o["kind"] == "NetworkPolicy")
    selected = {e["key"]: e["values"] for e in policy["spec"]["podSelector"]["matchExpressions"]}
    assert selected["app.kubernetes.io/component"] == ["prefill", "decode"]
    tandem, operator = policy["spec"]["ingress"]
    (peer,) = tandem["from"]
    allowed = {e["key"]: e["values"] for e in peer["podSelector"]["matchExpressions"]}
    assert allowed == {"app.kubernetes.io/name": ["tandem"], "app.kubernetes.io/component": ["router", "prefill", "decode"]}
    # The planner scrapes the workers' /metrics from the operator pod: without this rule it read nothing and
    # sized the pools for no load.
    (scraper,) = operator["from"]
    operator_pod = next(o for o in _objects({}) if o["kind"] == "Deployment")
    assert scraper["podSelector"]["matchLabels"].items() <= operator_pod["spec"]["template"]["metadata"]["labels"].items()
    assert scraper["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": operator_pod["metadata"]["namespace"]}
    assert operator["ports"] == [{"port": "http", "protocol": "TCP"}]


@needs_helm
def test_the_network_policy_goes_where_the_operator_watches():
    """An operator watching one namespace serves LLMDeployments there, not in the release's namespace: a policy
    left in the release's would protect nothing."""
    policies = [o for o in _objects({"operator": {"watchNamespace": "llm"}}) if o["kind"] == "NetworkPolicy"]
    assert [p["metadata"]["namespace"] for p in policies] == ["llm"]
    listed = [o for o in _objects({"operator": {"watchNamespace": "llm"}, "networkPolicy": {"namespaces": ["a", "b"]}})
              if o["kind"] == "NetworkPolicy"]
    assert sorted(p["metadata"]["namespace"] for p in listed) == ["a", "b"]


@needs_helm
@pytest.mark.parametrize("monitor", ["serviceMonitor", "podMonitor"])
def test_monitoring_without_a_way_through_the_network_policy_is_refused(monitor):
    """Prometheus scrapes the workers across the NetworkPolicy only from metricsNamespaceSelector's namespaces:
    with monitoring on and no selector, every worker panel would stay empty. The chart says so instead."""
    with pytest.raises(Exception, match="metricsNamespaceSelector"):
        RENDER({"monitoring": {monitor: {"enabled": True}}})
    assert _objects({"monitoring": {monitor: {"enabled": True}}, "networkPolicy": {"enabled": False}})


@needs_helm
def test_dashboards_ship_as_configmaps_for_the_grafana_sidecar():
    maps = [o for o in _objects(VALUE_SETS["monitoring"]) if o["kind"] == "ConfigMap"]
    shipped = {}
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["annotations"] == {"grafana_folder": "Tandem"}
        shipped.update(config_map["data"])
    assert set(shipped) == {p.name for p in DASHBOARDS}
    for path in DASHBOARDS:
        assert json.loads(shipped[path.name]) == json.loads(path.read_text())


# -- dashboards ------------------------------------------------------------------------------------------

# Grafana variables, replaced by values of the same kind before parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$model": ".*", "$slo_class": "interactive",
                     "$namespace": ".*", "$ttft_slo": "1", "$itl_slo": "0.1"}


def dashboard_expressions(path: Path) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel, Grafana variables substituted."""
    dashboard = json.loads(path.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{path.name} / {panel['title']}: unknown variable in {expr}"
            found.append((panel["title"], expr))
    return found


def metric_names(expr: str) -> set[str]:
    names = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            names.update(m.value for m in node.matchers.matchers if m.name == "__name__")

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_every_dashboard_expression_parses_and_names_only_known_metrics():
    known = all_metric_names() | EXTERNAL_METRICS
    assert len(DASHBOARDS) == 4
    for path in DASHBOARDS:
        expressions = dashboard_expressions(path)
        assert expressions, path.name
        for title, expr in expressions:
            names = metric_names(expr)  # raises ValueError on a PromQL syntax error
            # Only the SLO reference lines are constants (vector(<target>)); every other query reads a metric.
            assert names or re.fullmatch(r"vector\([0-9.]+\)", expr), f"{path.name} / {title}: no metric in {expr}"
            assert names <= known, f"{path.name} / {title}: unknown metrics {sorted(names - known)}"


def test_the_overview_draws_the_default_slo_class_targets_and_lets_them_be_changed():
    """The SLO lines start at the router's default class's targets, and are textboxes a user can set to their own
    class's (a constant is hidden in Grafana's UI)."""
    from tandem.router.admission.slo import DEFAULT_SLO_CLASSES

    default = DEFAULT_SLO_CLASSES["interactive"]
    variables = {v["name"]: v for v in json.loads((CHART / "dashboards" / "tandem-overview.json").read_text())
                 ["templating"]["list"]}
    for name, target in (("ttft_slo", default.ttft_s), ("itl_slo", default.itl_s)):
        assert variables[name]["type"] == "textbox" and variables[name]["hide"] == 0
        assert float(variables[name]["query"]) == float(variables[name]["current"]["value"]) == target


def test_the_name_check_catches_a_typo():
    assert metric_names('sum(rate(tandem_router_request_total{model=~".*"}[1m]))') == {"tandem_router_request_total"}
    assert "tandem_router_request_total" not in all_metric_names()
    with pytest.raises(ValueError):
        metric_names("sum(rate(tandem_router_requests_total[1m])")


REQUIRED = {  # dashboard -> metrics its panels must show (the list)
    "tandem-overview.json": {"tandem_router_requests_total", "tandem_router_goodput_requests_total",
                             "tandem_router_time_to_first_token_seconds_bucket",
                             "tandem_router_inter_token_latency_seconds_bucket", "tandem_router_rejections_total"},
    "tandem-pools.json": {"tandem_kv_blocks_used", "tandem_num_requests_running", "tandem_num_requests_waiting",
                          "tandem_prefix_cache_hit_tokens_total", "tandem_preemptions_total",
                          "tandem_generation_tokens_total", "tandem_prompt_tokens_total"},
    "tandem-kv-transfer.json": {"tandem_kv_transfer_seconds_bucket", "tandem_kv_transfer_bytes_total",
                                "tandem_kv_transfer_fallbacks_total"},
    "tandem-scaling.json": {"kube_deployment_status_replicas_ready", "kube_deployment_spec_replicas"},
}


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_dashboards_cover_what_operators_watch(name):
    used = set().union(*(metric_names(e) for _, e in dashboard_expressions(CHART / "dashboards" / name)))
    assert REQUIRED[name] <= used
    quantiles = [e for _, e in dashboard_expressions(CHART / "dashboards" / name) if "histogram_quantile" in e]
    assert all(re.search(r"histogram_quantile\(0\.(5|99), sum by \(le", e) for e in quantiles)


@needs_helm
def test_alerts_name_only_exported_metrics_and_pass_promtool(tmp_path):
    """The optional PrometheusRule: each alert's expression parses, names only metrics Tandem exports, and the
    group passes promtool's rule check (when promtool is installed)."""
    (rule,) = [o for o in _objects(VALUE_SETS["monitoring"]) if o["kind"] == "PrometheusRule"]
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert {"TandemNoWorkers", "TandemWorkerOutOfRotation", "TandemGoodputLow", "TandemRefusingForCapacity",
            "TandemKVTransferFallbacks"} <= set(alerts)
    known = all_metric_names()
    for name, alert in alerts.items():
        assert metric_names(alert["expr"]) <= known, name
        assert alert["labels"]["severity"] in ("critical", "warning", "info") and alert["annotations"]["summary"]
    assert not [o for o in _objects({}) if o["kind"] == "PrometheusRule"]  # off unless asked for
    if shutil.which("promtool"):
        rules_file = tmp_path / "rules.yaml"
        rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        done = subprocess.run(["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
