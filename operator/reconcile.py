"""One reconcile pass and one status refresh: what the kopf handlers call (no kopf in here)."""

from __future__ import annotations

import dataclasses
import datetime
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tandem.operator import names
from tandem.operator.builders import INTERNAL_TOKEN_KEY, Owner, build_objects, kept_replicas
from tandem.operator.kube import ForeignObjectError, Kube, KubeError, Outcome, Step, controller_ref, owns
from tandem.operator.scaling import planned_sizes
from tandem.operator.status import Problem, compute_status, same_status
from tandem.operator.validation import SpecError, built_object_reasons, validate_spec


def owner_of(body: Mapping[str, Any]) -> Owner:
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


class RefusedSpec(SpecError):
    """A spec that validates but builds objects the API server refuses (a toleration, an affinity or an env entry
    passed through as written): nothing is applied, as for any invalid spec."""


def reconcile(kube: Kube, body: Mapping[str, Any], force: bool = False) -> list[tuple[Outcome, dict]]:
    """Bring every owned object in line with the spec. Raises SpecError (RefusedSpec when the API server refuses an
    object as built) before anything is applied, and ForeignObjectError when a name is taken by an object that is
    not this LLMDeployment's. Each changed Deployment is checked by a dry run first, so that a spec the API server
    refuses changes nothing: not a prefill pool on the new spec and a decode pool still on the old one. Only the
    Deployments: they carry what the spec passes through as written (tolerations, affinity, nodeSelector, env,
    resources); the other objects are the operator's own, and some cannot be checked before the objects they
    refer to exist (a RoleBinding's dry run is refused while its Role is not there)."""
    owner = owner_of(body)
    spec, sizes = validate_spec(body.get("spec"), owner.name)
    secret = current_internal_secret(kube, owner)
    secret_uid = secret["metadata"]["uid"] if secret is not None else None
    sizes = planned_sizes(spec, sizes, body.get("status"))
    objects = build_objects(owner, spec, sizes, secret_uid)
    reasons = built_object_reasons(objects)
    if reasons:
        raise RefusedSpec(reasons)
    steps = _plan(kube, objects, force)
    for step in steps:
        if step.desired["kind"] not in CHECKED_KINDS:
            continue
        try:
            kube.check(step)
        except KubeError as exc:
            if not exc.invalid:
                raise
            reasons.append(f"the API server refuses {step.label}: {exc.message}")
    if reasons:
        raise RefusedSpec(reasons)
    # Made or adopted only now, so that a refused spec changes nothing at all.
    if secret is None:
        secret_uid = create_internal_secret(kube, owner)
        steps = _plan(kube, build_objects(owner, spec, sizes, secret_uid), force)
    elif controller_ref(secret) is None:
        kube.apply(_internal_secret(owner))  # the owner reference back (and our labels): the data stays as it is
    return [(kube.carry_out(step), step.desired) for step in steps]


def _plan(kube: Kube, objects: list[dict], force: bool) -> list[Step]:
    """Each object's step, the Deployments' replicas left as someone else set them (keep_replicas)."""
    return [keep_replicas(kube.plan(obj, force=force)) for obj in objects]


def keep_replicas(step: Step) -> Step:
    """A Deployment step that leaves the Deployment's replicas alone while the operator asks for the number it asked
    for before (builders.kept_replicas): a resync (force) or a change of the pod template must not undo what an
    autoscaler did. The desired hash stays the one of what the operator asks: a kept number is no change."""
    if step.desired["kind"] != "Deployment" or step.current is None:
        return step
    asked = step.desired["spec"]["replicas"]
    replicas = kept_replicas(step.current, asked)
    if replicas == asked:
        return step
    return dataclasses.replace(step, desired={**step.desired, "spec": {**step.desired["spec"], "replicas": replicas}})


# What the dry run checks: the objects that carry what the spec passes through as written (a Deployment's
# tolerations, affinity, env and resources; the router Service's annotations and source ranges).
CHECKED_KINDS = ("Deployment", "Service")


def _internal_secret(owner: Owner) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": names.internal_secret_name(owner.name), "namespace": owner.namespace,
                         "labels": names.labels(owner.name, "router"), "ownerReferences": [owner.reference()]}}


