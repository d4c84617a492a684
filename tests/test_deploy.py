"""deploy/ agrees with what Tandem exports and serves.

Every PromQL expression in the Grafana dashboard, the alert rules and the
prometheus-adapter rules may name only series that the router's ``/metrics``
exposes: the set is read from a real :class:`tandem.router.metrics.Metrics`
exposition, so renaming a metric without updating deploy/ fails here. The
Kubernetes and Ray files are checked for what an operator would otherwise find
out at 3 a.m.: ports, probes, the HPA's metric, worker resources, and that each
``tandem serve`` command line is accepted by the real CLI.

With promtool on PATH (Debian package ``prometheus``) the alert rules' unit
tests (deploy/prometheus/alerts_test.yml) run too, and every dashboard query is
parsed as PromQL.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from tandem.router.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tandem-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ADAPTER = DEPLOY / "kubernetes" / "prometheus-adapter-values.yaml"
RAY_CLUSTER = DEPLOY / "ray" / "cluster.yaml"
GRPC_PORT, METRICS_PORT = 50051, 9400

# Wider than the metric names need ([a-z_:]) so that a typo with a digit or a
# capital is caught as a (wrong) name rather than cut short into a right one.
METRIC_TOKEN = re.compile(r"tandem:[A-Za-z0-9_:]+")
# Labels that come from the scrape (job, instance), the Kubernetes relabelling
# (namespace, pod, app), a static target's labels (deployment), or histograms (le).
SCRAPE_LABELS = {"job", "instance", "namespace", "pod", "app", "deployment", "le"}


# -- what the router exports ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported() -> tuple[set[str], set[str], set[str]]:
    """``(series names, family names, label names)`` in the router's exposition.

    Every metric gets one value with made-up labels first: a labelled metric
    with no children exposes nothing, and histograms only show ``_bucket``,
    ``_sum`` and ``_count`` once observed.
    """
    metrics = Metrics("m")
    wrappers = [v for v in vars(metrics).values() if isinstance(v, (Counter, Gauge, Histogram))]
    for metric in wrappers:
        # prometheus_client has no public accessor for a metric's label names.
        child = metric.labels(*["x"] * len(metric._labelnames))
        if isinstance(metric, Counter):
            child.inc()
        elif isinstance(metric, Gauge):
            child.set(1)
        else:
            child.observe(0.5)
    families = list(text_string_to_metric_families(metrics.render().decode()))
    registered = {f.name for f in metrics.registry.collect()}
    # (The text format also lists each counter's and histogram's `_created` as a family.)
    assert registered <= {f.name for f in families if f.samples}, "a metric was not exercised"
    series = {s.name for f in families for s in f.samples}
    labels = {k for f in families for s in f.samples for k in s.labels} - {"le"}
    return series, registered, labels


def test_exposition_names_have_prometheus_suffixes(exported):
    series, _, _ = exported
    assert "tandem:generation_tokens_total" in series            # counter
    assert "tandem:generation_tokens" not in series
    assert "tandem:kv_cache_usage_perc" in series                # gauge
    assert {"tandem:time_to_first_token_seconds_bucket", "tandem:time_to_first_token_seconds_sum",
            "tandem:time_to_first_token_seconds_count"} <= series  # histogram
    assert "tandem:time_to_first_token_seconds" not in series


# -- reading expressions out of the files ---------------------------------------------------------

def load_yaml_docs(path: Path) -> list:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, including those inside collapsed rows."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_exprs(dashboard: dict) -> dict[str, str]:
    exprs = {}
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            exprs[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if var.get("type") == "query":
            exprs[f"variable {var['name']}"] = query["query"] if isinstance(query, dict) else query
    return exprs


def alert_exprs(rules: dict) -> dict[str, str]:
    return {f"alert {r['alert']}": r["expr"] for g in rules["groups"] for r in g["rules"]}


def adapter_exprs(values: dict) -> dict[str, str]:
    exprs = {}
    for i, rule in enumerate(values["rules"]["custom"]):
        for key in ("seriesQuery", "metricsQuery"):
            exprs[f"adapter rule {i} {key}"] = rule[key]
        exprs[f"adapter rule {i} name.matches"] = rule["name"]["matches"]
    return exprs


def unknown_metrics(exprs: dict[str, str], series: set[str]) -> dict[str, list[str]]:
    """``{where: [names not exported]}`` for every expression naming one."""
    bad = {}
    for where, expr in exprs.items():
        missing = sorted(set(METRIC_TOKEN.findall(expr)) - series)
        if missing:
            bad[where] = missing
    return bad


def used_labels(expr: str) -> set[str]:
    """Label names in ``by/without/on/ignoring (...)`` clauses and ``{...}`` matchers."""
    names = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        names.update(n.strip() for n in group.split(",") if n.strip())
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        names.update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    return names


def serve_command(script: str) -> list[str]:
    """The arguments of the ``tandem serve`` in a shell script (line continuations
    joined; stops at the end of the line or at a redirection / control operator)."""
    line = script.replace("\\\n", " ")
    line = line[line.index("tandem serve"):].split("\n")[0]
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = []
    for token in lexer:
        if set(token) <= set("();<>|&"):
            break
        tokens.append(token)
    assert tokens[:2] == ["tandem", "serve"], tokens
    return tokens[2:]


def parse_serve(argv: list[str], monkeypatch):
    """The :class:`ServeConfig` the real ``tandem`` CLI builds from ``serve argv``."""
    from tandem.router import cli

    seen = []

    def capture(args) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(cli, "_cmd_serve", capture)
    assert cli.main(["serve", *argv]) == 0
    return cli._serve_config(seen[0])


@pytest.fixture(scope="module")
def dashboard() -> dict:
    with DASHBOARD.open() as f:
        return json.load(f)


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    objs = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        if path == ADAPTER:
            continue    # Helm values, not a Kubernetes object
        for doc in load_yaml_docs(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objs, f"{key} defined twice"
            objs[key] = doc
    return objs


# -- every file parses ----------------------------------------------------------------------------

DEPLOY_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml", ".json"))


def test_deploy_has_the_expected_files():
    names = {str(p.relative_to(DEPLOY)) for p in DEPLOY_FILES}
    assert {"prometheus/prometheus.yml", "prometheus/alerts.yml", "grafana/tandem-dashboard.json",
            "ray/cluster.yaml", "kubernetes/raycluster.yaml", "kubernetes/router.yaml",
            "kubernetes/autoscaling.yaml", "kubernetes/prometheus-adapter-values.yaml",
            "kubernetes/control.yaml", "kubernetes/redis.yaml", "kubernetes/keda.yaml",
            "kubernetes/crds/keda.sh_scaledobjects.yaml"} <= names
    assert (DEPLOY / "README.md").is_file()


@pytest.mark.parametrize("path", DEPLOY_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_file_parses(path):
    if path.suffix == ".json":
        with path.open() as f:
            assert isinstance(json.load(f), dict)
    else:
        docs = load_yaml_docs(path)
        assert docs and all(isinstance(d, dict) for d in docs)


# -- metric names ---------------------------------------------------------------------------------

def test_dashboard_queries_name_only_exported_metrics(dashboard, exported):
    series, _, _ = exported
    exprs = dashboard_exprs(dashboard)
    assert len(exprs) > 20
    assert unknown_metrics(exprs, series) == {}


def test_alert_rules_name_only_exported_metrics(exported):
    series, _, _ = exported
    (rules,) = load_yaml_docs(ALERTS)
    assert unknown_metrics(alert_exprs(rules), series) == {}


def test_adapter_rules_name_only_exported_metrics(exported):
    series, _, _ = exported
    (values,) = load_yaml_docs(ADAPTER)
    exprs = adapter_exprs(values)
    assert exprs and unknown_metrics(exprs, series) == {}


def test_checker_catches_a_misspelt_metric(dashboard, exported):
    """The checks above can fail: a renamed metric in the dashboard is reported."""
    series, _, _ = exported
    broken = json.loads(json.dumps(dashboard).replace("tandem:kv_cache_usage_perc{",
                                                      "tandem:kv_cache_usage_percent{"))
    bad = unknown_metrics(dashboard_exprs(broken), series)
    assert bad["panel 'KV cache usage' A"] == ["tandem:kv_cache_usage_percent"]
    # A counter without its exposition suffix is wrong too.
    assert unknown_metrics({"q": "rate(tandem:generation_tokens[5m])"}, series) == {
        "q": ["tandem:generation_tokens"]}


def test_queries_use_only_exported_labels(dashboard, exported):
    _, _, labels = exported
    (rules,) = load_yaml_docs(ALERTS)
    exprs = {**dashboard_exprs(dashboard), **alert_exprs(rules)}
    bad = {w: sorted(used_labels(e) - labels - SCRAPE_LABELS) for w, e in exprs.items()}
    assert {w: v for w, v in bad.items() if v} == {}
    legends = {f"panel {p['title']!r} {t['refId']}": set(re.findall(r"\{\{\s*(\w+)\s*\}\}",
                                                                     t.get("legendFormat", "")))
               for p in dashboard_panels(dashboard) for t in p.get("targets", [])}
    assert {w: v - labels - SCRAPE_LABELS for w, v in legends.items() if v - labels - SCRAPE_LABELS} == {}


def calls(expr: str, function: str) -> list[str]:
    """The argument text of every call of ``function`` in ``expr`` (balanced parentheses)."""
    out = []
    for match in re.finditer(re.escape(function) + r"\s*\(", expr):
        depth, start = 1, match.end()
        for i in range(start, len(expr)):
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            if depth == 0:
                out.append(expr[start:i])
                break
    return out


def test_quantiles_are_taken_over_bucket_rates(dashboard):
    (rules,) = load_yaml_docs(ALERTS)
    exprs = {**dashboard_exprs(dashboard), **alert_exprs(rules)}
    quantile_calls = {w: calls(e, "histogram_quantile") for w, e in exprs.items()}
    assert sum(map(len, quantile_calls.values())) >= 20
    for where, args in quantile_calls.items():
        for arg in args:
            names = METRIC_TOKEN.findall(arg)
            assert names and all(n.endswith("_bucket") for n in names), where
            assert "le" in used_labels(arg), f"{where}: the aggregation must keep `le`"
            assert calls(arg, "rate"), f"{where}: a quantile needs the buckets' rate, not their totals"


# -- Grafana dashboard ----------------------------------------------------------------------------

def test_dashboard_structure(dashboard):
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["model_name"]["type"] == "query"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dashboard_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            # Every query filters on the model_name variable, or the selector is decoration.
            assert 'model_name=~"$model_name"' in target["expr"], (panel["title"], target["expr"])


def test_dashboard_covers_every_exported_metric(dashboard, exported):
    """A metric added to router/metrics.py needs a panel (or this list of exceptions)."""
    _, families, _ = exported
    tokens = {t for e in dashboard_exprs(dashboard).values() for t in METRIC_TOKEN.findall(e)}
    shown = tokens | {t.removesuffix(suffix) for t in tokens
                      for suffix in ("_total", "_bucket", "_sum", "_count")}
    assert families - shown == set()


# -- Prometheus -----------------------------------------------------------------------------------

def test_prometheus_scrapes_the_router_metrics_port():
    (config,) = load_yaml_docs(PROMETHEUS)
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    static = jobs["tandem-router"]
    assert static["metrics_path"] == "/metrics"
    targets = [t for sc in static["static_configs"] for t in sc["targets"]]
    assert targets and all(t.endswith(f":{METRICS_PORT}") for t in targets)
    k8s_job = jobs["tandem-router-k8s"]
    assert k8s_job["kubernetes_sd_configs"] == [{"role": "pod"}]
    relabel = k8s_job["relabel_configs"]
    assert any(r.get("action") == "keep" and r["source_labels"] ==
               ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"] for r in relabel)
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS.parent / rule_file).is_file()
    # Both job names must match the alerts' up{job=~"tandem-router.*"}.
    assert all(name.startswith("tandem-router") for name in jobs)


def test_adapter_maps_series_to_pods_with_labels_prometheus_adds():
    (config,) = load_yaml_docs(PROMETHEUS)
    k8s_job = next(j for j in config["scrape_configs"] if j["job_name"] == "tandem-router-k8s")
    added = {r["target_label"] for r in k8s_job["relabel_configs"] if "target_label" in r}
    (values,) = load_yaml_docs(ADAPTER)
    for rule in values["rules"]["custom"]:
        overrides = rule["resources"]["overrides"]
        assert {overrides[label]["resource"] for label in overrides} == {"namespace", "pod"}
        assert set(overrides) <= added


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_alert_rules_pass_promtool_unit_tests():
    result = _promtool("test", "rules", "alerts_test.yml", cwd=ALERTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_dashboard_queries_are_valid_promql(dashboard, tmp_path):
    # promtool parses recording rules' expressions; Grafana's variables get
    # values first, as Grafana would substitute them.
    exprs = dashboard_exprs(dashboard)
    rules = [{"record": f"check:q{i}", "expr": e.replace("$__rate_interval", "1m")
              .replace("$model_name", "m")}
             for i, (w, e) in enumerate(exprs.items()) if not w.startswith("variable")]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _promtool("check", "rules", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# -- Kubernetes -----------------------------------------------------------------------------------

def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _port(container: dict, port) -> int:
    """A probe's or Service's port (name or number) as a number."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_router_deployment_ports_and_probes(k8s):
    router = k8s[("Deployment", "tandem-router")]
    pod = router["spec"]["template"]
    container = _container(router)
    assert {(p["name"], p["containerPort"]) for p in container["ports"]} >= {
        ("grpc", GRPC_PORT), ("metrics", METRICS_PORT)}
    for probe in ("readinessProbe", "livenessProbe"):
        http = container[probe]["httpGet"]
        assert http["path"] == "/health", probe
        assert _port(container, http["port"]) == METRICS_PORT, probe
    grpc_probes = [container[p]["grpc"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
                   if "grpc" in container.get(p, {})]
    assert grpc_probes and all(g["port"] == GRPC_PORT for g in grpc_probes)
    # The service name the router registers with grpc.health.v1 (router/launcher.py).
    assert all(g.get("service", "") in ("", "tandem.v1.Tandem") for g in grpc_probes)
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert "replicas" not in router["spec"], "the HPA owns the replica count"


def _script(deployment: dict) -> str:
    container = _container(deployment)
    return " ".join(container.get("command", []) + container.get("args", []))


def parse_router(script: str, monkeypatch):
    """The argparse namespace the real ``tandem`` CLI builds from the ``tandem router``
    line of ``script``."""
    from tandem.router import cli

    line = script.replace("\\\n", " ")
    line = line[line.index("tandem router"):].split("\n")[0]
    seen = []
    monkeypatch.setattr(cli, "_cmd_router", lambda args: seen.append(args) or 0)
    assert cli.main(shlex.split(line)[1:]) == 0
    return seen[0]


def test_router_command_is_accepted_by_the_cli(k8s, monkeypatch):
    router = k8s[("Deployment", "tandem-router")]
    script = _script(router)
    args = parse_router(script, monkeypatch)
    assert (args.host, args.port, args.metrics_port) == ("0.0.0.0", GRPC_PORT, METRICS_PORT)
    assert args.ray_address == "auto"
    assert args.redis_url == _redis_url(k8s)
    # The router pod joins the RayCluster through its head Service.
    (ray_cluster,) = [o for (kind, _), o in k8s.items() if kind == "RayCluster"]
    env = {e["name"]: e.get("value") for e in _container(router)["env"]}
    assert env["RAY_HEAD_ADDRESS"] == f"{ray_cluster['metadata']['name']}-head-svc:6379"
    assert "ray start" in script and '--address="${RAY_HEAD_ADDRESS}"' in script


def _redis_url(k8s) -> str:
    service = k8s[("Service", "tandem-redis")]
    (port,) = service["spec"]["ports"]
    redis = k8s[("Deployment", "tandem-redis")]
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    return f"redis://{service['metadata']['name']}:{port['port']}/0"


def test_control_pod_runs_the_planner_within_the_worker_groups(k8s, monkeypatch):
    control = k8s[("Deployment", "tandem-control")]
    assert control["spec"]["replicas"] == 1 and control["spec"]["strategy"]["type"] == "Recreate"
    cfg = parse_serve(serve_command(_script(control)), monkeypatch)
    assert cfg.redis_url == _redis_url(k8s) and cfg.ray_address == "auto"
    assert cfg.autoscale is not None and cfg.autoscale.mode == "slo"
    assert cfg.autoscale.prefill_capacity_tok_s and cfg.autoscale.decode_capacity_tok_s
    (cluster,) = [o for (kind, _), o in k8s.items() if kind == "RayCluster"]
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    for pool in ("prefill", "decode"):
        (group,) = [g for g in groups.values() if _ray_resources(g).get(pool) == 1]
        lo, hi = cfg.autoscale.bounds(pool)
        # Pods the autoscaler may add cover the workers the planner may ask for.
        assert group["minReplicas"] <= lo and hi <= group["maxReplicas"], pool
    assert cfg.engine.device == "cuda" and cfg.kv_transport == "nccl"


def test_router_services_select_the_router_pods(k8s):
    router = k8s[("Deployment", "tandem-router")]
    pod_labels = router["spec"]["template"]["metadata"]["labels"]
    assert router["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container = _container(router)
    service = k8s[("Service", "tandem-router")]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["port"]: _port(container, p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {GRPC_PORT: GRPC_PORT, METRICS_PORT: METRICS_PORT}
    headless = k8s[("Service", "tandem-router-headless")]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= pod_labels.items()


def test_hpa_scales_the_router_on_an_exported_metric(k8s, exported):
    series, _, _ = exported
    hpa = k8s[("HorizontalPodAutoscaler", "tandem-router")]
    target = hpa["spec"]["scaleTargetRef"]
    assert ("Deployment", target["name"]) in k8s and target["kind"] == "Deployment"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (values,) = load_yaml_docs(ADAPTER)
    rules = {r["name"]["as"]: r for r in values["rules"]["custom"]}
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert names
    for name in names:
        assert name in rules, f"no prometheus-adapter rule serves {name}"
        source = METRIC_TOKEN.findall(rules[name]["seriesQuery"])
        assert source and set(source) <= series
    # The router's own load, not its workers' (every router sees every worker).
    assert [METRIC_TOKEN.findall(rules[n]["seriesQuery"]) for n in names] == [
        ["tandem:router_active_requests"]]


def test_keda_scales_the_router_like_the_hpa(k8s, exported):
    series, _, _ = exported
    scaled = k8s[("ScaledObject", "tandem-router")]
    hpa = k8s[("HorizontalPodAutoscaler", "tandem-router")]
    assert scaled["spec"]["scaleTargetRef"]["name"] == hpa["spec"]["scaleTargetRef"]["name"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (
        hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert METRIC_TOKEN.findall(trigger["metadata"]["query"]) == ["tandem:router_active_requests"]
    assert set(METRIC_TOKEN.findall(trigger["metadata"]["query"])) <= series
    assert float(trigger["metadata"]["threshold"]) == float(
        hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"])


# -- schemas: core kinds, KEDA's CRD, KubeRay's pod templates, Ray's own config check -----------

CRDS = DEPLOY / "kubernetes" / "crds"
K8S_VERSION = "1.31"


def closed(schema):
    """A CRD's structural schema as the API server's strict field validation applies
    it (kubectl's default): an object with ``properties`` and neither
    ``additionalProperties`` nor ``x-kubernetes-preserve-unknown-fields`` refuses
    unknown fields."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    return schema


def crd_validator(path, version):
    jsonschema = pytest.importorskip("jsonschema")
    (crd,) = load_yaml_docs(path)
    assert crd["kind"] == "CustomResourceDefinition"
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = closed(v["schema"]["openAPIV3Schema"])
    return crd, jsonschema.Draft7Validator(schema, format_checker=jsonschema.FormatChecker())


def _errors(validator, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_keda_scaledobject_matches_its_crd(k8s):
    scaled = k8s[("ScaledObject", "tandem-router")]
    group, version = scaled["apiVersion"].split("/")
    crd, validator = crd_validator(CRDS / "keda.sh_scaledobjects.yaml", version)
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == scaled["kind"]
    assert _errors(validator, scaled) == []
    # The check is not vacuous: a misspelt field and a wrong type are refused.
    bad = json.loads(json.dumps(scaled))
    bad["spec"]["minReplicas"] = 1
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 64
    errors = _errors(validator, bad)
    assert any("minReplicas" in e for e in errors) and any("threshold" in e for e in errors)


def test_core_kinds_match_the_kubernetes_schemas(k8s):
    kv = pytest.importorskip("kubernetes_validate")
    core = [d for d in k8s.values() if "/" not in d["apiVersion"] or
            d["apiVersion"].split("/")[0] in ("apps", "autoscaling", "batch", "policy")]
    assert {d["kind"] for d in core} >= {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for doc in core:
        kv.validate(doc, K8S_VERSION, strict=True)
    bad = json.loads(json.dumps(k8s[("Deployment", "tandem-router")]))
    _container(bad)["imagePullPolicy "] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def _open_paths(schema, doc, path=()):
    """Where ``doc`` reaches a schema node that accepts any fields
    (``x-kubernetes-preserve-unknown-fields``): yields each such path."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        yield path
    elif isinstance(doc, dict) and "properties" in schema:
        for key, value in doc.items():
            if key in schema["properties"]:
                yield from _open_paths(schema["properties"][key], value, (*path, key))
    elif isinstance(doc, list) and "items" in schema:
        for i, value in enumerate(doc):
            yield from _open_paths(schema["items"], value, (*path, i))


def test_raycluster_matches_its_crd(k8s):
    """KubeRay's own fields against the RayCluster CRD's openAPIV3Schema; the core
    schemas it inlines (left open in the vendored CRD) are checked next, against the
    core schema itself."""
    (cluster,) = [o for (kind, _), o in k8s.items() if kind == "RayCluster"]
    group, version = cluster["apiVersion"].split("/")
    crd, validator = crd_validator(CRDS / "ray.io_rayclusters.yaml", version)
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == cluster["kind"]
    assert _errors(validator, cluster) == []
    # The check is not vacuous: a misspelt field, a wrong type, a value outside an
    # enum, a non-string ray start parameter and a missing required field are refused.
    bad = json.loads(json.dumps(cluster))
    bad["spec"]["workerGroupSpecs"][0]["maxReplica"] = 4
    bad["spec"]["workerGroupSpecs"][1]["replicas"] = "1"
    bad["spec"]["autoscalerOptions"]["upscalingMode"] = "Fast"
    bad["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    del bad["spec"]["workerGroupSpecs"][1]["minReplicas"]
    errors = _errors(validator, bad)
    for needle in ("workerGroupSpecs/0: Additional properties", "workerGroupSpecs/1/replicas",
                   "upscalingMode", "rayStartParams/num-cpus",
                   "workerGroupSpecs/1: 'minReplicas' is a required property"):
        assert any(needle in e for e in errors), (needle, errors)
    assert len(errors) == 5
    # Only the pod templates fall into the CRD's open (core) parts.
    opened = set(_open_paths(validator.schema, cluster))
    assert opened == {("spec", "headGroupSpec", "template"),
                      *(("spec", "workerGroupSpecs", i, "template")
                        for i in range(len(cluster["spec"]["workerGroupSpecs"])))}


def test_raycluster_pod_templates_match_the_kubernetes_schema(k8s):
    """KubeRay embeds core PodTemplateSpecs: each is checked as a PodTemplate."""
    kv = pytest.importorskip("kubernetes_validate")
    (cluster,) = [o for (kind, _), o in k8s.items() if kind == "RayCluster"]
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for g in groups:
        kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                     "template": g["template"]}, K8S_VERSION, strict=True)
    bad = json.loads(json.dumps(groups[1]["template"]))
    bad["spec"]["containers"][0]["resource"] = bad["spec"]["containers"][0].pop("resources")
    with pytest.raises(kv.ValidationError):
        kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                     "template": bad}, K8S_VERSION, strict=True)


def _ray_resources(group: dict) -> dict:
    # KubeRay wants the JSON quoted once more for `ray start --resources`.
    return json.loads(json.loads(group["rayStartParams"]["resources"]))


def test_raycluster_has_gpu_prefill_and_decode_groups(k8s):
    (cluster,) = [o for (kind, _), o in k8s.items() if kind == "RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    for role in ("prefill", "decode"):
        matching = [g for g in groups.values() if _ray_resources(g).get(role) == 1]
        assert len(matching) == 1, role
        group = matching[0]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (container,) = group["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1, role
    # Ray refuses nodes of another Ray/Python version: one image everywhere.
    images = {c["image"] for g in [cluster["spec"]["headGroupSpec"], *groups.values()]
              for c in g["template"]["spec"]["containers"]}
    images.add(_container(k8s[("Deployment", "tandem-router")])["image"])
    assert len(images) == 1


# -- Ray cluster launcher -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster() -> dict:
    (config,) = load_yaml_docs(RAY_CLUSTER)
    return config


def test_ray_cluster_config_passes_rays_own_checks(ray_cluster):
    """What `ray up` runs on the file: prepare_config (defaults, node type bounds)
    then validate_config (ray-schema.json and its extra checks)."""
    pytest.importorskip("jsonschema")
    util = pytest.importorskip("ray.autoscaler._private.util")
    prepared = util.prepare_config(json.loads(json.dumps(ray_cluster)))
    util.validate_config(prepared)
    bad = json.loads(json.dumps(ray_cluster))
    bad["available_node_types"]["decode_gpu"]["max_worker"] = 4
    with pytest.raises(Exception, match="max_worker"):
        util.validate_config(util.prepare_config(bad))


def test_ray_cluster_planner_fits_the_node_types(ray_cluster, monkeypatch):
    cfg = parse_serve(serve_command("\n".join(ray_cluster["head_start_ray_commands"])),
                      monkeypatch)
    assert cfg.autoscale is not None
    types = ray_cluster["available_node_types"]
    for pool in ("prefill", "decode"):
        (t,) = [t for t in types.values() if t.get("resources", {}).get(pool) == 1]
        lo, hi = cfg.autoscale.bounds(pool)
        assert t["min_workers"] <= lo and hi <= t["max_workers"], pool


def test_ray_cluster_has_prefill_and_decode_node_types(ray_cluster):
    types = ray_cluster["available_node_types"]
    assert ray_cluster["head_node_type"] in types
    for role in ("prefill", "decode"):
        matching = [t for t in types.values() if t.get("resources", {}).get(role) == 1]
        assert len(matching) == 1, role
        assert matching[0]["resources"].get("GPU", 0) >= 1, role
    workers = sum(t.get("max_workers", 0) for n, t in types.items()
                  if n != ray_cluster["head_node_type"])
    assert ray_cluster["max_workers"] >= workers, "cluster max_workers caps the node types'"


def test_ray_cluster_head_runs_the_router(ray_cluster, monkeypatch):
    script = "\n".join(ray_cluster["head_start_ray_commands"])
    assert "ray start --head" in script
    cfg = parse_serve(serve_command(script), monkeypatch)
    assert cfg.ray_address == "auto"
    assert (cfg.host, cfg.port, cfg.metrics_port) == ("0.0.0.0", GRPC_PORT, METRICS_PORT)
    assert cfg.engine.device == "cuda" and cfg.kv_transport == "nccl"
    # The ports the router listens on are open to clients and Prometheus.
    opened = {p["FromPort"] for p in ray_cluster["provider"]["security_group"]["IpPermissions"]}
    assert {GRPC_PORT, METRICS_PORT} <= opened


def test_ray_versions_agree(ray_cluster, k8s):
    """`ray up` nodes and the KubeRay cluster are documented for one Ray version."""
    pins = [m.group(1) for c in ray_cluster["setup_commands"]
            for m in [re.search(r"ray\[default\]==([\d.]+)", c)] if m]
    (cluster,) = [o for (kind, _), o in k8s.items() if kind == "RayCluster"]
    assert pins == [cluster["spec"]["rayVersion"]]


# -- tensor-parallel groups: a worker holds its N ranks' resources ---------------------------------
#
# The serve command states each pool's tensor-parallel size N (the one place); the
# node type / worker group of that pool must hold what the worker's actor asks Ray
# for (the real `actor_options`: one pool unit, N GPUs on CUDA), and N times the
# same per-rank amount of everything else; the devices the planner may fill must
# fit what the node types can bring.

_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti)?$")
POOL_RESOURCES = ("prefill", "decode")


def _quantity(value) -> int:
    """A Kubernetes quantity of whole units (``"8"``, ``"48Gi"``) as an integer."""
    m = _QUANTITY.match(str(value))
    assert m, f"unexpected quantity {value!r}"
    return int(m.group(1)) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30,
                              "Ti": 1 << 40}[m.group(2)]


def _ray_node_groups(ray_cluster: dict) -> list[dict]:
    """``{name, resources, min, max}`` of each worker node type, resources as Ray sees them."""
    return [{"name": name, "resources": dict(t.get("resources", {})),
             "min": t.get("min_workers", 0), "max": t.get("max_workers", 0)}
            for name, t in ray_cluster["available_node_types"].items()
            if name != ray_cluster["head_node_type"]]


def _kuberay_groups(cluster: dict) -> list[dict]:
    """The same for a RayCluster's worker groups: Ray resources from ``rayStartParams``,
    the GPU count KubeRay reads from the limit, the pod's CPU and memory."""
    out = []
    for g in cluster["spec"]["workerGroupSpecs"]:
        (container,) = g["template"]["spec"]["containers"]
        res = container["resources"]
        assert res["requests"] == res["limits"], f"{g['groupName']}: requests != limits"
        limits = res["limits"]
        resources = {**_ray_resources(g), "GPU": _quantity(limits.get("nvidia.com/gpu", 0)),
                     "CPU": _quantity(limits["cpu"]), "memory": _quantity(limits["memory"])}
        out.append({"name": g["groupName"], "resources": resources,
                    "min": g["minReplicas"], "max": g["maxReplicas"]})
    return out


def tensor_parallel_errors(argv: list[str], cfg, groups: list[dict]) -> list[str]:
    """Where the worker groups (``_ray_node_groups`` / ``_kuberay_groups``) disagree
    with the serve command ``argv`` (parsed: ``cfg``); empty when they agree."""
    from tandem.router.autoscaler import devices_per_worker
    from tandem.router.launcher import actor_options

    errors = []
    pools = ("prefill", "decode") if cfg.mode == "disaggregated" else ("decode",)
    stated = {"prefill": ["--prefill-tensor-parallel-size"],
              "decode": ["--decode-tensor-parallel-size"]}
    if cfg.mode == "colocated":
        stated["decode"].append("--tensor-parallel-size")
    sizes = devices_per_worker(cfg)
    per_rank: dict[str, set] = {}
    gpus_possible = 0
    for pool in pools:
        if not any(flag in argv for flag in stated[pool]):
            errors.append(f"serve command: states no {pool} size ({' or '.join(stated[pool])})")
        n = sizes[pool]
        engine = (cfg.prefill_engine or cfg.engine) if pool == "prefill" else cfg.engine
        role = pool if cfg.mode == "disaggregated" else "colocated"
        opts = actor_options(role, engine, require_resource=True)
        matching = [g for g in groups if g["resources"].get(pool)]
        if len(matching) != 1:
            errors.append(f"{pool}: {len(matching)} groups advertise `{pool}`, need 1")
            continue
        (group,) = matching
        res = group["resources"]
        for key, want in opts["resources"].items():
            if res.get(key) != want:
                errors.append(f"{group['name']}: {key} {res.get(key)}, its worker asks for {want}")
        if res.get("GPU", 0) != opts.get("num_gpus", 0):
            errors.append(f"{group['name']}: GPU {res.get('GPU', 0)}, a {pool} worker of "
                          f"{n} ranks asks for {opts.get('num_gpus', 0)}")
        for key in sorted(set(res) - {"GPU", *POOL_RESOURCES}):
            if res[key] % n:
                errors.append(f"{group['name']}: {key} {res[key]} is not {n} ranks' worth")
            per_rank.setdefault(key, set()).add(res[key] // n)
        gpus_possible += group["max"] * res.get("GPU", 0)
        if cfg.autoscale is None:
            workers = cfg.num_decode if pool == "decode" else cfg.num_prefill
            if workers > group["max"]:
                errors.append(f"{group['name']}: at most {group['max']} nodes, {workers} workers")
    for key, amounts in per_rank.items():
        if len(amounts) > 1:
            errors.append(f"{key} per rank differs between the pools: {sorted(amounts)}")
    if cfg.autoscale is not None and cfg.engine.device.startswith("cuda"):
        # The GPUs the planner may fill, each worker counting its ranks.
        wanted = sum(cfg.autoscale.bounds(p)[1] * sizes[p] for p in pools)
        if cfg.autoscale.max_total_devices is not None:
            wanted = min(wanted, cfg.autoscale.max_total_devices)
        if wanted > gpus_possible:
            errors.append(f"the planner may fill {wanted} GPUs, the groups bring at most "
                          f"{gpus_possible}")
    return errors


@pytest.mark.parametrize("flags,decode,prefill", [
    ([], 256, None), (["--burst-prefill-tokens", "128"], 128, None),
    (["--burst-prefill-tokens", "0"], None, None)])
def test_serve_splits_bursts_on_workers_that_decode_only(flags, decode, prefill, monkeypatch):
    """`tandem serve` splits bursts of prompts on decode and colocated workers (256 tokens
    per decoding sequence unless told otherwise, 0 turns it off); its prefill workers,
    which never decode, take prompts as the token budget allows."""
    from tandem.prefill_worker.worker import prefill_engine_config

    cfg = parse_serve(flags, monkeypatch)
    assert cfg.engine.scheduler.burst_prefill_tokens == decode
    ran = prefill_engine_config(cfg.prefill_engine or cfg.engine)   # what a prefill worker runs
    assert ran.scheduler.burst_prefill_tokens == prefill
    assert ran.cache == cfg.engine.cache


def _ray_serve_argv(ray_cluster: dict) -> list[str]:
    return serve_command("\n".join(ray_cluster["head_start_ray_commands"]))


def test_ray_cluster_node_types_hold_their_pools_groups(ray_cluster, monkeypatch):
    argv = _ray_serve_argv(ray_cluster)
    cfg = parse_serve(argv, monkeypatch)
    assert cfg.autoscale.max_total_devices is not None
    assert tensor_parallel_errors(argv, cfg, _ray_node_groups(ray_cluster)) == []


def test_raycluster_groups_hold_the_control_pods_groups(k8s, monkeypatch):
    """Across files: control.yaml's serve flags against raycluster.yaml's pods."""
    argv = serve_command(_script(k8s[("Deployment", "tandem-control")]))
    cfg = parse_serve(argv, monkeypatch)
    assert cfg.autoscale.max_total_devices is not None
    (cluster,) = [o for (kind, _), o in k8s.items() if kind == "RayCluster"]
    assert tensor_parallel_errors(argv, cfg, _kuberay_groups(cluster)) == []


# deploy/README.md, "A tensor-parallel pool": two colocated workers of 2 ranks each.
TP2_SERVE = ("tandem serve --mode colocated --ray-address auto --host 0.0.0.0 --port 50051 "
             "--metrics-port 9400 --num-decode 2 --tensor-parallel-size 2 --device cuda "
             "--dtype bfloat16 --kv-cache-gib 16")


def _tp2_ray_cluster(ray_cluster: dict, gpu: int = 2, cpu: int = 8) -> dict:
    """deploy/README.md's recipe applied to ray/cluster.yaml (``gpu``, ``cpu``: what
    the decode node type is given)."""
    c = json.loads(json.dumps(ray_cluster))
    types = c["available_node_types"]
    del types["prefill_gpu"]
    types["decode_gpu"].update(min_workers=2, max_workers=2)
    types["decode_gpu"]["resources"].update(GPU=gpu, CPU=cpu)
    commands = c["head_start_ray_commands"]
    (i,) = [i for i, cmd in enumerate(commands) if "tandem serve" in cmd]
    commands[i] = f"nohup {TP2_SERVE} > ~/tandem-router.log 2>&1 < /dev/null &"
    return c


def _tp2_raycluster(cluster: dict, gpu: str = "2") -> dict:
    """The same recipe applied to kubernetes/raycluster.yaml."""
    c = json.loads(json.dumps(cluster))
    c["spec"]["workerGroupSpecs"] = [g for g in c["spec"]["workerGroupSpecs"]
                                     if g["groupName"] == "decode"]
    (group,) = c["spec"]["workerGroupSpecs"]
    group.update(replicas=2, minReplicas=2, maxReplicas=2)
    (container,) = group["template"]["spec"]["containers"]
    amounts = {"cpu": "16", "memory": "96Gi", "nvidia.com/gpu": gpu}
    container["resources"] = {"requests": dict(amounts), "limits": dict(amounts)}
    return c


def test_the_readmes_two_rank_pool_passes_and_each_step_left_out_is_reported(
        ray_cluster, k8s, monkeypatch):
    util = pytest.importorskip("ray.autoscaler._private.util")
    recipe = _tp2_ray_cluster(ray_cluster)
    util.validate_config(util.prepare_config(json.loads(json.dumps(recipe))))    # as `ray up`
    argv = _ray_serve_argv(recipe)
    cfg = parse_serve(argv, monkeypatch)
    assert cfg.mode == "colocated" and cfg.engine.tensor_parallel_size == 2
    assert tensor_parallel_errors(argv, cfg, _ray_node_groups(recipe)) == []
    assert tensor_parallel_errors(argv, cfg, _ray_node_groups(
        _tp2_ray_cluster(ray_cluster, gpu=1))) == [
        "decode_gpu: GPU 1, a decode worker of 2 ranks asks for 2"]
    assert tensor_parallel_errors(argv, cfg, _ray_node_groups(
        _tp2_ray_cluster(ray_cluster, cpu=3))) == ["decode_gpu: CPU 3 is not 2 ranks' worth"]
    # Without the size on the command line the workers are of 1 rank: the doubled
    # node type no longer matches, and the command states no size.
    i = argv.index("--tensor-parallel-size")
    bare = argv[:i] + argv[i + 2:]
    errors = tensor_parallel_errors(bare, parse_serve(bare, monkeypatch), _ray_node_groups(recipe))
    assert errors == ["serve command: states no decode size (--decode-tensor-parallel-size or "
                      "--tensor-parallel-size)",
                      "decode_gpu: GPU 2, a decode worker of 1 ranks asks for 1"]
    # Two workers on node types that allow one.
    one_node = _tp2_ray_cluster(ray_cluster)
    one_node["available_node_types"]["decode_gpu"].update(min_workers=1, max_workers=1)
    assert tensor_parallel_errors(argv, cfg, _ray_node_groups(one_node)) == [
        "decode_gpu: at most 1 nodes, 2 workers"]

    (cluster,) = [o for (kind, _), o in k8s.items() if kind == "RayCluster"]
    recipe = _tp2_raycluster(cluster)
    _, validator = crd_validator(CRDS / "ray.io_rayclusters.yaml", "v1")
    assert _errors(validator, recipe) == []
    assert tensor_parallel_errors(argv, cfg, _kuberay_groups(recipe)) == []
    assert tensor_parallel_errors(argv, cfg, _kuberay_groups(_tp2_raycluster(cluster, "1"))) == [
        "decode: GPU 1, a decode worker of 2 ranks asks for 2"]


def test_the_pools_share_one_per_rank_shape(k8s, monkeypatch):
    """Both pools' pods are N x the same per-rank amounts: a decode pod given more
    CPUs than a prefill pod of the same size is reported."""
    argv = serve_command(_script(k8s[("Deployment", "tandem-control")]))
    cfg = parse_serve(argv, monkeypatch)
    (cluster,) = [o for (kind, _), o in k8s.items() if kind == "RayCluster"]
    groups = _kuberay_groups(cluster)
    decode = next(g for g in groups if g["resources"].get("decode"))
    decode["resources"]["CPU"] *= 2
    cpu = decode["resources"]["CPU"]
    assert tensor_parallel_errors(argv, cfg, groups) == [
        f"CPU per rank differs between the pools: {[cpu // 2, cpu]}"]


def test_a_device_budget_beyond_the_node_types_is_reported(ray_cluster, monkeypatch):
    argv = _ray_serve_argv(ray_cluster)
    groups = _ray_node_groups(ray_cluster)
    gpus = sum(g["max"] * g["resources"]["GPU"] for g in groups)
    more = [*argv, "--max-prefill", "5", "--max-total-devices", str(gpus + 1)]
    assert tensor_parallel_errors(more, parse_serve(more, monkeypatch), groups) == [
        f"the planner may fill {gpus + 1} GPUs, the groups bring at most {gpus}"]
    # Within the budget the larger pool maximum is fine: the planner stops at the budget.
    capped = [*argv, "--max-prefill", "5", "--max-total-devices", str(gpus)]
    assert tensor_parallel_errors(capped, parse_serve(capped, monkeypatch), groups) == []
