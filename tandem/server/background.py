"""Fire-and-forget tasks, kept alive until they finish.

The event loop holds only weak references to its tasks, so one that nothing else references can be
garbage-collected before it is done (the warning on asyncio.create_task). Aborts, lease releases and
wake-ups sent on their way are started here, which keeps them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine

_running: set[asyncio.Task] = set()


def spawn(coro: Coroutine) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(coro)
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task