def current_internal_secret(kube: Kube, owner: Owner) -> dict | None:
    """The deployment's internal-endpoint token Secret (tandem.server.internal_auth), None while there is none. An orphan
    of this deployment (its LLMDeployment deleted with --cascade=orphan and made again) is its own, to be adopted as
    it is, token included, so that no pod restarts for it. A Secret of that name that is not this deployment's is
    refused as any other foreign object is."""
    desired = _internal_secret(owner)
    current = kube.get("v1", "Secret", owner.namespace, desired["metadata"]["name"])
    if current is not None and not owns(desired, current):
        raise ForeignObjectError(f"Secret {owner.namespace}/{desired['metadata']['name']} exists and does not "
                                 "belong to this LLMDeployment; rename or delete it")
    return current


def create_internal_secret(kube: Kube, owner: Owner) -> str:
    """Made once, never applied again: a new token on every reconcile would restart every pod, and pods started with
    different tokens could not talk. Owned by the LLMDeployment, so it goes with it."""
    created = kube.create({**_internal_secret(owner), "stringData": {INTERNAL_TOKEN_KEY: secrets.token_urlsafe(32)}})
    return created["metadata"]["uid"]


def observe(kube: Kube, namespace: str, name: str) -> tuple[dict[str, dict], dict | None]:
    """The owned Deployments by component, and the router Service (None when absent)."""
    deployments = {}
    for item in kube.list("apps/v1", "Deployment", namespace, {names.OWNER_LABEL: name}):
        component = (item["metadata"].get("labels") or {}).get("app.kubernetes.io/component")
        if component in names.COMPONENTS:
            deployments[component] = item
    service = kube.get("v1", "Service", namespace, names.object_name(name, "router"))
    return deployments, service


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


class StatusKeeper:
    """Writes an LLMDeployment's status from what is observed, one writer per object at a time.

    Both the reconcile handler and the Deployment watch refresh the status; serialising them per object and
    reading the cluster inside the lock means the last write always reflects the newest observation.
    """

    def __init__(self, kube: Kube, clock: Callable[[], str] = utc_now):
        self.kube = kube
        self.clock = clock
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()
        self._problems: dict[tuple[str, str], Problem] = {}  # by object: the last reconcile's, if it failed
        self._retry_at: dict[tuple[str, str], float] = {}  # by object: when to apply again what failed to apply

    def note(self, namespace: str, name: str, problem: Problem | None, retry_in_s: float | None = None) -> None:
        """The outcome of a reconcile, for the statuses written from now on (None: it went through), and when to
        try it again (`retry_in_s`; None: not until something changes)."""
        key = (namespace, name)
        if problem is None:
            self._problems.pop(key, None)
        else:
            self._problems[key] = problem
        if problem is None or retry_in_s is None:
            self._retry_at.pop(key, None)
        else:
            self._retry_at[key] = time.monotonic() + retry_in_s

    def problem(self, namespace: str, name: str) -> Problem | None:
        return self._problems.get((namespace, name))

    def retry_due(self, namespace: str, name: str) -> bool:
        """Whether an apply that failed is due to be tried again."""
        at = self._retry_at.get((namespace, name))
        return at is not None and time.monotonic() >= at

    def forget(self, namespace: str, name: str) -> None:
        """Drops what is kept for a deleted LLMDeployment: an operator that runs for months sees many come and go.
        Its lock stays while anyone holds it (a second writer must not get a lock of its own meanwhile); the
        DELETED event that comes after the last write finds it free."""
        key = (namespace, name)
        with self._guard:
            lock = self._locks.get(key)
            if lock is not None and not lock.locked():
                del self._locks[key]
        self._problems.pop(key, None)
        self._retry_at.pop(key, None)

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def lock(self, namespace: str, name: str) -> threading.Lock:
        """Held by every status writer of one object (the planner takes it for status.planner)."""
        return self._lock(namespace, name)

    def refresh(self, namespace: str, name: str, generation: int | None = None) -> dict | None:
        """Recompute and write the status; returns it, or None when the LLMDeployment is gone."""
        with self._lock(namespace, name):
            body = self.kube.get(names.API_VERSION, names.KIND, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                self.forget(namespace, name)  # a new one of that name starts afresh
                return None
            deployments, service = observe(self.kube, namespace, name)
            status = compute_status(body, deployments, service, self.clock(), generation,
                                    self._problems.get((namespace, name)))
            if not same_status(body.get("status"), status):
                self.kube.patch_status(names.API_VERSION, names.KIND, namespace, name, status)
            return status
