"""`tandem bench`: run the sweep, write the files, print a summary table."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tandem.bench.config import BenchConfig
from tandem.bench.loadgen import run_bench
from tandem.bench.report import PLOT_NAME, write_results


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def format_summary(doc: dict) -> str:
    head = (f"{'point':>8} {'ok/sent':>8} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'E2E mean':>9} {'in flight':>9} {'SLO met':>7}")
    lines = [head + "   (latencies in ms)", "-" * len(head)]
    for p in doc["points"]:
        s = p["summary"]
        value = p.get("concurrency", p.get("rate"))
        slo = "-" if s.get("slo_attainment") is None else f"{s['slo_attainment'] * 100:.0f}%"
        lines.append(f"{value:>8g} {s['completed']:>4}/{s['requests']:<3} {s['request_throughput'] or 0:>7.2f} "
                     f"{s['output_throughput'] or 0:>9.1f} {_ms(s['ttft_p50_s']):>9} {_ms(s['ttft_p99_s']):>9} "
                     f"{_ms(s['itl_p50_s']):>8} {_ms(s['itl_p99_s']):>8} {_ms(s['e2e_mean_s']):>9} "
                     f"{s['mean_in_flight']:>9.2f} {slo:>7}")
        if s.get("failed"):
            lines.append(f"         {s['failed']} failed: left out of the knee, C_max and plans")
        for error in s.get("errors") or []:
            lines.append(f"         error: {error}")
    a = doc["analysis"]
    knee = "none" if a["knee_concurrency"] is None else f"{a['knee_concurrency']:g}"
    lines.append(f"knee at concurrency {knee}")
    if a["c_max"] is not None:
        lines.append(f"C_max {a['c_max']:g}: usable {a['usable_rps']:.2f} RPS per instance "
                     f"({a['usable_rps_basis']}; E2E {a['e2e_at_c_max_s']:.3f} s)")
    elif doc["conditions"]["slo_ttft_s"] is not None or doc["conditions"]["slo_itl_s"] is not None:
        lines.append("C_max: no measured point meets the SLO")
    bad = [c for c in a["littles_law"] if not c["ok"]]
    for c in bad:
        lines.append(f"Little's law gap at concurrency {c['concurrency']:g}: throughput x latency = "
                     f"{c['implied_concurrency']:.2f} ({c['gap']:.1f}x off)")
    return "\n".join(lines)


def run_bench_command(cfg: BenchConfig) -> int:
    try:
        doc = asyncio.run(run_bench(cfg))
    except ValueError as exc:
        print(f"tandem bench: error: {exc}", file=sys.stderr)
        return 2
    paths = write_results(doc, cfg.out)
    if cfg.plot:
        try:
            from tandem.bench.plots import save_plot
        except ImportError:  # matplotlib is a dev extra; the measurements are in the JSON and CSV anyway
            print("tandem bench: matplotlib is not installed: no bench.png (pip install matplotlib, or pass "
                  "--no-plot)", file=sys.stderr)
        else:
            paths["plot"] = save_plot(doc, Path(cfg.out) / PLOT_NAME)
    print(format_summary(doc))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    # Failed requests are results too (a server refusing load past its limit); only a sweep where nothing
    # completed is an error.
    return 0 if any(p["summary"]["completed"] for p in doc["points"]) else 1
