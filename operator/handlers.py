"""Thin kopf handlers: each one calls `reconcile` / `StatusKeeper` and reports what it did as an event."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf
import kubernetes.client

from tandem.operator import names
from tandem.operator.crd import CRD_GROUP, CRD_PLURAL, CRD_VERSION
from tandem.operator.kube import ForeignObjectError, Kube, KubeError, Outcome
from tandem.operator.planner import Planner
from tandem.operator.reconcile import RefusedSpec, StatusKeeper, reconcile
from tandem.operator.status import Problem
from tandem.operator.validation import SpecError

RESOURCE = (CRD_GROUP, CRD_VERSION, CRD_PLURAL)
OWNED = {"app.kubernetes.io/managed-by": names.MANAGER, names.OWNER_LABEL: kopf.PRESENT}
EVENT_REASONS: dict[Outcome, str] = {"created": "Created", "updated": "Updated"}
# The owned kinds put back as soon as they are deleted: what the status reads, and what pods need to start (the
# routers mount the ConfigMap; every pod reads the token Secret).
WATCHED = (("apps", "v1", "deployments"), ("", "v1", "services"), ("", "v1", "configmaps"), ("", "v1", "secrets"))
RETRY_SECONDS = 10  # API hiccups (409/429/5xx)
SLOW_RETRY_SECONDS = 120  # other API refusals (RBAC, admission): retried, but never in a storm
RETRY_CHECK_SECONDS = 2  # how often the retry timer looks whether a failed apply is due (a retry is that much late)


def connection_info(config: kubernetes.client.Configuration) -> kopf.ConnectionInfo:
    """kopf's own API client authenticates exactly as the operator's kubernetes client does."""
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(
        server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
        username=config.username or None, password=config.password or None, scheme=scheme, token=token,
        certificate_path=config.cert_file, private_key_path=config.key_file)


def _report(body: Mapping[str, Any], outcomes: list[tuple[Outcome, dict]], reasons=EVENT_REASONS) -> None:
    for outcome, obj in outcomes:
        if outcome in reasons:
            kopf.event(dict(body), type="Normal", reason=reasons[outcome],
                       message=f"{obj['kind']} {obj['metadata']['name']}")


def _condition(body: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    """The status condition of type `kind` as `body` holds it ({} if none)."""
    conditions = (body.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), {})


def _failed(keeper: StatusKeeper, body: Mapping[str, Any], exc: Exception, refused: bool, reason: str,
            retry_in_s: float | None = None) -> None:
    """A reconcile that could not be carried out: noted for the status (and for the retry timer, with
    `retry_in_s`), the status written, and a warning event, once per problem rather than at every retry."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    problem = Problem(refused=refused, message=str(exc))
    known = keeper.problem(namespace, name)
    keeper.note(namespace, name, problem, retry_in_s)
    keeper.refresh(namespace, name)
    if problem != known:
        kopf.warn(dict(body), reason=reason, message=str(exc))


