"""SLO-aware admission control: SLO classes, an EDF queue, service-rate estimates, token buckets."""

from tandem.router.admission.controller import (
    AdmissionController,
    AdmissionRequest,
    Admit,
    Reject,
    RejectReason,
)
from tandem.router.admission.edf_queue import EDFQueue, QueueFullError
from tandem.router.admission.rates import EWMARate, ServiceRates
from tandem.router.admission.slo import BATCH, DEFAULT_SLO_CLASSES, INTERACTIVE, SLOClass
from tandem.router.admission.token_bucket import DEFAULT_TENANT, RateLimit, TenantRateLimiter, TokenBucket

__all__ = [
    "BATCH", "DEFAULT_SLO_CLASSES", "DEFAULT_TENANT", "INTERACTIVE", "Admit", "AdmissionController",
    "AdmissionRequest", "EDFQueue", "EWMARate", "QueueFullError", "RateLimit", "Reject", "RejectReason",
    "SLOClass", "ServiceRates", "TenantRateLimiter", "TokenBucket",
]
