"""What a routing policy is: the choice of a worker for a prefill, for a colocated request, and for a decode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tandem.router.pool import WorkerPool


@dataclass
class Placement:
    """A request to place on a pool: its routing key and block hashes (Orchestrator.plan), its prompt length
    (prompt + tokens so far, on a resume), the workers not to use, and whether it will also decode there."""

    key: int
    hashes: list[int]
    prompt_len: int
    exclude: set[str] = field(default_factory=set)
    decodes_here: bool = False


class RoutingPolicy(Protocol):
    """Chooses workers; the orchestrator does the rest (retries, migrations, bookkeeping)."""

    name: str

    def place(self, pool: WorkerPool, request: Placement) -> str | None:
        """The worker that computes the prompt (a prefill, or a colocated request); None: no worker to use."""

    def pick_decode(self, pool: WorkerPool, needed_blocks: int, exclude: set[str]) -> str | None:
        """The decode worker that pulls a prefilled request's KV (`needed_blocks` blocks); None: no worker."""


def usable(pool: WorkerPool, exclude: set[str]) -> list[str]:
    """The pool's workers in rotation less `exclude`, in URL order."""
    return sorted(w.url for w in pool.healthy() if w.url not in exclude)
