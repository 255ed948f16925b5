"""Spec validation with reasons a user can act on (they end up in status.conditions and in an event)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import Any

import kubernetes_validate
from pydantic import ValidationError

from tandem.operator.builders import pod_env
from tandem.operator.crd import LLMDeploymentSpec, PodSettings
from tandem.operator.devices import GPU_RESOURCE, pool_gpus, pool_tp
from tandem.operator.names import COMPONENTS, MAX_NAME_LENGTH, POOLS
from tandem.operator.scaling import scaling_reasons
from tandem.operator.sizing import PoolSizes, resolve_pool_sizes

DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class SpecError(ValueError):
    """An LLMDeployment that cannot be reconciled; `reasons` lists every problem found."""

    def __init__(self, reasons: list[str]):
        self.reasons = reasons
        super().__init__("; ".join(reasons))


def _pydantic_reasons(exc: ValidationError) -> list[str]:
    reasons = []
    for error in exc.errors():
        where = ".".join(["spec", *(str(part) for part in error["loc"])])
        message = error["msg"].removeprefix("Value error, ")
        reasons.append(f"{where}: {message}")
    return reasons


def _semantic_reasons(spec: LLMDeploymentSpec, sizes: PoolSizes) -> list[str]:
    reasons = []
    if sizes.decode < 1:
        reasons.append("spec.decode.replicas: must be at least 1: decode workers generate every response")
    for pool in POOLS:
        try:
            gpus = pool_gpus(getattr(spec, pool).resources)
        except ValueError as exc:
            reasons.append(f"spec.{pool}.resources: {exc}")
            continue
        tp = pool_tp(spec, pool)
        if spec.lora_adapters and tp > 1:
            reasons.append(f"spec.loraAdapters: LoRA adapters need tensorParallelSize 1 (spec.{pool} has {tp}): "
                           "LoRA with tensor parallelism is not supported yet")
        if gpus is not None and 0 < gpus < tp:
            reasons.append(f"spec.{pool}.resources: {gpus} {GPU_RESOURCE} cannot hold tensorParallelSize {tp} (one "
                           f"GPU per rank): ask for {tp}, or leave {GPU_RESOURCE} out for the operator to ask")
    return reasons


def validate_name(name: str) -> list[str]:
    if len(name) > MAX_NAME_LENGTH:
        return [f"metadata.name: {name!r} is {len(name)} characters; at most {MAX_NAME_LENGTH} leave room "
                "for the '-prefill' suffix of the Services it gets"]
    if not re.fullmatch(DNS_1035_LABEL, name):
        return [f"metadata.name: {name!r} must be a DNS-1035 label (lower-case letters, digits and '-', "
                "starting with a letter) because the Services take their names from it"]
    return []


def built_object_reasons(objects: list[dict]) -> list[str]:
    """What the objects built from a valid spec would be refused for before any API server sees them: an env name
    set twice in one container (the spec's env entries and the ones the operator sets itself go in one list,
    which server-side apply cannot merge)."""
    reasons = []
    for obj in objects:
        component = obj["metadata"]["labels"].get("app.kubernetes.io/component")
        for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []:
            env = [entry["name"] for entry in container.get("env") or []]
            for repeated in sorted({name for name in env if env.count(name) > 1}):
                reasons.append(f"spec.{component}.env: {repeated} is set more than once in {obj['kind']} "
                               f"{obj['metadata']['name']} (given twice, or a name the operator sets itself there)")
    return reasons


def _json_path(parts) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts)


def pod_field_reasons(where: str, settings: PodSettings) -> list[str]:
    """What the Kubernetes schema refuses in the pod fields the spec passes through as written (`tolerations`,
    `affinity`, `env`), each named as the spec names it (`where`: spec.decode, ...). Not strict: a field the
    schema does not know yet is the API server's to judge."""
    fields = {"tolerations": settings.tolerations, "affinity": settings.affinity, "env": pod_env(settings)}
    problems = (_schema_problem(field, json.dumps(value, sort_keys=True)) for field, value in fields.items() if value)
    return [f"{where}{problem}" for problem in problems if problem]


@functools.lru_cache(maxsize=256)  # every status refresh validates the spec again
def _schema_problem(field: str, value_json: str) -> str | None:
    """Where and why the Kubernetes schema refuses one pod field (as JSON) in a pod, or None."""
    value = json.loads(value_json)
    pod_spec: dict[str, Any] = {"containers": [{"name": "check"}]}
    if field == "env":
        pod_spec["containers"][0]["env"] = value
    else:
        pod_spec[field] = value
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": pod_spec}
    try:
        kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=False)
    except kubernetes_validate.ValidationError as exc:
        path = list(exc.absolute_path)[1:]  # under the pod's spec
        if path[:2] == ["containers", 0]:
            path = path[2:]
        return f"{_json_path(path)}: {exc.message} (the Kubernetes schema)"
    return None


def validate_spec(raw_spec: Mapping[str, Any] | None, name: str) -> tuple[LLMDeploymentSpec, PoolSizes]:
    """The parsed spec and its pool sizes, or SpecError naming every problem."""
    reasons = validate_name(name)
    try:
        spec = LLMDeploymentSpec.model_validate(dict(raw_spec or {}))
    except ValidationError as exc:
        raise SpecError(reasons + _pydantic_reasons(exc)) from None
    try:
        sizes = resolve_pool_sizes(spec)
    except ValueError as exc:
        raise SpecError([*reasons, f"spec: {exc}"]) from None
    reasons += _semantic_reasons(spec, sizes) + scaling_reasons(spec)
    for component in COMPONENTS:
        reasons += pod_field_reasons(f"spec.{component}", getattr(spec, component))
    if reasons:
        raise SpecError(reasons)
    return spec, sizes
