"""One short real sweep: `tandem bench` against `tandem serve` (router + prefill + decode) with SmolLM2-135M on the CPU."""

from __future__ import annotations

import csv
import json

import pytest

from tandem.cli import main
from tandem.runtimes.launcher import ServiceProcess


@pytest.fixture(scope="module")
def worker():
    with ServiceProcess(["serve", "--model", "smollm2", "--kv-transfer", "tcp"], name="bench-serve") as proc:
        yield proc


@pytest.fixture(scope="module")
def sweep(worker, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = main(["bench", "--url", worker.url, "--concurrency", "1", "2", "--requests", "4", "--warmup", "1",
               "--input-dist", "fixed:16", "--output-dist", "fixed:8", "--slo-ttft", "30", "--slo-itl", "5",
               "--out", str(out)])
    return rc, out


def test_sweep_writes_json_with_conditions_points_and_requests(sweep):
    rc, out = sweep
    assert rc == 0
    doc = json.loads((out / "bench.json").read_text())
    c = doc["conditions"]
    assert (c["model"], c["sweep"], c["values"], c["endpoint"]) == ("smollm2", "concurrency", [1, 2], "completions")
    assert (c["input_dist"], c["output_dist"], c["requests_per_point"], c["warmup_per_point"]) == \
        ("fixed:16", "fixed:8", 4, 1)
    assert c["ignore_eos"] is True and c["server"]["owned_by"] == "tandem" and c["client"]["cpu_count"] >= 1
    assert c["slo_class"] == "batch"  # what the router's admission measures it by: how it serves, not refusals
    assert [p["concurrency"] for p in doc["points"]] == [1, 2]
    for p in doc["points"]:
        s = p["summary"]
        assert (s["requests"], s["completed"], s["failed"]) == (4, 4, 0)
        assert s["request_throughput"] > 0 and s["output_throughput"] > 0
        assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] < s["e2e_p99_s"]
        assert 0 < s["itl_p50_s"] <= s["itl_p99_s"]
        assert s["slo_attainment"] == 1.0
    assert len(doc["requests"]) == 2 * (4 + 1)
    for r in doc["requests"]:
        # Token-id prompts are exact, and ignore_eos makes every output run to max_tokens.
        assert r["ok"] and (r["prompt_tokens"], r["completion_tokens"]) == (16, 8)
        assert r["ttft_s"] > 0 and len(r["itl_s"]) >= 1
    a = doc["analysis"]
    assert a["c_max"] == 2 and a["usable_rps"] > 0
    assert all(check["ok"] for check in a["littles_law"])


def test_sweep_writes_csv(sweep):
    _, out = sweep
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [row["concurrency"] for row in rows] == ["1", "2"]
    assert all(float(row["ttft_p99_s"]) > 0 for row in rows)
    with (out / "requests.csv").open() as f:
        requests = list(csv.DictReader(f))
    assert len(requests) == 10 and sum(row["warmup"] == "True" for row in requests) == 2
    assert all(row["completion_tokens"] == "8" for row in requests)


def test_sweep_plot_has_non_empty_curves(sweep):
    _, out = sweep
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    from tandem.bench.plots import plot_curves

    doc = json.loads((out / "bench.json").read_text())
    fig = plot_curves(doc)  # the figure bench.png was drawn from, rebuilt from the JSON
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    summaries = [p["summary"] for p in doc["points"]]
    expected = {"request throughput": "request_throughput", "output tokens/s": "output_throughput",
                "TTFT p50": "ttft_p50_s", "TTFT p99": "ttft_p99_s", "ITL p50": "itl_p50_s", "ITL p99": "itl_p99_s"}
    for label, key in expected.items():
        line = lines[label]
        assert list(line.get_xdata()) == [1, 2], label
        assert list(line.get_ydata()) == pytest.approx([s[key] for s in summaries]), label
        assert all(y > 0 for y in line.get_ydata()), label
    assert "C_max 2" in lines and "SLO 30 s" in lines and "SLO 5 s" in lines
    assert any(label.startswith("usable ") for label in lines)


def test_plan_reads_the_measured_curve(sweep, capsys):
    _, out = sweep
    capsys.readouterr()
    rc = main(["plan", "--curve", str(out / "bench.json"), "--peak-rps", "10", "--slo-ttft", "30", "--slo-itl", "5",
               "--input-tokens", "16", "--output-tokens", "8", "--format", "json"])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["c_max"] == 2 and plan["instances"] >= 1 and plan["gpus"] >= plan["instances"]
    # Per-phase rates fitted from the colocated curve give a P:D split and a patch.
    assert plan["prefill_tok_s"] > 0 and plan["decode_tok_s"] > 0 and ":" in plan["ratio"]
    assert plan["patch"]["spec"]["prefill"]["replicas"] + plan["patch"]["spec"]["decode"]["replicas"] >= 2
    assert not any("the curve was measured with" in note for note in plan["notes"])  # the lengths agree

    # A profile of other lengths than the curve's: said, since the curve's figures hold for its own.
    main(["plan", "--curve", str(out / "bench.json"), "--peak-rps", "10", "--slo-ttft", "30", "--slo-itl", "5",
          "--format", "json"])  # the default profile: 512 input and 128 output tokens
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("the curve was measured with about 16 input and 8 output tokens" in note for note in notes), notes


def test_the_sweep_runs_in_the_batch_slo_class(sweep, worker):
    """The router admits the sweep's requests by the batch class's targets, not interactive's (which refused most
    of a sweep on a CPU: the curve then measured 429s)."""
    import httpx

    metrics = httpx.get(f"{worker.url}/metrics").text
    served = [line for line in metrics.splitlines()
              if line.startswith("tandem_router_requests_total") and 'slo_class="batch"' in line]
    assert served and float(served[0].split()[-1]) >= 10  # 2 points x (4 measured + 1 warm-up)
