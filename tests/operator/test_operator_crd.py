"""The CRD: generated from tandem/config.py, committed unchanged, structural, and its CEL rules agree with
the pydantic validators the operator runs."""

from __future__ import annotations

import cel
import kubernetes_validate
import pytest
import yaml
from kube_emulator import EXAMPLE
from pydantic import ValidationError

from tandem.operator.crd import LLMDeploymentSpec
from tandem.operator.crdgen import CRD_FILES, crd_manifest, main, render_crd

# Free-form on purpose (Pod API types we pass through); anything else must be fully typed.
PRESERVED = {"spec.prefill.affinity", "spec.decode.affinity", "spec.router.affinity",
             "spec.prefill.tolerations[]", "spec.decode.tolerations[]", "spec.router.tolerations[]",
             "spec.prefill.env[].valueFrom", "spec.decode.env[].valueFrom", "spec.router.env[].valueFrom"}


def _schema() -> dict:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crd_files_equal_the_generated_one():
    text = render_crd()
    for path in CRD_FILES:
        assert path.read_text() == text, f"{path} is stale: run `python -m tandem.operator.crdgen`"
    assert main(["--check"]) == 0


def _walk(node: dict, where: str):
    yield where, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{where}.{name}" if where else name)
    if "items" in node:
        yield from _walk(node["items"], f"{where}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{where}.*")


def test_schema_is_structural():
    preserved = set()
    for where, node in _walk(_schema(), ""):
        assert not {"$ref", "anyOf", "allOf", "oneOf", "$defs", "title"} & set(node), where
        if node.get("x-kubernetes-preserve-unknown-fields"):
            preserved.add(where)
        elif not node.get("x-kubernetes-int-or-string"):
            assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, where
        if node.get("exclusiveMinimum") is not None:
            assert node["exclusiveMinimum"] is True and "minimum" in node, where
    assert preserved == PRESERVED


def test_crd_identity_printer_columns_and_status_subresource():
    crd = crd_manifest()
    kubernetes_validate.validate(crd, "1.30", strict=True)
    spec = crd["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["shortNames"]) == (
        "serving.tandem.dev", "Namespaced", "LLMDeployment", ["llmdep"])
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Ready": ".status.ready", "P:D": ".status.ratio", "GPUs": ".status.gpus",
                       "Endpoint": ".status.endpoint", "Phase": ".status.phase", "Age": ".metadata.creationTimestamp"}
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"


def _rules(schema: dict, where: str) -> list[dict]:
    node = schema
    for part in where.split(".") if where else []:
        node = node["properties"][part]
    return node.get("x-kubernetes-validations", [])


def _cel_errors(spec: dict) -> list[str]:
    """The messages the API server would return for `spec` (only the nodes present are checked, as there)."""
    schema = _schema()["properties"]["spec"]
    errors = []
    nodes = [("", spec), ("model", spec.get("model")), ("model.source", (spec.get("model") or {}).get("source")),
             ("engine.speculativeConfig", (spec.get("engine") or {}).get("speculativeConfig"))]
    adapter_source = schema["properties"]["loraAdapters"]["items"]["properties"]["source"]
    for where, value in nodes:
        if value is None:
            continue
        for rule in _rules(schema, where):
            if not cel.evaluate(rule["rule"], {"self": value}):
                errors.append(rule["message"])
    for adapter in spec.get("loraAdapters") or []:
        for rule in adapter_source.get("x-kubernetes-validations", []):
            if not cel.evaluate(rule["rule"], {"self": adapter["source"]}):
                errors.append(rule["message"])
    return errors


def _pydantic_errors(spec: dict) -> list[str]:
    try:
        LLMDeploymentSpec.model_validate(spec)
    except ValidationError as exc:
        return [e["msg"].removeprefix("Value error, ") for e in exc.errors() if e["type"] == "value_error"]
    return []


def _example(**changes) -> dict:
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    for key, value in changes.items():
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    return spec


