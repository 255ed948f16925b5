"""A small synchronous Kubernetes API client for the kinds the operator owns (plain dicts in and out).

It rides on the official client's ApiClient for configuration and authentication (in-cluster service
account, kubeconfig, exec plugins, token refresh) and speaks REST directly, so one code path serves every
kind. Kopf runs sync handlers in worker threads, where blocking calls are fine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

import kubernetes.client
import kubernetes.config

from tandem.config import CRD_PLURAL
from tandem.operator.builders import short_hash
from tandem.operator.names import API_VERSION, HASH_ANNOTATION, KIND, MANAGER

PLURALS = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("discovery.k8s.io/v1", "EndpointSlice"): "endpointslices",  # read only: the planner's scrape targets
    (API_VERSION, KIND): CRD_PLURAL,
}

Outcome = Literal["created", "updated", "unchanged"]


class KubeError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, method: str, path: str, message: str):
        self.status = status
        super().__init__(f"{method} {path} -> {status}: {message}")

    @property
    def retriable(self) -> bool:
        return self.status in (409, 429) or self.status >= 500


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

    def create(self, obj: Mapping[str, Any]) -> dict:
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return self.request("POST", path, body=dict(obj), query={"fieldManager": MANAGER})

    def apply(self, obj: Mapping[str, Any]) -> dict:
        """Server-side apply: fields the operator set before and no longer sets are removed, and fields
        someone else changed are taken back (force)."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return self.request("PATCH", path, body=dict(obj), query={"fieldManager": MANAGER, "force": "true"},
                            content_type="application/apply-patch+yaml")

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str, status: Mapping) -> dict:
        path = resource_path(api_version, kind, namespace, name, "status")
        return self.request("PATCH", path, body={"status": dict(status)},
                            content_type="application/merge-patch+json")

    def ensure(self, obj: Mapping[str, Any], force: bool = False) -> Outcome:
        """Make the object exist as built: create it, apply it when it changed, or leave it alone.

        With force, apply even when the hash matches (a resync that undoes manual edits); the answer is
        then "updated" only when the server really changed something.
        """
        desired = with_desired_hash(obj)
        meta = desired["metadata"]
        current = self.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
        if current is None:
            # Created by server-side apply too, not POST: the API server records the fields an Update (POST)
            # set under a different owner entry than an Apply's, and a later apply removes only the fields its
            # own entry owns. A field dropped from the spec would otherwise stay on the object for good.
            try:
                self.apply(desired)
                return "created"
            except KubeError as exc:
                if exc.status != 404:  # 404: a server that does not create on apply (kmock's emulator)
                    raise
            try:
                self.create(desired)
                return "created"
            except KubeError as exc:
                if exc.status != 409:  # 409: created meanwhile (another reconcile); apply over it below
                    raise
                current = {}
        same = (current.get("metadata", {}).get("annotations") or {}).get(HASH_ANNOTATION) == \
            meta["annotations"][HASH_ANNOTATION]
        if same and not force:
            return "unchanged"
        applied = self.apply(desired)
        before = current.get("metadata", {}).get("resourceVersion")
        after = applied.get("metadata", {}).get("resourceVersion")
        return "unchanged" if same and before is not None and before == after else "updated"
