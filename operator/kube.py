"""A small synchronous Kubernetes API client for the kinds the operator owns (plain dicts in and out).

It rides on the official client's ApiClient for configuration and authentication (in-cluster service
account, kubeconfig, exec plugins, token refresh) and speaks REST directly, so one code path serves every
kind. Kopf runs sync handlers in worker threads, where blocking calls are fine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import kubernetes.client
import kubernetes.config

from tandem.operator.builders import short_hash
from tandem.operator.crd import CRD_PLURAL
from tandem.operator.names import API_VERSION, HASH_ANNOTATION, KIND, MANAGER, OWNER_LABEL

PLURALS = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",  # the internal-endpoint token only: created once, never applied
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("discovery.k8s.io/v1", "EndpointSlice"): "endpointslices",  # read only: the planner's scrape targets
    (API_VERSION, KIND): CRD_PLURAL,
}

Outcome = Literal["created", "updated", "unchanged"]
# How an API server's server-side apply says, with a 500, that a field has the wrong type or is not in the schema.
TYPED_PATCH_FAILURE = "failed to create typed patch object"


class KubeError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, method: str, path: str, message: str):
        self.status = status
        self.message = message
        super().__init__(f"{method} {path} -> {status}: {message}")

    @property
    def retriable(self) -> bool:
        return (self.status in (409, 429) or self.status >= 500) and not self.invalid

    @property
    def invalid(self) -> bool:
        """The server refused the object itself: 422 (schema, validation), 400 (a malformed request, or an
        admission webhook that denies with it), or the 500 server-side apply answers for a field of the wrong type
        or unknown to the schema (kubernetes#139253)."""
        return self.status in (400, 422) or (self.status == 500 and TYPED_PATCH_FAILURE in self.message)


class ForeignObjectError(Exception):
    """An object of the name the operator would give it exists and is not the LLMDeployment's: it is left alone
    (taking it over would hand it to the LLMDeployment's garbage collection). Retried: it may be deleted, or be
    on its way out with a previous LLMDeployment of the same name."""

    retriable = True


@dataclass(frozen=True)
class Step:
    """One owned object's part of a reconcile: the object as built (with its hash), what exists, what to do, and
    whether what exists was built from the same object (its hash annotation)."""

    desired: dict
    current: dict | None
    action: Literal["create", "apply", "none"]
    same: bool = False

    @property
    def label(self) -> str:
        return f"{self.desired['kind']} {self.desired['metadata']['name']}"


def owns(desired: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """Whether `current` belongs to the LLMDeployment `desired` is built for: its controller reference names that
    LLMDeployment's uid, or it has none and carries that LLMDeployment's labels (an orphan of it, which the
    operator adopts, as a Deployment adopts its orphaned ReplicaSets)."""
    wanted = desired["metadata"]["ownerReferences"][0]
    controller = controller_ref(current)
    if controller is not None:
        return controller.get("uid") == wanted["uid"]
    labels, ours = current.get("metadata", {}).get("labels") or {}, desired["metadata"]["labels"]
    return labels.get("app.kubernetes.io/managed-by") == MANAGER and labels.get(OWNER_LABEL) == ours[OWNER_LABEL]


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None,
                  subresource: str | None = None) -> str:
    try:
        plural = PLURALS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"the operator does not manage {kind} ({api_version})") from None
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> kubernetes.client.ApiClient:
    """In-cluster service account when running in a pod, else the kubeconfig (as kubectl finds it)."""
    config = kubernetes.client.Configuration()
    if kubeconfig is None and context is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
            return kubernetes.client.ApiClient(config)
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=config)
    return kubernetes.client.ApiClient(config)


def with_desired_hash(obj: Mapping[str, Any]) -> dict:
    """The object plus an annotation hashing it: the next reconcile compares hashes, not server-defaulted
    fields, to decide whether anything changed."""
    meta = dict(obj["metadata"])
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != HASH_ANNOTATION}
    digest = short_hash({**obj, "metadata": {**meta, "annotations": annotations}})
    meta["annotations"] = {**annotations, HASH_ANNOTATION: digest}
    return {**obj, "metadata": meta}


