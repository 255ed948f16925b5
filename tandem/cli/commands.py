"""`tandem` command line: serve, worker, router, operator, drain, bench, plan.

Components are imported inside their commands: the core package imports none of them.
"""

from __future__ import annotations

import argparse
import logging

from tandem.cli.args import model_from_options
from tandem.cli.parsers import build_parser
from tandem.config import EngineConfig, RouterConfig, WorkerConfig
from tandem.errors import pydantic_message
from tandem.server.request_id import configure_logging


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
    from tandem.runtimes.launcher import port_in_use

    if port and port_in_use(host, port):
        parser.exit(2, f"{parser.prog}: port {port} on {host} is in use; choose another with --port\n")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: the servers have shut down by now; their traceback says nothing
        return 130


def _main(argv: list[str] | None) -> int:
    parser, sub = build_parser()
    ns = _parse(parser, sub, argv)
    configure_logging(ns.log_level.upper())
    # httpx says every request it makes at INFO: a router's probes, a worker's calls to peers, serve's readiness
    # polls. That buries what every tandem process has to say.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run = _COMMANDS.get(ns.command)
    if run is None:
        parser.error(f"unknown command {ns.command}")
        return 2
    return run(sub.choices[ns.command], ns)


def _parse(parser: argparse.ArgumentParser, sub, argv: list[str] | None) -> argparse.Namespace:
    ns, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, with its usage (the top-level one lists only commands)
        sub.choices[ns.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if ns.command == "plan" and ns.profile:
        from tandem.planning.profile import load_profile_file

        plan_parser = sub.choices["plan"]
        try:
            plan_parser.set_defaults(**load_profile_file(ns.profile))  # the file's values, under the flags
        except ValueError as exc:
            plan_parser.error(str(exc))
        ns = parser.parse_args(argv)
    return ns


def _run_worker(worker_parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from tandem.workers.main import run_worker

    config = _checked(worker_parser, lambda: _worker_config(ns), runs_model=True)
    _device_present(worker_parser, config.engine.device)
    return run_worker(config, log_level=ns.log_level)


def _run_serve(serve_parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from tandem.runtimes.local_stack import run_local_stack

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


def _run_router(router_parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from tandem.router.main import run_router

    config = _checked(router_parser, lambda: model_from_options(RouterConfig, ns))
    _port_free(router_parser, config.host, config.port)  # said now, as `serve` and `worker` say it
    return run_router(config, log_level=ns.log_level)


def _run_drain(_parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from tandem.runtimes.drain import drain

    return drain(ns.url, ns.timeout)


def _run_operator(_parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from tandem.operator.main import run_operator

    return run_operator(ns.namespace, peering=ns.peering, priority=ns.priority, liveness=ns.liveness,
                        kubeconfig=ns.kubeconfig, context=ns.context, resync_seconds=ns.resync_seconds or None)


def _run_bench(bench_parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from tandem.bench.command import run_bench_command
    from tandem.bench.config import BenchConfig

    try:
        config = model_from_options(BenchConfig, ns)
    except ValidationError as exc:
        bench_parser.error(_options_error(exc))
    return run_bench_command(config)


def _run_plan(plan_parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from tandem.planning.command import run_plan_command
    from tandem.planning.profile import WorkloadProfile

    try:
        profile = model_from_options(WorkloadProfile, ns)
    except ValidationError as exc:
        plan_parser.error(_options_error(exc))
    return run_plan_command(profile, ns.curve, ns.patch_style, ns.patch_out, ns.output_format)


_COMMANDS = {"worker": _run_worker, "serve": _run_serve, "router": _run_router, "drain": _run_drain,
             "operator": _run_operator, "bench": _run_bench, "plan": _run_plan}