CASES = {
    "example": (_example(), None),
    "explicit pools": (_example(ratio=None, replicas=None, prefill={"replicas": 1}, decode={"replicas": 2}), None),
    "ratio without replicas": (_example(replicas=None), "spec.ratio needs spec.replicas"),
    "replicas without ratio": (_example(ratio=None, prefill={"replicas": 1}, decode={"replicas": 1}),
                               "spec.replicas is the total to split by spec.ratio"),
    "ratio and pool replicas": (_example(prefill={"replicas": 2}), "spec.ratio sizes the pools"),
    "no sizing": (_example(ratio=None, replicas=None), "size the pools"),
    "two sources": (_example(model={"name": "m", "format": "gguf",
                                    "source": {"uri": "smollm2", "hostPath": {"path": "/m.gguf"}}}),
                    "model.source needs exactly one of pvc, hostPath or uri"),
    "no source": (_example(model={"name": "m", "format": "gguf", "source": {}}), "model.source needs exactly one"),
    "gguf format on a folder": (_example(model={"name": "m", "format": "gguf",
                                                "source": {"pvc": {"claimName": "c", "path": "llama"}}}),
                                "model.format must match the file"),
    "hf format on a gguf file": (_example(model={"name": "m", "format": "hf",
                                                 "source": {"hostPath": {"path": "/x/m.gguf"}}}),
                                 "model.format must match the file"),
    "gguf format on a path ending in a slash": (_example(model={"name": "m", "format": "gguf",
                                                                "source": {"pvc": {"claimName": "c",
                                                                                   "path": "m.gguf/"}}}),
                                                "model.format must match the file"),
    "hf format on a folder named .gguf/": (_example(model={"name": "m", "format": "hf",
                                                           "source": {"hostPath": {"path": "/w.gguf/"}}}), None),
    "lora adapters": (_example(loraAdapters=[{"name": "sql", "source": {"pvc": {"claimName": "c", "path": "s"}}},
                                             {"name": "chat", "source": {"hostPath": {"path": "/a/chat"}}}]), None),
    "lora adapter with two sources": (_example(loraAdapters=[{"name": "sql", "source": {
        "pvc": {"claimName": "c", "path": "s"}, "hostPath": {"path": "/a"}}}]), "needs exactly one of pvc or hostPath"),
    "lora adapter without a source": (_example(loraAdapters=[{"name": "sql", "source": {}}]),
                                      "needs exactly one of pvc or hostPath"),
    "lora adapter named as the model": (_example(loraAdapters=[{"name": "smollm2-135m-instruct", "source": {
        "hostPath": {"path": "/a"}}}]), "an adapter's name must differ from model.name"),
    "speculative lookup window": (_example(engine={"speculativeConfig": {
        "numSpeculativeTokens": 4, "promptLookupMin": 2, "promptLookupMax": 4}}), None),
    "speculative lookup window upside down": (_example(engine={"speculativeConfig": {
        "numSpeculativeTokens": 4, "promptLookupMin": 5, "promptLookupMax": 4}}), "promptLookupMin must not exceed"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cel_rules_and_pydantic_validators_agree(case):
    spec, expected = CASES[case]
    cel_errors, py_errors = _cel_errors(spec), _pydantic_errors(spec)
    if expected is None:
        assert cel_errors == [] and py_errors == []
    else:
        assert any(expected in m for m in cel_errors), cel_errors
        assert any(expected in m for m in py_errors), py_errors
        assert set(cel_errors) == set(py_errors)


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLE.parent.glob("llmdeployment*.yaml")))
def test_every_example_passes_the_crd_schema_its_rules_and_the_operators_model(name):
    import jsonschema  # OpenAPI v3.0 schemas are draft 4 (boolean exclusiveMinimum); x-kubernetes-* are ignored

    body = yaml.safe_load((EXAMPLE.parent / name).read_text())
    assert (body["apiVersion"], body["kind"]) == ("serving.tandem.dev/v1alpha1", "LLMDeployment")
    jsonschema.Draft4Validator(_schema()["properties"]["spec"]).validate(body["spec"])
    assert _cel_errors(body["spec"]) == []
    assert _pydantic_errors(body["spec"]) == []
    LLMDeploymentSpec.model_validate(body["spec"])


def test_a_decode_pool_of_none_is_refused_by_kubectl_apply_as_by_the_operator():
    """A prefill pool may be empty, a decode pool may not: caught by the CRD, before the operator says it."""
    from tandem.operator.validation import SpecError, validate_spec

    spec = _example(ratio=None, replicas=None, prefill={"replicas": 1}, decode={"replicas": 0})
    assert any("spec.decode.replicas: must be at least 1" in m for m in _cel_errors(spec))
    with pytest.raises(SpecError, match="spec.decode.replicas: must be at least 1"):
        validate_spec(spec, "smollm2")
    assert _cel_errors(_example(ratio=None, replicas=None, prefill={"replicas": 0}, decode={"replicas": 1})) == []


@pytest.mark.parametrize("name", ["autoscaling-hpa.yaml", "autoscaling-keda.yaml"])
def test_the_autoscaler_examples_scale_an_llmdeployment_through_its_scale_subresource(name):
    """They name the LLMDeployment (not a pool Deployment), whose CRD has the scale subresource, and never go below
    the two workers spec.replicas needs."""
    body = yaml.safe_load((EXAMPLE.parent / name).read_text())
    target = body["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("serving.tandem.dev/v1alpha1", "LLMDeployment")
    assert crd_manifest()["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    minimum = body["spec"].get("minReplicas", body["spec"].get("minReplicaCount"))
    assert minimum >= _schema()["properties"]["spec"]["properties"]["replicas"]["minimum"]
    if body["kind"] == "HorizontalPodAutoscaler":
        kubernetes_validate.validate(body, "1.30", strict=True)
    else:
        assert {t["type"] for t in body["spec"]["triggers"]} == {"prometheus"}
        assert all("tandem_router_" in t["metadata"]["query"] for t in body["spec"]["triggers"])