class Kube:
    def __init__(self, api: kubernetes.client.ApiClient, timeout: float = 30.0):
        self.api = api
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None,
                content_type: str = "application/json") -> dict:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, body, _ = self.api.param_serialize(
            method=method, resource_path=path, query_params=list((query or {}).items()), header_params=headers,
            body=body, auth_settings=["BearerToken"])
        response = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=self.timeout)
        response.read()
        data = json.loads(response.data) if response.data else {}
        if not 200 <= response.status < 300:
            message = data.get("message") if isinstance(data, dict) else None
            raise KubeError(response.status, method, path, message or response.data[:300].decode(errors="replace"))
        return data

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self.request("GET", resource_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        items = self.request("GET", resource_path(api_version, kind, namespace),
                             query={"labelSelector": selector}).get("items") or []
        # Filter here as well: a proxy or an emulator that ignores labelSelector must not mix owners up.
        return [item for item in items
                if all((item.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in labels.items())]

    def create(self, obj: Mapping[str, Any], dry_run: bool = False) -> dict:
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return self.request("POST", path, body=dict(obj), query=_write_query(dry_run))

    def apply(self, obj: Mapping[str, Any], dry_run: bool = False) -> dict:
        """Server-side apply: fields the operator set before and no longer sets are removed, and fields
        someone else changed are taken back (force). With dry_run the server checks it and keeps nothing."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return self.request("PATCH", path, body=dict(obj), query={**_write_query(dry_run), "force": "true"},
                            content_type="application/apply-patch+yaml")

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str, status: Mapping) -> dict:
        path = resource_path(api_version, kind, namespace, name, "status")
        return self.request("PATCH", path, body={"status": dict(status)},
                            content_type="application/merge-patch+json")

    def plan(self, obj: Mapping[str, Any], force: bool = False) -> Step:
        """What making the object exist as built takes: create it, apply it when it changed (or, with force, in
        any case: a resync that undoes manual edits), or nothing. ForeignObjectError when the name is taken by
        an object that is not the LLMDeployment's."""
        desired = with_desired_hash(obj)
        meta = desired["metadata"]
        current = self.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
        if current is None:
            return Step(desired, None, "create")
        if not owns(desired, current):
            raise ForeignObjectError(
                f"{desired['kind']} {meta['name']} exists and does not belong to this LLMDeployment "
                f"({_owner_of(current)}); it is left alone: delete or rename it")
        same = (current.get("metadata", {}).get("annotations") or {}).get(HASH_ANNOTATION) == \
            meta["annotations"][HASH_ANNOTATION]
        return Step(desired, current, "none" if same and not force else "apply", same)

    def check(self, step: Step) -> None:
        """Have the API server check the step without keeping anything (dry run): KubeError as it answers."""
        if step.action == "create":
            self._create(step.desired, dry_run=True)
        elif step.action == "apply":
            self.apply(step.desired, dry_run=True)

    def carry_out(self, step: Step) -> Outcome:
        """Do the step; "updated" only when the server really changed something."""
        desired, current = step.desired, step.current
        if step.action == "none":
            return "unchanged"
        if step.action == "create":
            try:
                self._create(desired)
                return "created"
            except KubeError as exc:
                if exc.status != 409:  # 409: created meanwhile (another reconcile); apply over it below
                    raise
                current = {}
        applied = self.apply(desired)
        before = (current or {}).get("metadata", {}).get("resourceVersion")
        after = applied.get("metadata", {}).get("resourceVersion")
        return "unchanged" if step.same and before is not None and before == after else "updated"

    def _create(self, desired: Mapping[str, Any], dry_run: bool = False) -> None:
        # Created by server-side apply too, not POST: the API server records the fields an Update (POST) set under
        # a different owner entry than an Apply's, and a later apply removes only the fields its own entry owns. A
        # field dropped from the spec would otherwise stay on the object for good.
        try:
            self.apply(desired, dry_run)
            return
        except KubeError as exc:
            if exc.status != 404:  # 404: a server that does not create on apply (kmock's emulator)
                raise
        self.create(desired, dry_run)


def _write_query(dry_run: bool) -> dict[str, str]:
    return {"fieldManager": MANAGER, **({"dryRun": "All"} if dry_run else {})}


def controller_ref(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The owner reference that controls `obj`, if any."""
    return next((ref for ref in obj.get("metadata", {}).get("ownerReferences") or [] if ref.get("controller")), None)


def _owner_of(obj: Mapping[str, Any]) -> str:
    ref = controller_ref(obj)
    if ref is not None:
        return f"controlled by {ref.get('kind')} {ref.get('name')}, uid {ref.get('uid')}"
    return "not created by this operator"
