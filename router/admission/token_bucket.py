"""Per-tenant token buckets, charged in model tokens (prompt + max_tokens) rather than in requests."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

DEFAULT_TENANT = "default"
_DUST = 1e-9


@dataclass(frozen=True)
class RateLimit:
    """Refill at `tokens_per_s`, hold at most `burst` tokens."""

    tokens_per_s: float
    burst: float

    def __post_init__(self):
        if not (math.isfinite(self.tokens_per_s) and self.tokens_per_s > 0):
            raise ValueError(f"tokens_per_s must be a positive rate, got {self.tokens_per_s}")
        if not (math.isfinite(self.burst) and self.burst > 0):
            raise ValueError(f"burst must be a positive number of tokens, got {self.burst}")


class TokenBucket:
    """A token bucket that starts full.

    A charge larger than the whole burst is allowed once the bucket is full and leaves it in debt, so an
    oversized request is slowed to the tenant's rate instead of being refused forever.
    """

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self._clock = clock
        self._level = limit.burst
        self._updated = clock()

    @property
    def level(self) -> float:
        """Tokens available now (negative while in debt)."""
        now = self._clock()
        elapsed = max(0.0, now - self._updated)  # a clock that steps back must not drain the bucket
        self._level = min(self.limit.burst, self._level + elapsed * self.limit.tokens_per_s)
        self._updated = now
        return self._level

    def wait_s(self, charge: float) -> float:
        """Seconds until `charge` can be taken; 0.0 when it can be taken now."""
        if charge < 0:
            raise ValueError(f"charge must be >= 0, got {charge}")
        if charge == 0:  # nothing to take, even from a bucket in debt (a request's later choices: serve)
            return 0.0
        missing = min(charge, self.limit.burst) - self.level
        # Refill arithmetic leaves float dust (a bucket refilled for exactly charge/rate seconds can hold
        # charge - 1e-14 tokens); a billionth of a token is not worth a refusal.
        if missing <= _DUST * max(1.0, charge):
            return 0.0
        return missing / self.limit.tokens_per_s

    def consume(self, charge: float) -> None:
        """Take `charge` tokens; ValueError when wait_s(charge) says it is too early."""
        if self.wait_s(charge) > 0:
            raise ValueError(f"bucket holds {self._level:.1f} tokens, cannot take {charge}")
        self._level -= charge

    def refund(self, charge: float) -> None:
        """Give back a charge taken for work that will not be done (never past a full bucket)."""
        self._level = min(self.limit.burst, self.level + charge)


class TenantRateLimiter:
    """Maps API keys to tenants and keeps one bucket per tenant.

    Keys missing from `api_keys` (authentication is the router's job, not this one's) share the tenant
    "default". A tenant without its own entry in `limits` gets `default_limit`; None means unlimited.
    """

    def __init__(self, api_keys: Mapping[str, str] | None = None, limits: Mapping[str, RateLimit] | None = None,
                 default_limit: RateLimit | None = None, clock: Callable[[], float] = time.monotonic):
        self.api_keys = dict(api_keys or {})
        self.limits = dict(limits or {})
        self.default_limit = default_limit
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def tenant_for(self, api_key: str | None) -> str:
        return self.api_keys.get(api_key, DEFAULT_TENANT) if api_key is not None else DEFAULT_TENANT

    def bucket(self, tenant: str) -> TokenBucket | None:
        """The tenant's bucket, created full on first use; None when the tenant is unlimited."""
        if tenant not in self._buckets:
            limit = self.limits.get(tenant, self.default_limit)
            if limit is None:
                return None
            self._buckets[tenant] = TokenBucket(limit, self._clock)
        return self._buckets[tenant]

    def wait_s(self, tenant: str, charge: float) -> float:
        bucket = self.bucket(tenant)
        return 0.0 if bucket is None else bucket.wait_s(charge)

    def consume(self, tenant: str, charge: float) -> None:
        bucket = self.bucket(tenant)
        if bucket is not None:
            bucket.consume(charge)

    def refund(self, tenant: str, charge: float) -> None:
        bucket = self.bucket(tenant)
        if bucket is not None:
            bucket.refund(charge)
