"""An emulated Kubernetes API server (kmock), a test's view of it, and the real operator run against it.

kmock's KubernetesEmulator stores objects and streams watch events; `ApiServerEmulator` adds the few things
a real API server does on every write that kopf and the operator rely on: names from generateName (kopf's
events), uid, resourceVersion (kopf's consistency checks), metadata.generation bumped on spec changes
(status.observedGeneration) and creationTimestamp. Like a real API server it refuses, with 422 Invalid, a
built-in object that breaks the Kubernetes schema (kubernetes-validate, strict) or repeats an env name in a
container (server-side apply cannot merge such a list), but a server-side apply of a field of the wrong type or
one the schema does not declare with a 500, as Kubernetes does (kubernetes#139253); it refuses a RoleBinding to a
Role that is not there (RBAC's escalation check, for a caller that may not `bind`), and answers `?dryRun=All`
without storing anything. Where a test reported a Deployment's status, a change of its replicas alone gets the
status its controller would write (the Progressing condition unchanged).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import aiohttp.web
import attrs
import jsonpatch
import kmock
import kubernetes.client
import kubernetes_validate
import yaml

from tandem.operator.main import operate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llmdeployment.yaml"
CR = "serving.tandem.dev/v1alpha1/llmdeployments"
RESOURCES = {  # resource -> (kind, namespaced, subresources)
    CR: ("LLMDeployment", True, {"status", "scale"}),
    "apps/v1/deployments": ("Deployment", True, {"status", "scale"}),
    "v1/services": ("Service", True, {"status"}),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/secrets": ("Secret", True, set()),
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "v1/events": ("Event", True, set()),
    "v1/namespaces": ("Namespace", False, set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, {"status"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, set()),
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


def merge_patch(target: dict, patch: dict) -> dict:
    """RFC 7386 JSON merge patch (what a PATCH does to the spec, for deciding whether it changed)."""
    merged = dict(target)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_patch(merged[key], value)
        else:
            merged[key] = value
    return merged


SCHEMA_VERSION = "1.30"
CUSTOM_GROUPS = ("serving.tandem.dev", "apiextensions.k8s.io")  # not in the built-in schemas


@attrs.frozen
class InvalidObjectError(kmock.KubernetesError):
    status: int = 422
    reason: str = "Invalid"
    message: str = "the object is invalid"


@attrs.frozen
class TypedPatchError(kmock.KubernetesError):
    """What server-side apply answers for a field of the wrong type or unknown to the schema: a 500, not a 422
    (kubernetes#139253), the dry run's included."""

    status: int = 500
    reason: str = "InternalError"
    message: str = "failed to create typed patch object"


def schema_error(obj: dict) -> kubernetes_validate.ValidationError | None:
    """The first thing the Kubernetes schema (strict: unknown fields too) refuses in a built-in object, or None."""
    kind, api_version = obj.get("kind"), obj.get("apiVersion")
    if not kind or not api_version or api_version.startswith(CUSTOM_GROUPS) or kind == "Event":
        return None  # what the built-in schemas do not cover (kopf's events are posted without apiVersion)
    try:
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return exc
    return None


JSON_TYPES = {str: "string", bool: "bool", int: "numeric", float: "numeric", list: "list", dict: "map"}


def typed_patch_failure(obj: dict) -> str | None:
    """The message of the 500 server-side apply answers for `obj` (as Kubernetes 1.24 words it), or None: a field
    of the wrong type or one the schema does not declare. Other schema errors come after the patch, as 422s."""
    error = schema_error(obj)
    if error is None or error.validator not in ("type", "oneOf", "additionalProperties"):
        return None
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.absolute_path)
    if error.validator == "additionalProperties":
        unknown = sorted(set(error.instance) - set(error.schema.get("properties") or {}))
        path, problem = f"{path}.{unknown[0]}", "field not declared in schema"
    else:
        wanted = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        expected = "numeric (int or float)" if {"integer", "number"} & set(wanted) else wanted[0]
        problem = f"expected {expected}, got {JSON_TYPES.get(type(error.instance), 'null')}"
    group_version = obj["apiVersion"] if "/" in obj["apiVersion"] else f"/{obj['apiVersion']}"
    return f"failed to create typed patch object ({group_version}, Kind={obj['kind']}): {path}: {problem}"


