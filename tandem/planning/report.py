"""Presenting a plan: the table `tandem plan` prints, its JSON form, and the LLMDeployment patch."""

from __future__ import annotations

from typing import Literal

import yaml

from tandem.planning.sizing import Plan, split_total

PatchStyle = Literal["pools", "ratio"]


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.3f} s"


def slo_text(profile) -> str:
    """The SLO the plan holds the curve to, naming only the targets given ("no SLO given" without any)."""
    pct = profile.slo_percentile
    targets = [f"{pct} {name} <= {_s(value)}" for name, value in (("TTFT", profile.slo_ttft), ("ITL", profile.slo_itl))
               if value is not None]
    return " and ".join(targets) or "no SLO given"


def _tp_text(profile) -> str:
    """The profile's TP, with the pools' where either differs."""
    text = f"TP{profile.tensor_parallel_size}"
    pools = [f"{pool} TP{profile.pool_tp(pool)}" for pool in ("prefill", "decode")
             if profile.pool_tp(pool) != profile.tensor_parallel_size]
    return f"{text} ({', '.join(pools)})" if pools else text


def _pd_gpus_basis(plan: Plan) -> str:
    """How the P/D GPUs were counted: replicas x TP, per pool where the pools' TP differ."""
    tp_p, tp_d = plan.profile.pool_tp("prefill"), plan.profile.pool_tp("decode")
    if tp_p == tp_d:
        return f"({plan.prefill_replicas} + {plan.decode_replicas}) x TP{tp_p}"
    return f"{plan.prefill_replicas} x TP{tp_p} + {plan.decode_replicas} x TP{tp_d}"


def plan_rows(plan: Plan) -> list[tuple[str, str, str]]:
    """(quantity, value, how it was obtained) rows, in reading order."""
    p = plan.profile
    tp, safety = p.tensor_parallel_size, p.safety_factor
    rows: list[tuple[str, str, str]] = []
    if plan.curve_points:
        c = plan.c_max
        rows.append(("C_max (per instance)", "none" if c is None else f"{c.concurrency:g}",
                     f"highest concurrency of {plan.curve_points} measured with {slo_text(p)}"))
        rows.append(("knee", "none" if plan.knee_concurrency is None else f"{plan.knee_concurrency:g}",
                     "Kneedle point of throughput vs concurrency"))
        if c is not None:
            rows.append(("E2E latency at C_max", _s(c.e2e_mean_s), "mean, measured"))
            rows.append(("usable RPS per instance", f"{plan.usable_rps:.2f}", c.usable_rps_basis))
            rows.append(("instances", str(plan.instances), f"ceil({p.peak_rps:g} / {plan.usable_rps:.2f})"))
            rows.append(("GPUs", str(plan.gpus), f"ceil({plan.instances} x TP{tp} x {safety:g})"))
    if plan.loads is not None:
        lo = plan.loads
        rows.append(("prefill tokens/s per worker", f"{plan.prefill_tok_s:,.0f}", plan.rates_source))
        rows.append(("decode tokens/s per worker", f"{plan.decode_tok_s:,.0f}", plan.rates_source))
        rows.append(("prefill load (workers)", f"{lo.prefill:.2f}",
                     f"{p.peak_rps:g} x {plan.mean_input_tokens:g} / {plan.prefill_tok_s:,.0f}"))
        rows.append(("decode load (workers)", f"{lo.decode:.2f}",
                     f"{p.peak_rps:g} x {plan.mean_output_tokens:g} / {plan.decode_tok_s:,.0f}"))
        rows.append(("P:D ratio", lo.ratio_text, f"{lo.prefill:.2f} : {lo.decode:.2f} in terms <= {p.ratio_max_term}"))
        rows.append(("prefill / decode replicas", f"{plan.prefill_replicas} / {plan.decode_replicas}",
                     plan.replicas_source))
        rows.append(("P/D GPUs", str(plan.pd_gpus), _pd_gpus_basis(plan)))
        rows.append(("disaggregation threshold",
                     "n/a" if plan.disagg_threshold is None else f"{plan.disagg_threshold} tokens",
                     _no_threshold_reason(plan) if plan.disagg_threshold is None else
                     f"(ITL SLO {p.slo_itl:g} s - decode step {plan.decode_step_s:.4f} s) x "
                     f"{plan.prefill_tok_s:,.0f} tok/s"))
    if plan.queue_limit is not None:
        rows.append(("admission queue limit", str(plan.queue_limit),
                     f"ceil({plan.max_queue_wait_s:g} s max wait x {plan.queue_arrival_rps:g} RPS)"))
    if plan.little_checks:
        worst = max(plan.little_checks, key=lambda c: c.gap)
        rows.append(("Little's law check", "ok" if plan.little_ok else "FAILED",
                     f"worst gap {worst.gap:.2f}x at concurrency {worst.concurrency:g} "
                     f"(throughput x latency = {worst.implied_concurrency:.3g}; limit 2x)"))
    return rows


def _no_threshold_reason(plan: Plan) -> str:
    """What the disaggregation threshold lacks: the ITL SLO, or a decode step time, which a curve gives only at
    its C_max (the ITL measured where the plan runs the fleet)."""
    if plan.profile.slo_itl is None:
        return "needs --slo-itl"
    if plan.curve_points and plan.c_max is None:
        return "no curve point meets the SLO to read a decode step time from: give --decode-step-s"
    return "needs a decode step time: --decode-step-s, or a curve"


