"""Opening a GGUF file: gguf-py's reader, its memory map seen as a plain ndarray.

The reader slices its map once or twice per string of the metadata: about 200,000 slices for a 49,152-token
vocabulary and its merges (SmolLM2). numpy.memmap runs Python-level `__getitem__` and `__array_finalize__` on
each: the read took 3.3x as long as over plain views (benchmarks/startup.py; docs/benchmarks.md, "Start-up").
A plain view of the same pages reads the same bytes, copies nothing, and keeps the map open through its base.
The router (its tokenizer) and the workers (weights and tokenizer) both open their file here.
"""

from __future__ import annotations

import os

import numpy as np
from gguf import GGUFReader


class _PlainViewReader(GGUFReader):
    """GGUFReader whose `data` (set once, to the file's np.memmap, in its constructor) is kept as a plain
    ndarray view: every field and tensor sliced from it then is one too."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def open_gguf(path: str) -> GGUFReader:
    """The file's reader; ValueError naming the file when it is missing or not GGUF."""
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist")
    try:
        return _PlainViewReader(path)
    except Exception as exc:  # the reader raises assorted errors on a file that is not GGUF
        raise ValueError(f"{path!r} is not a readable GGUF file: {exc}") from exc
