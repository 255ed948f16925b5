"""A plain-text progress bar on stderr: redrawn in place on a terminal, a line per quarter otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 30):
        self.total, self.label, self.width = total, label, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done = self.failed = 0
        self.started = time.monotonic()
        self._next_line = 0

    def _line(self) -> str:
        filled = int(self.width * self.done / self.total) if self.total else self.width
        bar = "#" * filled + "." * (self.width - filled)
        return (f"{self.label} [{bar}] {self.done}/{self.total} requests, {self.failed} failed, "
                f"{time.monotonic() - self.started:.1f}s")

    def advance(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if self.tty:
            self.stream.write("\r" + self._line())
            self.stream.flush()
        elif self.done >= self._next_line or self.done == self.total:
            self.stream.write(self._line() + "\n")
            self._next_line = self.done + max(1, self.total // 4)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + self._line() + "\n")
            self.stream.flush()
