"""Paged attention for CPU workers: decode tokens through a small C++ kernel, prefill chunks through SDPA.

The kernel (csrc/paged_decode_cpu.cpp) reads each sequence's keys and values in place from the paged cache,
where the torch reference path (layers/attention.py) first gathers them into a contiguous copy and pads
mixed lengths: that gather and the padded attention were 39% of a 32-request serving run's CPU time.

It is compiled once per machine with torch's cpp_extension (g++ and ninja; ~1 minute) and cached under
TORCH_EXTENSIONS_DIR. `available()` says whether that worked; the engine's "auto" attention backend falls
back to the torch path when it did not (no compiler, say), so a worker never fails for want of it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import platform
import shutil
import threading
from dataclasses import dataclass, field

import torch

from tandem.workers.layers import attention
from tandem.workers.layers.metadata import AttentionMetadata

log = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode_cpu.cpp")
_lock = threading.Lock()
_module = None
_error: str | None = None


def _cpu_tag() -> str:
    """-march=native code runs only on CPUs with the build machine's instruction sets: the build directory
    is keyed by them, so a shared home directory across machines never loads a foreign build."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH. The pip package installs it beside the interpreter, which is not
    on PATH when a virtualenv's programs are run by their full path (.venv/bin/tandem)."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # a dependency; without it the build fails and says so
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load():
    """The compiled extension module, building it on first use; None (and the reason in `build_error()`)
    when it cannot be built here."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                from torch.utils import cpp_extension

                _put_ninja_on_path()
                log.info("loading the CPU paged-attention kernel (compiled on its first use on a machine)")
                _module = cpp_extension.load(
                    name=f"tandem_paged_decode_cpu_{_cpu_tag()}",
                    sources=[_SOURCE],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no ninja, a build error: the torch path still works
                last_line = (str(exc).strip().splitlines() or [""])[-1]  # a compiler error's last line says most
                _error = f"{type(exc).__name__}: {last_line}"
                log.warning("CPU paged-attention kernel unavailable, using the torch path (%s)", _error)
        return _module


def available() -> bool:
    return load() is not None


def build_error() -> str | None:
    return _error


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [B, Hq, D], one token per sequence at position seq_lens[b] - 1 -> [B, Hq, D]."""
    module = _module if _module is not None else load()  # every layer of every step: no lock once loaded
    return module.paged_decode_attention(query.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale)


@dataclass
class _StepPlan:
    """What every layer of a step shares, built at the first layer (see _step_plan)."""

    decode_rows: torch.Tensor | None  # query rows of the decode sequences; None: the whole step is decodes
    block_tables: torch.Tensor | None  # int32 [decodes, max_blocks], None when the step has no decode
    seq_lens: torch.Tensor | None  # int32 [decodes]
    query_starts: list[int]
    masks: dict = field(default_factory=dict)  # prefill chunks' causal masks, see attention.attend_prefill_chunks


def _step_plan(meta: AttentionMetadata) -> _StepPlan:
    plan = meta.__dict__.get("_cpu_attention_plan")
    if plan is None:
        starts = [0, *itertools.accumulate(meta.query_lens_list)]
        decodes = [b for b, query_len in enumerate(meta.query_lens_list) if query_len == 1]
        if len(decodes) == len(starts) - 1:
            plan = _StepPlan(None, meta.block_tables.contiguous(), meta.seq_lens.contiguous(), starts)
        elif decodes:
            seqs = torch.tensor(decodes)
            plan = _StepPlan(torch.tensor([starts[b] for b in decodes]),
                             meta.block_tables.index_select(0, seqs).contiguous(),
                             meta.seq_lens.index_select(0, seqs).contiguous(), starts)
        else:
            plan = _StepPlan(None, None, None, starts)
        meta.__dict__["_cpu_attention_plan"] = plan
    return plan


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Same contract as layers.attention.paged_attention: query [T, Hq, D] -> [T, Hq, D]."""
    plan = _step_plan(meta)
    if plan.block_tables is not None and plan.decode_rows is None:
        return paged_decode_attention(query, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale)
    out = torch.empty_like(query)
    if plan.block_tables is not None:
        out[plan.decode_rows] = paged_decode_attention(
            query.index_select(0, plan.decode_rows), k_cache, v_cache, plan.block_tables, plan.seq_lens, scale
        )
    attention.attend_prefill_chunks(out, query, k_cache, v_cache, meta, scale, plan.query_starts, plan.masks)
    return out
