"""`tandem` command line: serve, worker, router, operator, bench, plan.

Components are imported inside their commands: the core package imports none of them.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from tandem.cli_args import add_model_options, model_from_options
from tandem.config import EngineConfig, RouterConfig, WorkerConfig
from tandem.errors import pydantic_message
from tandem.request_id import configure_logging

# `tandem serve` restarts a worker in place, and it reloads its model meanwhile (longer than the router's default
# wait on a busy CPU, in a testing helper's runs): its router waits longer for it than a cluster's router, whose
# pools have other workers, does by default.
SERVE_WORKER_RETURN_WAIT_S = 60.0


def _add_log_level(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--log-level", default=default, choices=["debug", "info", "warning", "error"], help="what to log")


def _worker_parser(sub, name: str, help_text: str, default_port: int) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_options(p, WorkerConfig, skip=("port",))
    p.add_argument("--port", type=int, default=default_port, help="port to listen on (0 picks a free one)")
    add_model_options(p, EngineConfig)
    _add_log_level(p, "info")
    return p


def _serve_parser(sub) -> argparse.ArgumentParser:
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


def _router_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("router", help="run the OpenAI front door before prefill and decode pools",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_options(p, RouterConfig)
    _add_log_level(p, "info")
    return p


def _drain_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("drain", help="take a worker out of rotation and wait for its requests (preStop hook)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the worker to drain")
    p.add_argument("--timeout", type=float, default=55.0, help="seconds to wait for in-flight requests")
    _add_log_level(p, "warning")
    return p


def _operator_parser(sub) -> argparse.ArgumentParser:
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


def _bench_parser(sub) -> argparse.ArgumentParser:
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


def _plan_parser(sub) -> argparse.ArgumentParser:
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


def _options_error(exc) -> str:
    """A pydantic ValidationError as one line per bad option, named as on the command line, without pydantic's
    boilerplate."""
    def option(loc) -> str:
        if not loc:
            return "options"
        first = loc[0]
        return ".".join([f"--{first.replace('_', '-')}" if isinstance(first, str) else str(first), *map(str, loc[1:])])

    return "; ".join(f"{option(e['loc'])}: {pydantic_message(e)}" for e in exc.errors())


def _worker_config(ns: argparse.Namespace) -> WorkerConfig:
    engine = model_from_options(EngineConfig, ns)
    return model_from_options(WorkerConfig, ns, engine=engine)


def _checked(parser: argparse.ArgumentParser, build, runs_model: bool = False):
    """build()'s config; else one line naming every bad option, or the model that is not there (or, when this
    command runs it, of an architecture the engine has no family for), and exit 2: said before anything loads or
    starts, not in a traceback (or, for `serve`, in a child's log once others started)."""
    from pydantic import ValidationError

    from tandem.model_source import default_served_name, resolve_model_source
    from tandem.workers.models.registry import check_hf_folder

    try:
        config = build()
        model = config.model if hasattr(config, "model") else config.engine.model
        default_served_name(model)
        if runs_model:
            check_hf_folder(resolve_model_source(model))
    except ValidationError as exc:
        parser.exit(2, f"{parser.prog}: {_options_error(exc)}\n")
    except ValueError as exc:  # the model
        parser.exit(2, f"{parser.prog}: {exc}\n")
    return config


def _device_present(parser: argparse.ArgumentParser, device: str) -> None:
    """--device cuda on a machine without CUDA: said now, not in torch's traceback once the model has loaded."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: --device {device}: CUDA is not available here (torch "
                       f"{torch.__version__}, torch.cuda.is_available() is False); use --device cpu or auto\n")


def _port_free(parser: argparse.ArgumentParser, host: str, port: int) -> None:
    from tandem.launcher import port_in_use

    if port and port_in_use(host, port):
        parser.exit(2, f"{parser.prog}: port {port} on {host} is in use; choose another with --port\n")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: the servers have shut down by now; their traceback says nothing
        return 130


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving")
    # No abbreviated options: `serve --pre 2` would read as --prefill, and an option added later (say
    # --prefill-x) would silently change what an abbreviation in someone's script means.
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    _worker_parser(sub, "worker", "run one engine worker (prefill | decode | both)", 8000)
    _serve_parser(sub)
    _router_parser(sub)
    _operator_parser(sub)
    _drain_parser(sub)
    _bench_parser(sub)
    plan_parser = _plan_parser(sub)
    ns, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, with its usage (the top-level one lists only commands)
        sub.choices[ns.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if ns.command == "plan" and ns.profile:
        from tandem.planning.profile import load_profile_file

        try:
            plan_parser.set_defaults(**load_profile_file(ns.profile))  # the file's values, under the flags
        except ValueError as exc:
            plan_parser.error(str(exc))
        ns = parser.parse_args(argv)
    configure_logging(ns.log_level.upper())
    # httpx says every request it makes at INFO: a router's probes, a worker's calls to peers, serve's readiness
    # polls. That buries what every tandem process has to say.
    logging.getLogger("httpx").setLevel(logging.WARNING)

    if ns.command == "worker":
        from tandem.workers.main import run_worker

        worker_parser = sub.choices["worker"]
        config = _checked(worker_parser, lambda: _worker_config(ns), runs_model=True)
        _device_present(worker_parser, config.engine.device)
        return run_worker(config, log_level=ns.log_level)
    if ns.command == "serve":
        from tandem.local_stack import run_local_stack

        serve_parser = sub.choices["serve"]
        if ns.colocated and ns.prefill is not None:
            serve_parser.error("--colocated runs no prefill pool: drop --prefill (or --colocated)")
        prefill = 1 if ns.prefill is None else ns.prefill
        if ns.decode < 1 or prefill < 0:
            serve_parser.error("needs --decode >= 1 and --prefill >= 0")
        for size in (ns.prefill_tensor_parallel_size, ns.decode_tensor_parallel_size):
            if size is not None and size < 1:
                serve_parser.error(f"a tensor-parallel size must be >= 1, got {size}")
        engine = _checked(serve_parser, lambda: model_from_options(EngineConfig, ns), runs_model=True)
        _device_present(serve_parser, engine.device)
        # The router's own options too: checked here, not by the router process once the workers have started.
        _checked(serve_parser, lambda: RouterConfig(model=engine.model, host=ns.host, port=ns.port,
                                                   disagg_min_tokens=ns.disagg_min_tokens,
                                                   worker_return_wait_s=ns.worker_return_wait_s,
                                                   admission=ns.admission))
        return run_local_stack(engine, prefill=prefill, decode=ns.decode,
                               colocated=ns.colocated or prefill == 0, disagg_min_tokens=ns.disagg_min_tokens,
                               host=ns.host, port=ns.port, api_key=ns.api_key,
                               worker_return_wait_s=ns.worker_return_wait_s, admission=ns.admission,
                               tensor_parallel={"prefill": ns.prefill_tensor_parallel_size,
                                                "decode": ns.decode_tensor_parallel_size})
    if ns.command == "router":
        from tandem.router.main import run_router

        config = _checked(sub.choices["router"], lambda: model_from_options(RouterConfig, ns))
        _port_free(sub.choices["router"], config.host, config.port)  # said now, as `serve` and `worker` say it
        return run_router(config, log_level=ns.log_level)
    if ns.command == "drain":
        from tandem.drain import drain

        return drain(ns.url, ns.timeout)
    if ns.command == "operator":
        from tandem.operator.main import run_operator

        return run_operator(ns.namespace, peering=ns.peering, priority=ns.priority, liveness=ns.liveness,
                            kubeconfig=ns.kubeconfig, context=ns.context, resync_seconds=ns.resync_seconds or None)
    if ns.command == "bench":
        from pydantic import ValidationError

        from tandem.bench.command import run_bench_command
        from tandem.bench.config import BenchConfig

        try:
            config = model_from_options(BenchConfig, ns)
        except ValidationError as exc:
            sub.choices["bench"].error(_options_error(exc))
        return run_bench_command(config)
    if ns.command == "plan":
        from pydantic import ValidationError

        from tandem.planning.command import run_plan_command
        from tandem.planning.profile import WorkloadProfile

        try:
            profile = model_from_options(WorkloadProfile, ns)
        except ValidationError as exc:
            plan_parser.error(_options_error(exc))
        return run_plan_command(profile, ns.curve, ns.patch_style, ns.patch_out, ns.output_format)
    parser.error(f"unknown command {ns.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
