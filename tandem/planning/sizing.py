"""Capacity-planning math: from a workload and measured service to instances, GPUs, P:D and admission limits.

Every formula is a small pure function so that `tandem plan`, the operator's planner mode and the simulator
share them. The field guide's method:

  usable RPS per instance    = the throughput measured at C_max, else C_max / E2E latency at C_max (Little's law)
  instances                  = ceil(peak RPS / usable RPS per instance)
  GPUs                       = ceil(instances x GPUs per instance (TP) x safety factor)
  prefill load (workers)     = rps x mean input tokens  / prefill tokens/s per worker
  decode load (workers)      = rps x mean output tokens / decode tokens/s per worker
  P:D ratio                  = prefill load : decode load, reduced to small integers
  P/D GPUs                   = prefill replicas x prefill TP + decode replicas x decode TP
  admission queue limit      = ceil(max queue wait x arrival rate)              (Little's law on the queue)

Disaggregation threshold. A decode worker that also prefills a prompt of L tokens stalls its whole batch for
L / prefill_tok_s seconds, so the token its batch mates produce next arrives after
    decode_step_s + L / prefill_tok_s.
That stays within the ITL target while
    L <= (ITL SLO - decode_step_s) x prefill_tok_s,
the threshold above which a prompt should go to the prefill pool (the router's `disaggMinTokens`). With
chunked prefill the same bound applies to each chunk instead of the whole prompt; a step time already at the
SLO leaves no room, and the threshold is 0 (send every prompt to the prefill pool).

Rounding: ceilings are taken after rounding to 9 decimals, so that 10 x 4 x 1.3 (52.000000000000007 in
binary floating point) is 52 GPUs, not 53.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.planning.curves import CurvePoint, LittleCheck, find_c_max, find_knee, littles_law_check
from tandem.planning.profile import WorkloadProfile
from tandem.planning.service_model import fitted_decode_rate, fitted_prefill_rate


def ceil_count(x: float) -> int:
    """ceil() that ignores binary floating-point dust (see the module docstring)."""
    return math.ceil(round(x, 9))


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def usable_rps(c_max: float, e2e_latency_s: float) -> float:
    """Requests/s one instance sustains at C_max: C_max / E2E latency (Little's law)."""
    _positive("C_max", c_max)
    _positive("E2E latency", e2e_latency_s)
    return c_max / e2e_latency_s


def instances_needed(peak_rps: float, usable_rps_per_instance: float) -> int:
    _positive("peak RPS", peak_rps)
    _positive("usable RPS per instance", usable_rps_per_instance)
    return ceil_count(peak_rps / usable_rps_per_instance)


def gpus_needed(instances: int, gpus_per_instance: int, safety_factor: float) -> int:
    if instances < 0:
        raise ValueError(f"instances must be >= 0, got {instances}")
    if gpus_per_instance < 1:
        raise ValueError(f"GPUs per instance must be at least 1, got {gpus_per_instance}")
    if not safety_factor >= 1:
        raise ValueError(f"safety factor must be >= 1, got {safety_factor}")
    return ceil_count(instances * gpus_per_instance * safety_factor)


def queue_limit(max_wait_s: float, arrival_rps: float) -> int:
    """Admission queue length that holds `max_wait_s` of arrivals: ceil(max wait x arrival rate)."""
    _positive("max queue wait", max_wait_s)
    _positive("arrival rate", arrival_rps)
    return ceil_count(max_wait_s * arrival_rps)


def disaggregation_threshold(slo_itl_s: float, decode_step_s: float, prefill_tok_s: float) -> int:
    """Longest prompt a decode worker can prefill without breaking its batch's ITL SLO (module docstring)."""
    _positive("ITL SLO", slo_itl_s)
    _positive("decode step time", decode_step_s)
    _positive("prefill tokens/s", prefill_tok_s)
    return max(0, math.floor(round((slo_itl_s - decode_step_s) * prefill_tok_s, 9)))


def reduce_ratio(prefill: float, decode: float, max_term: int = 8) -> tuple[int, int]:
    """The integer pair (p, d), both in 1..max_term, closest to prefill:decode on a log scale; ties go to the
    smaller pair, so 1.0 : 1.0 is 1:1 and 1.5 : 2.0 is 3:4."""
    _positive("prefill share", prefill)
    _positive("decode share", decode)
    if max_term < 1:
        raise ValueError(f"ratio terms must be allowed to reach at least 1, got {max_term}")
    target = math.log(prefill / decode)
    pairs = ((p, d) for p in range(1, max_term + 1) for d in range(1, max_term + 1))
    return min(pairs, key=lambda pd: (round(abs(math.log(pd[0] / pd[1]) - target), 12), pd[0] + pd[1]))


@dataclass(frozen=True)
class PhaseLoads:
    """Workers each phase keeps busy at a request rate (fractional, before any headroom)."""

    prefill: float
    decode: float
    ratio: tuple[int, int]

    @property
    def ratio_text(self) -> str:
        return f"{self.ratio[0]}:{self.ratio[1]}"


def phase_loads(rps: float, mean_input_tokens: float, mean_output_tokens: float, prefill_tok_s: float,
                decode_tok_s: float, max_term: int = 8) -> PhaseLoads:
    """(rps x mean_in / prefill_tok_s) : (rps x mean_out / decode_tok_s), and that ratio in small integers."""
    for name, value in (("RPS", rps), ("mean input tokens", mean_input_tokens),
                        ("mean output tokens", mean_output_tokens), ("prefill tokens/s", prefill_tok_s),
                        ("decode tokens/s", decode_tok_s)):
        _positive(name, value)
    p = rps * mean_input_tokens / prefill_tok_s
    d = rps * mean_output_tokens / decode_tok_s
    return PhaseLoads(prefill=p, decode=d, ratio=reduce_ratio(p, d, max_term))


def pool_replicas(load: float, safety_factor: float) -> int:
    """Workers for a pool: the load with headroom, rounded up, at least one."""
    return max(1, ceil_count(load * safety_factor))


def split_total(total: int, ratio: tuple[int, int]) -> tuple[int, int]:
    """Split `total` workers P:D, rounding the prefill share half up and keeping one of each (as the operator
    does for spec.ratio)."""
    if total < 2:
        raise ValueError(f"{total} workers cannot hold a prefill and a decode worker: at least 2 are needed")
    p, d = ratio
    prefill = min(max(math.floor(total * p / (p + d) + 0.5), 1), total - 1)
    return prefill, total - prefill


# -- the whole plan --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    profile: WorkloadProfile
    mean_input_tokens: float
    mean_output_tokens: float
    # colocated sizing from the measured curve (None without a curve)
    c_max: CurvePoint | None = None
    curve_points: int = 0
    knee_concurrency: float | None = None
    usable_rps: float | None = None
    instances: int | None = None
    gpus: int | None = None
    # disaggregated sizing from per-phase rates
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    rates_source: str = ""
    loads: PhaseLoads | None = None
    prefill_replicas: int | None = None
    decode_replicas: int | None = None
    replicas_source: str = ""
    decode_step_s: float | None = None
    disagg_threshold: int | None = None
    # admission
    max_queue_wait_s: float | None = None
    queue_arrival_rps: float | None = None
    queue_limit: int | None = None
    little_checks: tuple[LittleCheck, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def pd_gpus(self) -> int | None:
        if self.prefill_replicas is None or self.decode_replicas is None:
            return None
        return (self.prefill_replicas * self.profile.pool_tp("prefill")
                + self.decode_replicas * self.profile.pool_tp("decode"))

    @property
    def little_ok(self) -> bool:
        return all(c.ok for c in self.little_checks)


def _length_mismatch(curve: list[CurvePoint], mean_in: float, mean_out: float) -> list[str]:
    """A note when the curve was measured at other request lengths than the profile's: its latencies and rates
    hold for the lengths it was measured at."""
    measured = [(p.mean_input_tokens, p.mean_output_tokens) for p in curve
                if p.mean_input_tokens is not None and p.mean_output_tokens is not None]
    if not measured:
        return []
    curve_in = sum(m[0] for m in measured) / len(measured)
    curve_out = sum(m[1] for m in measured) / len(measured)
    if all(abs(c - p) <= 0.25 * p for c, p in ((curve_in, mean_in), (curve_out, mean_out))):
        return []
    return [f"the curve was measured with about {curve_in:.0f} input and {curve_out:.0f} output tokens per request, "
            f"the profile says {mean_in:.0f} and {mean_out:.0f}: its C_max and rates hold for the curve's lengths "
            "(give --input-tokens and --output-tokens as the workload's, and measure with them)"]


def make_plan(profile: WorkloadProfile, curve: list[CurvePoint] | None = None) -> Plan:
    """Size a fleet for `profile` from a measured curve, per-phase rates, or both (see the module docstring)."""
    if profile.peak_rps is None:
        raise ValueError("a plan needs the peak request rate: give --peak-rps or peak_rps in the profile")
    has_rates = profile.prefill_tok_s is not None and profile.decode_tok_s is not None
    if not curve and not has_rates:
        raise ValueError("a plan needs a measured curve (--curve, the JSON `tandem bench` writes) or both "
                         "per-phase rates (--prefill-tok-s and --decode-tok-s)")
    mean_in, mean_out = profile.input_distribution.mean, profile.output_distribution.mean
    values: dict = {"profile": profile, "mean_input_tokens": mean_in, "mean_output_tokens": mean_out}
    notes: list[str] = []

    decode_step = profile.decode_step_s
    if curve:
        decode_step = _size_from_curve(profile, curve, values, notes) or decode_step
    _size_pools(profile, curve, has_rates, decode_step, values, notes)

    wait = profile.max_queue_wait or profile.slo_ttft
    arrival = profile.queue_arrival_rps or profile.peak_rps
    if wait is not None:
        values.update(max_queue_wait_s=wait, queue_arrival_rps=arrival, queue_limit=queue_limit(wait, arrival))
    for check in values.get("little_checks", ()):
        if not check.ok:
            notes.append(f"Little's law gap at concurrency {check.concurrency:g}: throughput x latency = "
                         f"{check.implied_concurrency:.3g}, {check.gap:.1f}x off; that benchmark point did not "
                         "run at the concurrency it claims")
    return Plan(**values, notes=tuple(notes))


def _size_from_curve(profile: WorkloadProfile, curve: list[CurvePoint], values: dict, notes: list[str]) -> float | None:
    """The colocated sizing from a measured curve (C_max, instances, GPUs) into `values`; the decode step time the
    curve shows at C_max when the profile gives none (else None)."""
    if profile.slo_ttft is None and profile.slo_itl is None:
        raise ValueError("sizing from a curve needs an SLO: give --slo-ttft and/or --slo-itl")
    point = find_c_max(curve, profile.slo_ttft, profile.slo_itl, profile.slo_percentile)
    values["curve_points"] = len(curve)
    knee = find_knee([p.concurrency for p in curve], [p.request_throughput or p.usable_rps for p in curve])
    values["knee_concurrency"] = None if knee is None else curve[knee].concurrency
    values["little_checks"] = tuple(
        littles_law_check(p.concurrency, p.request_throughput, p.e2e_mean_s)
        for p in curve if p.request_throughput is not None)
    notes += _length_mismatch(curve, values["mean_input_tokens"], values["mean_output_tokens"])
    if point is None:
        notes.append(f"no measured concurrency meets the SLO (lowest: {curve[0].concurrency:g}); measure "
                     "lower concurrency or relax the SLO")
        return None
    values["c_max"] = point
    values["usable_rps"] = point.usable_rps
    values["instances"] = instances_needed(profile.peak_rps, point.usable_rps)
    values["gpus"] = gpus_needed(values["instances"], profile.tensor_parallel_size, profile.safety_factor)
    if point is curve[-1]:
        notes.append("C_max is the highest concurrency measured: the SLO may hold beyond it; extend "
                     "the sweep for a tighter plan")
    return point.itl_p50_s if profile.decode_step_s is None and point.itl_p50_s else None


def _size_pools(profile: WorkloadProfile, curve: list[CurvePoint] | None, has_rates: bool,
                decode_step: float | None, values: dict, notes: list[str]) -> None:
    """The disaggregated sizing into `values`: per-phase rates (given, or fitted from the curve), each pool's load
    and replicas, and the disaggregation threshold."""
    prefill_tok_s, decode_tok_s = profile.prefill_tok_s, profile.decode_tok_s
    if has_rates:
        values["rates_source"] = "given"
    else:
        try:
            prefill_tok_s = prefill_tok_s or fitted_prefill_rate(curve)
            decode_tok_s = decode_tok_s or fitted_decode_rate(curve, profile.slo_itl, profile.slo_percentile)
            values["rates_source"] = "fitted from the colocated curve (measure per-phase rates for a sharper split)"
        except ValueError as exc:
            notes.append(f"no P:D split: give --prefill-tok-s and --decode-tok-s ({exc})")
            return
    if not (prefill_tok_s and decode_tok_s):
        return
    loads = phase_loads(profile.peak_rps, values["mean_input_tokens"], values["mean_output_tokens"], prefill_tok_s,
                        decode_tok_s, profile.ratio_max_term)
    values.update(prefill_tok_s=prefill_tok_s, decode_tok_s=decode_tok_s, loads=loads)
    if has_rates or values.get("instances") is None:
        values["prefill_replicas"] = pool_replicas(loads.prefill, profile.safety_factor)
        values["decode_replicas"] = pool_replicas(loads.decode, profile.safety_factor)
        values["replicas_source"] = "each pool's load x safety factor, rounded up"
    else:
        (values["prefill_replicas"], values["decode_replicas"]), values["replicas_source"] = _split_workers(
            values["gpus"], profile.tensor_parallel_size, loads)
    if profile.slo_itl is not None and decode_step is not None:
        values["decode_step_s"] = decode_step
        values["disagg_threshold"] = disaggregation_threshold(profile.slo_itl, decode_step, prefill_tok_s)
        if values["disagg_threshold"] == 0:
            notes.append("the decode step already takes the whole ITL budget: disaggregate every prompt")


def _split_workers(gpus: int, tp: int, loads: PhaseLoads) -> tuple[tuple[int, int], str]:
    """The colocated plan's workers split by the P:D ratio, raised until each pool covers its load; and how."""
    total = from_gpus = max(2, ceil_count(gpus / tp))
    split = split_total(total, loads.ratio)
    # The ratio is reduced to small terms and the split rounded: a pool can land under its own load.
    while split[0] < loads.prefill or split[1] < loads.decode:
        total += 1
        split = split_total(total, loads.ratio)
    source = f"ceil(GPUs / TP) = {from_gpus} workers split {loads.ratio_text}"
    if total > from_gpus:
        source += f", raised to {total} to cover each pool's load"
    return split, source