def schema_problem(obj: dict) -> str | None:
    """Why a real API server would refuse `obj`, or None."""
    kind, name = obj.get("kind"), obj.get("metadata", {}).get("name")
    error = schema_error(obj)
    if error is not None:
        return f"{kind} {name!r} is invalid: {str(error).splitlines()[0]}"
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    for container in pod.get("containers") or []:
        env = [e.get("name") for e in container.get("env") or []]
        repeated = sorted({e for e in env if env.count(e) > 1})
        if repeated:
            return f'{kind} {name!r} is invalid: duplicate entries for key [name="{repeated[0]}"]'
    return None


def scaled_deployment_status(current: dict, spec: dict, generation: int) -> dict | None:
    """The status a Deployment controller writes when only the replicas of a Deployment it reported on change (None
    for any other change, which tests report by hand): the pods of the same ReplicaSet are added or removed, and
    the Progressing condition stays as it was, NewReplicaSetAvailable once a rollout completed."""
    status, before = current.get("status") or {}, current.get("spec") or {}
    if current.get("kind") != "Deployment" or "observedGeneration" not in status:
        return None
    if {**spec, "replicas": None} != {**before, "replicas": None}:
        return None
    replicas = spec.get("replicas", 1)
    updated = replicas if status.get("updatedReplicas") == status.get("replicas") else \
        min(status.get("updatedReplicas") or 0, replicas)
    return {**status, "observedGeneration": generation, "replicas": replicas, "updatedReplicas": updated,
            "readyReplicas": min(status.get("readyReplicas") or 0, replicas),
            "availableReplicas": min(status.get("availableReplicas") or 0, replicas)}


def is_apply(request) -> bool:
    """A server-side apply (PATCH application/apply-patch+yaml)."""
    content_type = next((v for k, v in (request.headers or {}).items() if k.lower() == "content-type"), "")
    return request.method == kmock.method.PATCH and content_type.startswith("application/apply-patch")


@attrs.define(kw_only=True)
class ApiServerEmulator(kmock.KubernetesEmulator):
    _versions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)

    def _result_of(self, request) -> dict | None:
        """The object a create or an update of the object itself would leave (None for anything else)."""
        if request.resource is None or request.subresource is not None or not isinstance(request.data, dict):
            return None
        if request.action == kmock.action.CREATE:
            return request.data
        if request.action == kmock.action.UPDATE:
            key = (request.resource, request.namespace, request.name)
            if key in self.objects and not self.objects[key].deleted:
                return merge_patch(copy.deepcopy(dict(self.objects[key].raw)), request.data)
        return None

    def _role_missing(self, binding: dict, namespace: str | None) -> str | None:
        """A RoleBinding to a Role that does not exist (yet): a real API server refuses it with 404 to a caller
        that may not `bind` roles, as the operator may not, because it checks the Role's rules against the
        caller's (RBAC's escalation check), dry run or not."""
        ref = binding.get("roleRef") or {}
        if binding.get("kind") != "RoleBinding" or ref.get("kind") != "Role":
            return None
        key = (kmock.resource("rbac.authorization.k8s.io/v1/roles"), namespace, ref.get("name"))
        if key in self.objects and not self.objects[key].deleted:
            return None
        return f'roles.rbac.authorization.k8s.io "{ref.get("name")}" not found'

    async def _handle(self, request):
        if is_apply(request) and isinstance(request.data, dict):  # the typed patch comes first, dry run or not
            failure = typed_patch_failure(request.data)
            if failure is not None:
                raise TypedPatchError(message=failure)
        result = self._result_of(request)
        if result is not None:
            problem = schema_problem(result)
            if problem is not None:
                raise InvalidObjectError(message=problem)
            missing = self._role_missing(result, request.namespace or result.get("metadata", {}).get("namespace"))
            if missing is not None:
                raise kmock.KubernetesObjectNotFoundError(message=missing)
            if (request.params or {}).get("dryRun") == "All":  # checked, not stored
                status = 201 if request.action == kmock.action.CREATE else 200
                return aiohttp.web.json_response(result, status=status)
        elif (request.params or {}).get("dryRun") == "All" and request.action == kmock.action.UPDATE:
            raise kmock.KubernetesObjectNotFoundError()  # an apply to nothing: as this emulator answers it
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if request.action == kmock.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:6]
                if request.namespace:
                    meta.setdefault("namespace", request.namespace)
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).isoformat())
                meta["resourceVersion"] = str(next(self._versions))
            elif request.action == kmock.action.UPDATE:
                key = (request.resource, request.namespace, request.name)
                if key in self.objects and not self.objects[key].deleted:
                    current = copy.deepcopy(dict(self.objects[key].raw))
                    # A write of the scale subresource changes the spec, as on a real API server (kmock merges a
                    # subresource's body into the object: a Scale's {"spec": {"replicas": N}} lands where
                    # specReplicasPath .spec.replicas says).
                    if request.subresource in (None, "scale") and "spec" in data:
                        new_spec = merge_patch(current.get("spec", {}), data["spec"])
                        if new_spec != current.get("spec", {}):
                            meta["generation"] = current.get("metadata", {}).get("generation", 1) + 1
                            status = scaled_deployment_status(current, new_spec, meta["generation"])
                            if status is not None:
                                data["status"] = status
                    meta["resourceVersion"] = str(next(self._versions))
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as exc:
            # A JSON patch whose `test` fails (kopf tests resourceVersion) is a 422 on a real API server; kopf reads
            # it as "newer changes pending" and tries again on the next cycle. Left as the 500 kmock answers, kopf
            # retried the stale patch with backoff for ~20 s.
            return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                              "reason": "Invalid", "code": 422, "message": str(exc)}, status=422)


