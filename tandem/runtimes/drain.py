"""`tandem drain`: what a worker pod's preStop hook runs before Kubernetes sends SIGTERM.

It marks the worker draining (its /ready turns 503, so routers stop dispatching to it at their
next probe) and waits until the requests it already has are finished, or the timeout passes.
"""

from __future__ import annotations

import sys
import time

import httpx

from tandem.server.internal_auth import internal_headers


def without_boilerplate(exc: httpx.HTTPError) -> str:
    """httpx's error text without the line it adds to a status error ("For more information check:
    https://developer.mozilla.org/..."), which says nothing about this worker."""
    return str(exc).split("\nFor more information", 1)[0].strip()


def drain(url: str, timeout_s: float, poll_s: float = 0.5) -> int:
    url = url.rstrip("/")
    try:
        httpx.post(f"{url}/internal/drain", timeout=5, headers=internal_headers()).raise_for_status()
    except httpx.HTTPError as exc:
        status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
        if status in (401, 403):
            # Not a worker gone but a setup fault (this pod's TANDEM_INTERNAL_TOKEN is not its worker's):
            # the non-zero exit is what makes Kubernetes say so, in a FailedPreStopHook event.
            print(f"tandem drain: {url} refused the internal token ({status}); "
                  "TANDEM_INTERNAL_TOKEN differs from the worker's, so it stops without draining", file=sys.stderr)
            return 1
        if status == 404:
            # Something answers there, but not a worker (a router's URL, a typo'd port): a drain that did nothing
            # must not pass for one.
            print(f"tandem drain: {url} is not a Tandem worker (it has no /internal/drain route: 404); "
                  "nothing was drained", file=sys.stderr)
            return 1
        print(f"tandem drain: {url} did not accept the drain ({without_boilerplate(exc)}); nothing to wait for")
        return 0
    deadline = time.monotonic() + timeout_s
    in_flight = None
    while time.monotonic() < deadline:
        try:
            in_flight = httpx.get(f"{url}/internal/load", timeout=5, headers=internal_headers()).json()["in_flight"]
        except (httpx.HTTPError, ValueError, KeyError):
            break  # the worker is gone: nothing left to wait for
        if in_flight == 0:
            print(f"tandem drain: {url} is idle")
            return 0
        time.sleep(poll_s)
    print(f"tandem drain: gave up after {timeout_s:g}s with {in_flight} request(s) in flight")
    return 0  # the pod stops either way: a slow drain is not a failure to report