def _apply(kube: Kube, keeper: StatusKeeper, body: Mapping[str, Any],
           force: bool = False) -> tuple[list[tuple[Outcome, dict]], int | None]:
    """One reconcile, its outcome noted for the status, and the generation of the spec it applied whole. SpecError
    goes to the caller; an API failure becomes an ApplyFailed event, a Degraded status and a kopf retry."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    try:
        # The event that brought `body` may predate a newer spec (a resync timer fires with what it read), or
        # the planner's latest decision (status.planner holds its sizes): applying it would put the older one
        # back. So every reconcile reads the resource fresh, under the lock the planner decides under.
        with keeper.lock(namespace, name):
            current = kube.get(names.API_VERSION, names.KIND, namespace, name) or body
            outcomes = reconcile(kube, current, force=force)
    except RefusedSpec as exc:
        keeper.note(namespace, name, Problem(refused=True, message=str(exc)))
        raise
    except SpecError:
        keeper.note(namespace, name, None)  # the status finds this one in the spec itself
        raise
    except (KubeError, ForeignObjectError) as exc:
        delay = RETRY_SECONDS if exc.retriable else SLOW_RETRY_SECONDS
        _failed(keeper, body, exc, refused=False, reason="ApplyFailed", retry_in_s=delay)
        raise kopf.TemporaryError(str(exc), delay=delay) from None
    keeper.note(namespace, name, None)
    return outcomes, current["metadata"].get("generation")


def build_registry(kube: Kube, keeper: StatusKeeper, resync_seconds: float | None = 300.0,
                   planner: Planner | None = None) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_):
        return connection_info(kube.api.configuration)

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, registry=registry)
    def spec_changed(body, meta, name, namespace, **_):
        try:
            outcomes, applied = _apply(kube, keeper, body)
        except SpecError as exc:
            # Nothing is created; the reason goes to the status and an event, and kopf does not retry
            # until the spec changes again. The event is posted once per reason and generation: an edit of the
            # object's labels, or an operator restart, handles the same spec again, and the status already says
            # it; a new spec that fails alike is a new attempt, and gets its event.
            said = _condition(body, "SpecValid")
            keeper.refresh(namespace, name, generation=meta.get("generation"))
            if (said.get("status"), said.get("message"), said.get("observedGeneration")) != (
                    "False", str(exc), meta.get("generation")):
                kopf.warn(dict(body), reason="InvalidSpec", message=str(exc))
            raise kopf.PermanentError(f"invalid spec: {exc}") from None
        _report(body, outcomes)
        keeper.refresh(namespace, name, generation=applied)

    # A spec applied whole by any handler is the generation now running (status.compute_status reads Ready from
    # it): not only the spec handler's. One that failed, then was reverted before a retry applied it, gets no spec
    # handler call again (kopf sees no change), and its status would otherwise stay behind for good.

    def owned_object_changed(type, body, namespace, **_):
        owner = body["metadata"]["labels"][names.OWNER_LABEL]
        applied = None
        if type == "DELETED":  # someone removed an object we own: put it back
            parent = kube.get(names.API_VERSION, names.KIND, namespace, owner)
            if parent is not None and not parent["metadata"].get("deletionTimestamp"):
                try:
                    outcomes, applied = _apply(kube, keeper, parent)
                    _report(parent, outcomes)
                except SpecError:
                    pass  # the status already says why; nothing to restore from a bad spec
                except kopf.TemporaryError:
                    pass  # noted: retry_failed_apply tries again (kopf does not retry an event handler)
        keeper.refresh(namespace, owner, generation=applied)

    @kopf.on.event(*RESOURCE, registry=registry)
    def resource_event(type, body, name, namespace, **_):
        if type != "DELETED":  # its owned objects go with it (owner references); what is kept for it here too
            return
        if planner is not None:
            planner.forget(body["metadata"]["uid"])
        # Kept by name: unless a new object of that name has come meanwhile (its state is not the old one's).
        if kube.get(names.API_VERSION, names.KIND, namespace, name) is None:
            keeper.forget(namespace, name)

    for group, version, plural in WATCHED:
        kopf.on.event(group, version, plural, labels=OWNED, registry=registry)(owned_object_changed)

    @kopf.timer(*RESOURCE, interval=RETRY_CHECK_SECONDS, registry=registry)
    def retry_failed_apply(body, name, namespace, **_):
        """An apply that failed for the API's sake (a conflict, an outage, a name taken by another object) is tried
        again whichever handler met it. kopf retries its spec handlers itself, but not the watch that puts back a
        deleted object, nor the planner's resize (whose sizes status.planner already holds)."""
        if not keeper.retry_due(namespace, name):
            return
        try:
            outcomes, applied = _apply(kube, keeper, body)
        except (kopf.TemporaryError, SpecError):
            return  # noted again, and due again later; or the status says why
        _report(body, outcomes)
        keeper.refresh(namespace, name, generation=applied)

    if resync_seconds:
        @kopf.timer(*RESOURCE, interval=resync_seconds, initial_delay=resync_seconds, registry=registry)
        def resync(body, name, namespace, **_):
            """Undo manual edits of owned objects (server-side apply with force is a no-op otherwise)."""
            applied = None
            try:
                outcomes, applied = _apply(kube, keeper, body, force=True)
                _report(body, outcomes, {"created": "Created", "updated": "DriftCorrected"})
            except SpecError:
                pass
            keeper.refresh(namespace, name, generation=applied)

    if planner is not None:
        @kopf.timer(*RESOURCE, interval=planner.tick_s, registry=registry)
        def plan(body, name, namespace, **_):
            """Planner mode: resize the pools from the measured load (each resource at its own interval)."""
            if not planner.due(body):
                return
            try:
                decision = planner.tick(namespace, name)
            except SpecError as exc:  # the API server refuses the objects at the new sizes: said, not retried
                _failed(keeper, body, exc, refused=True, reason="PlannerFailed")
                return
            except (KubeError, ForeignObjectError) as exc:  # applied by retry_failed_apply once it goes through
                _failed(keeper, body, exc, refused=False, reason="PlannerFailed",
                        retry_in_s=RETRY_SECONDS if exc.retriable else SLOW_RETRY_SECONDS)
                return
            if decision is not None and decision.changed:
                kopf.event(dict(body), type="Normal", reason="Scaled", message=decision.message())
                keeper.refresh(namespace, name)

    return registry