def format_plan(plan: Plan) -> str:
    p = plan.profile
    head = [
        "Tandem capacity plan",
        f"  workload  peak {p.peak_rps:g} RPS; input mean {plan.mean_input_tokens:g} tokens ({p.input_tokens}); "
        f"output mean {plan.mean_output_tokens:g} tokens ({p.output_tokens})",
        f"  SLO       {slo_text(p)}; {_tp_text(p)}; safety x{p.safety_factor:g}",
        "",
    ]
    rows = [("quantity", "value", "how"), *plan_rows(plan)]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
    lines.insert(1, "-" * (w0 + w1 + 4 + max(len(r[2]) for r in rows)))
    notes = [f"note: {n}" for n in plan.notes]
    return "\n".join(head + lines + ([""] + notes if notes else []))


def plan_patch(plan: Plan, style: PatchStyle = "pools") -> dict:
    """A JSON merge patch for an LLMDeployment (`kubectl patch llmdep NAME --type merge --patch-file F`).

    The CRD sizes pools one way or the other, never both, so the patch clears the other way's fields:
    pools  prefill.replicas and decode.replicas exactly (clears spec.ratio and spec.replicas);
    ratio  spec.ratio with spec.replicas = prefill + decode (the operator rounds the split itself).
    A pool's tensor-parallel size the profile gives is set on that pool.
    """
    if plan.prefill_replicas is None or plan.decode_replicas is None or plan.loads is None:
        raise ValueError("this plan has no P:D split to patch (it needs per-phase rates or a curve to fit them)")
    if style == "pools":
        spec: dict = {"ratio": None, "replicas": None, "prefill": {"replicas": plan.prefill_replicas},
                      "decode": {"replicas": plan.decode_replicas}}
    elif style == "ratio":
        total = plan.prefill_replicas + plan.decode_replicas
        split = split_total(total, plan.loads.ratio)
        if split != (plan.prefill_replicas, plan.decode_replicas):  # the ratio is reduced, the pools rounded up
            raise ValueError(f"the operator splits {total} workers at {plan.loads.ratio_text} into {split[0]} "
                             f"prefill + {split[1]} decode, not this plan's {plan.prefill_replicas} + "
                             f"{plan.decode_replicas}: use --patch-style pools")
        spec = {"ratio": plan.loads.ratio_text, "replicas": total, "prefill": {"replicas": None},
                "decode": {"replicas": None}}
    else:
        raise ValueError(f"patch style {style!r} must be 'pools' or 'ratio'")
    for pool in ("prefill", "decode"):
        tp = getattr(plan.profile, f"{pool}_tensor_parallel_size")
        if tp is not None:
            spec[pool]["tensorParallelSize"] = tp
    if plan.disagg_threshold is not None:
        spec["router"] = {"disaggMinTokens": plan.disagg_threshold}
    return {"spec": spec}


def plan_patch_yaml(plan: Plan, style: PatchStyle = "pools") -> str:
    header = (f"# tandem plan: P:D {plan.loads.ratio_text}, {plan.prefill_replicas} prefill + "
              f"{plan.decode_replicas} decode workers\n"
              "# apply: kubectl patch llmdeployment NAME --type merge --patch-file THIS_FILE\n") if plan.loads else ""
    return header + yaml.safe_dump(plan_patch(plan, style), sort_keys=False)


def plan_to_dict(plan: Plan) -> dict:
    """Machine-readable plan (`tandem plan --format json`)."""
    c = plan.c_max
    return {
        "profile": plan.profile.model_dump(),
        "mean_input_tokens": plan.mean_input_tokens,
        "mean_output_tokens": plan.mean_output_tokens,
        "c_max": None if c is None else c.concurrency,
        "e2e_at_c_max_s": None if c is None else c.e2e_mean_s,
        "knee": plan.knee_concurrency,
        "usable_rps_per_instance": plan.usable_rps,
        "instances": plan.instances,
        "gpus": plan.gpus,
        "prefill_tok_s": plan.prefill_tok_s,
        "decode_tok_s": plan.decode_tok_s,
        "rates_source": plan.rates_source or None,
        "prefill_load": None if plan.loads is None else plan.loads.prefill,
        "decode_load": None if plan.loads is None else plan.loads.decode,
        "ratio": None if plan.loads is None else plan.loads.ratio_text,
        "prefill_replicas": plan.prefill_replicas,
        "decode_replicas": plan.decode_replicas,
        "pd_gpus": plan.pd_gpus,
        "decode_step_s": plan.decode_step_s,
        "disaggregation_threshold_tokens": plan.disagg_threshold,
        "max_queue_wait_s": plan.max_queue_wait_s,
        "queue_arrival_rps": plan.queue_arrival_rps,
        "queue_limit": plan.queue_limit,
        "littles_law": [{"concurrency": ch.concurrency, "implied_concurrency": ch.implied_concurrency,
                         "gap": ch.gap, "ok": ch.ok} for ch in plan.little_checks],
        "notes": list(plan.notes),
    }
