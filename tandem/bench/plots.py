"""Latency-throughput plots of a bench result: throughput, TTFT and ITL against concurrency.

The figure is a pure function of the result document, so a test can rebuild it from bench.json and check
the data behind each line. Marked: the SLO targets (horizontal), the knee (dotted) and C_max (dashed)
verticals, the usable RPS at C_max, and the conditions in the title.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402


def _series(points: list[dict], key: str) -> tuple[list[float], list[float]]:
    pairs = sorted((p["summary"]["concurrency"], p["summary"].get(key)) for p in points
                   if p["summary"].get(key) is not None and p["summary"].get("concurrency"))
    return [x for x, _ in pairs], [y for _, y in pairs]


def _title(doc: dict) -> str:
    c = doc["conditions"]
    sweep = f"{c['sweep']} sweep {', '.join(f'{v:g}' for v in c['values'])}"
    if c.get("arrival"):
        sweep += f" ({c['arrival']} arrivals)"
    return (f"{c['model']} via {c['endpoint']} at {c['url']}\n"
            f"input {c['input_dist']}, output {c['output_dist']}, {c['requests_per_point']} requests/point "
            f"(+{c['warmup_per_point']} warm-up); {sweep}; client {c['client']['host']}, "
            f"{c['client']['cpu_count']} CPUs")


def plot_curves(doc: dict) -> Figure:
    c, analysis = doc["conditions"], doc.get("analysis") or {}
    fig, (ax_tp, ax_ttft, ax_itl) = plt.subplots(1, 3, figsize=(16, 5), constrained_layout=True)
    fig.suptitle(_title(doc), fontsize=9)
    xlabel = "concurrency (requests in flight)" if c["sweep"] == "concurrency" else "mean requests in flight"

    xs, ys = _series(doc["points"], "request_throughput")
    ax_tp.plot(xs, ys, "o-", color="tab:blue", label="request throughput")
    ax_tp.set_ylabel("requests/s")
    tok = ax_tp.twinx()
    xs_t, ys_t = _series(doc["points"], "output_throughput")
    tok.plot(xs_t, ys_t, "s--", color="tab:green", label="output tokens/s")
    tok.set_ylabel("output tokens/s")
    ax_tp.set_title("throughput")

    for ax, metric, slo in ((ax_ttft, "ttft", c.get("slo_ttft_s")), (ax_itl, "itl", c.get("slo_itl_s"))):
        for pct, style in (("p50", "o-"), ("p99", "^-")):
            xs_l, ys_l = _series(doc["points"], f"{metric}_{pct}_s")
            ax.plot(xs_l, ys_l, style, label=f"{metric.upper()} {pct}")
        if slo is not None:
            ax.axhline(slo, color="tab:red", linewidth=1, label=f"SLO {slo:g} s")
        ax.set_ylabel("seconds")
        ax.set_title(metric.upper())

    knee, c_max = analysis.get("knee_concurrency"), analysis.get("c_max")
    for ax in (ax_tp, ax_ttft, ax_itl):
        if knee is not None:
            ax.axvline(knee, color="gray", linestyle=":", label=f"knee {knee:g}")
        if c_max is not None:
            ax.axvline(c_max, color="tab:red", linestyle="--", label=f"C_max {c_max:g}")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    if c_max is not None and analysis.get("usable_rps") is not None:
        usable = analysis["usable_rps"]
        ax_tp.plot([c_max], [usable], "*", color="tab:red", markersize=12,
                   label=f"usable {usable:.2f} RPS at C_max")
    ax_tp.set_ylim(bottom=0)
    tok.set_ylim(bottom=0)
    if xs and max(xs) >= 8 * min(xs):  # wide sweeps (1, 2, 4, ... 128) read better on a log axis
        for ax in (ax_tp, ax_ttft, ax_itl):
            ax.set_xscale("log", base=2)
    handles, labels = ax_tp.get_legend_handles_labels()
    more_h, more_l = tok.get_legend_handles_labels()
    ax_tp.legend(handles + more_h, labels + more_l, fontsize=7, loc="lower right")
    ax_ttft.legend(fontsize=7)
    ax_itl.legend(fontsize=7)
    return fig


def save_plot(doc: dict, path: str | Path) -> Path:
    fig = plot_curves(doc)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return Path(path)
