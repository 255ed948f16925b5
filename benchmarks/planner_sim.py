"""Static peak sizing vs the planner on a simulated 24 h diurnal day, side by side in one run.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/planner_sim.py [--hours 24] [--peak-rps 40] ...

Prints the conditions, then SLO attainment, latency percentiles and GPU-hours of both policies and the
planner's GPU-hours as a ratio of static's. The service figures are per-worker rates for a large model on a
TP-8 worker (stated below, not measured here): the simulator (tandem/planning/simulator.py) turns them into a
prefill and a decode service-time model with `ServiceModel.from_rates`, or fits one to a `tandem bench`
curve given with --curve.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from tandem.bench.distributions import parse_distribution
from tandem.planning.curves import load_curve
from tandem.planning.policy import PlannerLimits
from tandem.planning.service_model import ServiceModel
from tandem.planning.simulator import PlannerPolicy, SimConfig, StaticPolicy, format_comparison, simulate
from tandem.planning.sizing import pool_replicas
from tandem.planning.workload import DiurnalRate, poisson_trace


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hours", type=float, default=24.0, help="simulated duration (one diurnal period is 24 h)")
    p.add_argument("--period-hours", type=float, default=24.0, help="length of one diurnal cycle")
    p.add_argument("--peak-rps", type=float, default=40.0)
    p.add_argument("--trough", type=float, default=0.25, help="quietest rate as a share of the peak")
    p.add_argument("--input-tokens", default="lognormal:3000:0.6")
    p.add_argument("--output-tokens", default="lognormal:500:0.6")
    p.add_argument("--prefill-tok-s", type=float, default=10000.0, help="prompt tokens/s per prefill worker")
    p.add_argument("--decode-tok-s", type=float, default=1500.0, help="tokens/s per decode worker within the ITL SLO")
    p.add_argument("--curve", help="fit the service model to this `tandem bench` result instead of the rates")
    p.add_argument("--tp", type=int, default=8, help="GPUs per worker")
    p.add_argument("--prefill-tp", type=int, help="GPUs per prefill worker (default: --tp)")
    p.add_argument("--decode-tp", type=int, help="GPUs per decode worker (default: --tp)")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-itl", type=float, default=0.05)
    p.add_argument("--safety", type=float, default=1.3, help="static headroom; the planner targets 1/safety utilisation")
    p.add_argument("--hysteresis", type=float, default=0.15)
    p.add_argument("--startup-s", type=float, default=180.0, help="time from asking for a worker to its serving")
    p.add_argument("--tick-s", type=float, default=60.0, help="planner period")
    p.add_argument("--scale-up-cooldown-s", type=float, default=120.0)
    p.add_argument("--scale-down-cooldown-s", type=float, default=600.0)
    p.add_argument("--gpu-budget", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.curve:
        model = ServiceModel.from_curve(load_curve(a.curve), a.slo_itl)
    else:
        model = ServiceModel.from_rates(a.prefill_tok_s, a.decode_tok_s, a.slo_itl)
    inp, out = parse_distribution(a.input_tokens, "input"), parse_distribution(a.output_tokens, "output")
    rate = DiurnalRate(a.peak_rps, trough=a.trough, period_s=a.period_hours * 3600,
                       low_at_s=a.period_hours * 3600 / 6)
    t = time.perf_counter()
    trace = poisson_trace(rate, a.hours * 3600, inp, out, np.random.default_rng(a.seed))
    make_s = time.perf_counter() - t

    def sizing(rps: float) -> tuple[int, int]:
        return (pool_replicas(rps * inp.mean / model.prefill_tok_s, a.safety),
                pool_replicas(rps * out.mean / model.decode_tok_s(), a.safety))

    static = sizing(a.peak_rps)
    tp_p, tp_d = a.prefill_tp or a.tp, a.decode_tp or a.tp
    tp_text = f"TP{tp_p}" if tp_p == tp_d else f"prefill TP{tp_p}, decode TP{tp_d}"
    limits = PlannerLimits(prefill_gpus_per_replica=tp_p, decode_gpus_per_replica=tp_d, gpu_budget=a.gpu_budget,
                           target_utilization=1 / a.safety, hysteresis=a.hysteresis,
                           scale_up_cooldown_s=a.scale_up_cooldown_s, scale_down_cooldown_s=a.scale_down_cooldown_s)
    config = SimConfig(model, a.slo_ttft, a.slo_itl, prefill_gpus_per_replica=tp_p, decode_gpus_per_replica=tp_d,
                       startup_s=a.startup_s, tick_s=a.tick_s, seed=a.seed)
    print("planner simulation: static peak sizing vs the planner policy (tandem/planning/policy.py)")
    print(f"  trace     {a.hours:g} h, diurnal {a.trough * a.peak_rps:g}..{a.peak_rps:g} RPS (period "
          f"{a.period_hours:g} h), Poisson arrivals: {len(trace):,} requests (made in {make_s:.1f} s)")
    print(f"  lengths   input {inp.spec} (mean {inp.mean:g}), output {out.spec} (mean {out.mean:g})")
    print(f"  service   prefill {model.prefill_tok_s:,.0f} tok/s per worker; decode itl(b) = "
          f"{model.itl_base_s * 1000:.1f} ms + {model.itl_per_seq_s * 1000:.3f} ms x b, batch <= {model.max_batch} "
          f"({model.decode_tok_s():,.0f} tok/s per worker); {tp_text}; {'fitted to ' + a.curve if a.curve else 'from stated rates'}")
    print(f"  fleet     static {static[0]} prefill + {static[1]} decode workers (peak x {a.safety:g}) = "
          f"{static[0] * tp_p + static[1] * tp_d} GPUs; planner every {a.tick_s:g} s, hysteresis {a.hysteresis:g}, "
          f"cooldowns {a.scale_up_cooldown_s:g}/{a.scale_down_cooldown_s:g} s up/down, startup {a.startup_s:g} s, "
          f"budget {a.gpu_budget or 'none'}")
    results = []
    for policy in (StaticPolicy(*static), PlannerPolicy(limits, sizing(float(rate(0.0))))):
        t = time.perf_counter()
        results.append(simulate(trace, config, policy))
        print(f"  simulated {policy.name} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    print()
    print(format_comparison(results, a.slo_ttft, a.slo_itl))
    static_r, planner_r = results
    print(f"\nplanner / static GPU-hours: {planner_r.gpu_hours / static_r.gpu_hours:.3f}; SLO attainment "
          f"{planner_r.attainment * 100:.2f}% vs {static_r.attainment * 100:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