PDBS = "policy/v1/poddisruptionbudgets"


def foreign_disruption_budget(name: str, namespace: str) -> dict:
    """A PodDisruptionBudget named as an LLMDeployment's that is not its own. The operator does not watch them, so
    one of its own deleted and replaced with this stays replaced until it reconciles."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name, "namespace": namespace},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "theirs"}}}}


class Cluster:
    """The emulated cluster as a test sees it: apply, patch, read, and wait (always with a deadline)."""

    def __init__(self, emulator: ApiServerEmulator, namespace: str):
        self.emulator = emulator
        self.namespace = namespace

    def path(self, resource: str, name: str | None = None, subresource: str | None = None) -> str:
        group_version, plural = resource.rsplit("/", 1)
        prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        path = f"{prefix}/namespaces/{self.namespace}/{plural}"
        return path + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")

    async def create(self, resource: str, body: dict) -> dict:
        response = await self.emulator.post(self.path(resource), json=body)
        assert response.status in (200, 201), await response.text()
        return await response.json()

    async def patch(self, resource: str, name: str, body: dict, subresource: str | None = None) -> dict:
        response = await self.emulator.patch(self.path(resource, name, subresource), json=body)
        assert response.status == 200, await response.text()
        return await response.json()

    async def delete(self, resource: str, name: str) -> None:
        response = await self.emulator.delete(self.path(resource, name))
        assert response.status == 200, await response.text()

    def get(self, resource: str, name: str) -> dict | None:
        key = (kmock.resource(resource), self.namespace, name)
        if key not in self.emulator.objects or self.emulator.objects[key].deleted:
            return None
        return copy.deepcopy(dict(self.emulator.objects[key].raw))

    def all(self, resource: str) -> dict[str, dict]:
        found = {}
        for (res, namespace, name), obj in list(self.emulator.objects.items()):
            if res == kmock.resource(resource) and namespace == self.namespace and not obj.deleted:
                found[name] = copy.deepcopy(dict(obj.raw))
        return found

    def events(self, reason: str | None = None) -> list[dict]:
        return [e for e in self.all("v1/events").values() if reason is None or e.get("reason") == reason]

    async def wait_for(self, what: str, check: Callable[[], object], timeout: float = 10.0) -> object:
        """Poll `check` until it returns something truthy; fail with `what` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = check()
            if result:
                return result
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    async def apply_example(self, **spec_changes) -> dict:
        body = yaml.safe_load(EXAMPLE.read_text())
        body["metadata"]["namespace"] = self.namespace
        body["spec"].update(spec_changes)
        return await self.create(CR, body)


@contextlib.asynccontextmanager
async def running_operator(emulator, **operate_options):
    """The real operator watching namespace `ns1` of `emulator` (with `operate_options` passed on); stopped on
    exit, and any crash of it raised here.

    The operator gets its own thread and event loop, as in production: on exit kopf cancels every task
    of its loop, which must not include the emulator's or the test's.
    """
    api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=str(emulator.url).rstrip("/")))
    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(operate("ns1", api_client=api, resync_seconds=None, stop_flag=stop, ready_flag=ready,
                                **operate_options))
        except BaseException as exc:  # surfaced here, not lost in the thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 15), f"operator not ready in 15 s: {failure}"
        yield Cluster(emulator, "ns1")
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        api.close()
    assert not thread.is_alive(), "the operator did not stop within 15 s"
    assert not failure, f"the operator crashed: {failure[0]!r}"
