"""Names and labels of the objects an LLMDeployment owns (one place, so selectors always agree)."""

from __future__ import annotations

from tandem.operator.crd import CRD_GROUP, CRD_KIND, CRD_VERSION

API_VERSION = f"{CRD_GROUP}/{CRD_VERSION}"
KIND = CRD_KIND
MANAGER = "tandem-operator"  # app.kubernetes.io/managed-by and the server-side-apply field manager
OWNER_LABEL = f"{CRD_GROUP}/llmdeployment"
HASH_ANNOTATION = f"{CRD_GROUP}/desired-hash"
CONFIG_HASH_ANNOTATION = f"{CRD_GROUP}/config-hash"
# On a Deployment: the replicas the operator last asked of it. While what it asks stays the same, replicas someone
# else set (an autoscaler, `kubectl scale deployment`) are kept; the operator sets them again only when it asks for
# another number (builders.kept_replicas).
REPLICAS_ANNOTATION = f"{CRD_GROUP}/replicas"
INTERNAL_SECRET_ANNOTATION = f"{CRD_GROUP}/internal-secret"  # the internal-token Secret's uid
OWNED_SELECTOR = f"app.kubernetes.io/managed-by={MANAGER},{OWNER_LABEL}"  # every object an LLMDeployment owns

POOLS = ("prefill", "decode")
COMPONENTS = ("prefill", "decode", "router")
HTTP_PORT = 8000  # every container listens here, named "http"
# Services are DNS-1035 labels (<= 63 characters) and the longest suffix we add is "-prefill".
MAX_NAME_LENGTH = 63 - len("-prefill")


def object_name(name: str, component: str) -> str:
    return f"{name}-{component}"


def config_map_name(name: str) -> str:
    return f"{name}-config"


def internal_secret_name(name: str) -> str:
    """The Secret holding the deployment's internal-endpoint token (tandem.server.internal_auth)."""
    return f"{name}-internal"


def discovery_role_name(name: str) -> str:
    return f"{name}-router-discovery"


def selector_labels(name: str, component: str) -> dict[str, str]:
    """The immutable subset: Deployment selectors, Service selectors and PDBs use exactly these."""
    return {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def labels(name: str, component: str) -> dict[str, str]:
    return {**selector_labels(name, component), "app.kubernetes.io/part-of": "tandem",
            "app.kubernetes.io/managed-by": MANAGER, OWNER_LABEL: name}


def workers_selector(name: str) -> str:
    """Both pools' worker pods, as a label selector string (status.selector: the scale subresource's): the pools'
    selector_labels, their component as a set."""
    shared = [f"{k}={v}" for k, v in selector_labels(name, "").items() if k != "app.kubernetes.io/component"]
    return ",".join([*shared, f"app.kubernetes.io/component in ({','.join(POOLS)})"])


def pool_selector(name: str, pool: str) -> str:
    """The router's EndpointSlice label selector for one pool: slices carry their Service's name."""
    return f"kubernetes.io/service-name={object_name(name, pool)}"
