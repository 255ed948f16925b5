"""The `tandem` command line's parsers: one per command, their options generated from the config models."""

from __future__ import annotations

import argparse
import functools

from tandem.cli.args import add_model_options
from tandem.config import EngineConfig, RouterConfig, WorkerConfig

# `tandem serve` restarts a worker in place, and it reloads its model meanwhile (longer than the router's default
# wait on a busy CPU, in a testing helper's runs): its router waits longer for it than a cluster's router, whose
# pools have other workers, does by default.
SERVE_WORKER_RETURN_WAIT_S = 60.0


def _add_log_level(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--log-level", default=default, choices=["debug", "info", "warning", "error"], help="what to log")


def worker_parser(sub, name: str, help_text: str, default_port: int) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_options(p, WorkerConfig, skip=("port",))
    p.add_argument("--port", type=int, default=default_port, help="port to listen on (0 picks a free one)")
    add_model_options(p, EngineConfig)
    _add_log_level(p, "info")
    return p


def serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run the local stack: a router before prefill and decode workers",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="the address the router listens on (the workers stay on 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    # None, not 1: so that --colocated can tell a --prefill the user gave (refused) from the default.
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (1 unless --colocated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--colocated", action="store_true", help="no prefill pool: --decode workers do everything")
    p.add_argument("--disagg-min-tokens", type=int, default=RouterConfig.model_fields["disagg_min_tokens"].default,
                   help="prompts shorter than this skip the prefill pool")
    p.add_argument("--worker-return-wait-s", type=float, default=SERVE_WORKER_RETURN_WAIT_S,
                   help="how long a request whose decode workers are all gone waits for one to be back (the router's "
                        "option; longer than its own default here: a worker restarted on this machine reloads its "
                        "model first)")
    p.add_argument("--api-key", default=None, help="the router then requires `Authorization: Bearer <key>` on "
                                                   "/v1/*; none given: $TANDEM_API_KEY's, else the API is open. "
                                                   "$TANDEM_API_KEY keeps the key out of `ps`")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None, metavar="N",
                       help=f"the {role} workers' --tensor-parallel-size (default: --tensor-parallel-size)")
    p.add_argument("--admission", choices=["slo", "off"], default=RouterConfig.model_fields["admission"].default,
                   help="the router's admission: slo refuses (429) what would miss its SLO class's targets; off "
                        "serves first come, first served")
    add_model_options(p, EngineConfig)
    _add_log_level(p, "info")
    return p


def router_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("router", help="run the OpenAI front door before prefill and decode pools",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_options(p, RouterConfig)
    _add_log_level(p, "info")
    return p


def drain_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("drain", help="take a worker out of rotation and wait for its requests (preStop hook)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the worker to drain")
    p.add_argument("--timeout", type=float, default=55.0, help="seconds to wait for in-flight requests")
    _add_log_level(p, "warning")
    return p


def operator_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("operator", help="run the Kubernetes operator that reconciles LLMDeployments",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", default=None, help="watch only this namespace")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument("--peering", default=None, metavar="NAME",
                   help="kopf peering object for HA: one active replica, the others on standby")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority (the highest is active; default: a random one per replica, so that "
                        "replicas started alike do not all pause)")
    p.add_argument("--liveness", default=None, metavar="URL", help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--resync-seconds", type=float, default=300.0, help="re-apply owned objects this often (0: never)")
    p.add_argument("--kubeconfig", default=None, help="unset: in-cluster credentials, then $KUBECONFIG or ~/.kube/config")
    p.add_argument("--context", default=None, help="kubeconfig context")
    _add_log_level(p, "info")
    return p


def bench_parser(sub) -> argparse.ArgumentParser:
    from tandem.bench.config import BenchConfig

    # Plain help formatter: add_model_options already writes each default into the help text.
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server: latency-throughput curves")
    add_model_options(p, BenchConfig, skip=("concurrency", "rate"))
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--concurrency", type=int, nargs="+", metavar="C",
                       help="closed-loop sweep: requests kept in flight, one point per value (default: 1)")
    sweep.add_argument("--rate", type=float, nargs="+", metavar="R",
                       help="open-loop sweep: requests per second, one point per value")
    _add_log_level(p, "warning")
    return p


def plan_parser(sub) -> argparse.ArgumentParser:
    from tandem.planning.profile import WorkloadProfile

    p = sub.add_parser("plan", help="size a fleet: C_max, instances, GPUs, P:D ratio, admission queue limit",
                       epilog="Formulas: see tandem/planning/sizing.py. Disaggregation threshold = (ITL SLO - "
                              "decode step time) x prefill tokens/s: the longest prompt a decode worker can "
                              "prefill without breaking its batch's ITL.")
    p.add_argument("--profile", metavar="FILE.yaml",
                   help="workload profile: the flags' names in snake_case, e.g. `peak_rps: 120` and "
                        "`input_tokens: uniform:256:1024`; flags override its fields")
    p.add_argument("--curve", metavar="FILE", help="measured curve: the bench.json `tandem bench` writes, or "
                                                   "a YAML/JSON file with `points:`")
    add_model_options(p, WorkloadProfile)
    p.add_argument("--patch-style", choices=["pools", "ratio"], default="pools",
                   help="size the LLMDeployment by prefill/decode replicas, or by spec.ratio + spec.replicas "
                        "(refused when the operator's split of those would not give the plan's pools; "
                        "default: pools)")
    p.add_argument("--patch-out", metavar="FILE", help="write the LLMDeployment patch here instead of printing it")
    p.add_argument("--format", dest="output_format", choices=["table", "json"], default="table",
                   help="a table and the patch, or one JSON document (default: table)")
    _add_log_level(p, "warning")
    return p


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The `tandem` parser and its subcommands' (`sub.choices[name]` is each command's own parser)."""
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving")
    # No abbreviated options: `serve --pre 2` would read as --prefill, and an option added later (say
    # --prefill-x) would silently change what an abbreviation in someone's script means.
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    worker_parser(sub, "worker", "run one engine worker (prefill | decode | both)", 8000)
    serve_parser(sub)
    router_parser(sub)
    operator_parser(sub)
    drain_parser(sub)
    bench_parser(sub)
    plan_parser(sub)
    return parser, sub
