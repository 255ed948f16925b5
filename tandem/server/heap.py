"""The cyclic garbage collector in a serving process (router or worker): its start-up heap frozen, its pauses
observed.

A collection holds the GIL for as long as it walks its objects, so it pauses the event loop (every request) and,
on a worker, the engine thread's steps as well. Two things make those pauses long or frequent in a server:
- Start-up leaves a large heap that lives as long as the process (a worker's model code, torch, the tokenizer).
  Frozen (gc.freeze), it is out of every later collection's sight. Router and worker log at start-up how many
  objects that is and how long the full collection before the freeze took: what each full collection would have
  cost while serving.
- Requests in flight come and go by the hundred objects each; with CPython's default, a young collection runs each
  time 700 more objects are alive than at the last one, i.e. every few requests under load, and pushes the
  in-flight requests' objects into the older generations, which then fill and are walked in turn, though reference
  counting frees nearly all of them moments later. The router raises that threshold (tandem.router.main).
Every collection's duration is observed in a histogram by generation (tandem.metrics), so a pause that shows in
the tail latency shows there too.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence


def settle_heap(pauses: Sequence, young_threshold: int | None = None) -> str:
    """Call once start-up is done, before serving: collect, freeze what is left, optionally collect the youngest
    generation only per `young_threshold` net new objects, and observe every later collection in
    `pauses[generation]` (histogram children). Returns a line for the log: what was frozen."""
    started = time.perf_counter()
    gc.collect()
    full_collection_s = time.perf_counter() - started
    gc.freeze()
    if young_threshold is not None:
        gc.set_threshold(young_threshold, *gc.get_threshold()[1:])
    gc.callbacks.append(pause_recorder(pauses))
    return (f"start-up heap frozen: {gc.get_freeze_count():,} objects no collection walks again (a full collection "
            f"of them took {full_collection_s * 1000:.0f} ms)")


def pause_recorder(pauses: Sequence) -> Callable[[str, dict], None]:
    """A gc.callbacks entry observing each collection's duration in `pauses[generation]`. It runs in whichever
    thread the collection started in; CPython starts no collection inside another, so it cannot re-enter. The
    children are bound in advance: no label lookup, and no lock but the histogram's own."""
    started = 0.0

    def record(phase: str, info: dict) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            pauses[info["generation"]].observe(time.perf_counter() - started)

    return record
