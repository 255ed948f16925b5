"""Bench results on disk (bench.json, summary.csv, requests.csv) and the curve analysis they carry."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tandem.planning.curves import find_c_max, find_knee, littles_law_check, points_from_document

JSON_NAME, SUMMARY_CSV, REQUESTS_CSV, PLOT_NAME = "bench.json", "summary.csv", "requests.csv", "bench.png"


def analyze(summaries: list[dict], slo_ttft_s: float | None, slo_itl_s: float | None,
            percentile: str = "p99") -> dict:
    """The knee, C_max, usable RPS at C_max and Little's law per point, from the point summaries."""
    result: dict = {"knee_concurrency": None, "c_max": None, "usable_rps": None, "usable_rps_basis": None,
                    "e2e_at_c_max_s": None, "littles_law": []}
    try:
        points = points_from_document({"points": summaries})
    except ValueError:
        return result  # no completed request anywhere: nothing to analyse
    knee = find_knee([p.concurrency for p in points], [p.request_throughput or 0.0 for p in points])
    result["knee_concurrency"] = None if knee is None else points[knee].concurrency
    if slo_ttft_s is not None or slo_itl_s is not None:
        best = find_c_max(points, slo_ttft_s, slo_itl_s, percentile)
        if best is not None:
            result.update(c_max=best.concurrency, usable_rps=best.usable_rps, usable_rps_basis=best.usable_rps_basis,
                          e2e_at_c_max_s=best.e2e_mean_s)
    for p in points:
        if p.request_throughput is not None:
            check = littles_law_check(p.concurrency, p.request_throughput, p.e2e_mean_s)
            result["littles_law"].append({"concurrency": p.concurrency, "implied_concurrency":
                                          check.implied_concurrency, "gap": check.gap, "ok": check.ok})
    return result


def _csv_value(value):
    if isinstance(value, list):
        return ";".join(str(v) for v in value)
    return value


def write_results(doc: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write bench.json, summary.csv (one row per point) and requests.csv (one row per request)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / JSON_NAME, "summary_csv": out / SUMMARY_CSV, "requests_csv": out / REQUESTS_CSV}
    paths["json"].write_text(json.dumps(doc, indent=1))

    summaries = [p["summary"] for p in doc["points"]]
    with paths["summary_csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["point", *summaries[0]] if summaries else ["point"])
        writer.writeheader()
        for p in doc["points"]:
            writer.writerow({"point": p["index"], **{k: _csv_value(v) for k, v in p["summary"].items()}})

    fields = ["point", "index", "warmup", "ok", "status", "error", "input_tokens", "output_tokens",
              "prompt_tokens", "completion_tokens", "scheduled_s", "start_s", "finished_s", "ttft_s", "tpot_s",
              "e2e_s", "itl_count", "itl_mean_s", "itl_max_s"]
    with paths["requests_csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in doc["requests"]:
            gaps = r.get("itl_s") or []
            writer.writerow({**r, "itl_count": len(gaps), "itl_mean_s": sum(gaps) / len(gaps) if gaps else None,
                             "itl_max_s": max(gaps) if gaps else None})
    return paths


def load_result(path: str | Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"bench result {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"bench result {path}: not JSON ({exc.msg})") from None
    if not isinstance(doc, dict) or "points" not in doc or "conditions" not in doc:
        raise ValueError(f"bench result {path}: not a `tandem bench` result (no points/conditions)")
    return doc
