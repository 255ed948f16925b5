"""`tandem` command line: serve, worker (router, operator, bench and plan come with their issues).

Components are imported inside their commands: the core package imports none of them.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tandem.cli_args import add_model_options, model_from_options
from tandem.config import EngineConfig, WorkerConfig


def _worker_parser(sub, name: str, help_text: str, default_port: int) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_options(p, WorkerConfig, skip=("port",))
    p.add_argument("--port", type=int, default=default_port, help="port to listen on (0 picks a free one)")
    add_model_options(p, EngineConfig)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _worker_config(ns: argparse.Namespace) -> WorkerConfig:
    engine = model_from_options(EngineConfig, ns)
    return model_from_options(WorkerConfig, ns, engine=engine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _worker_parser(sub, "worker", "run one engine worker (prefill | decode | both)", 8000)
    _worker_parser(sub, "serve", "run the local stack on this machine (today: one colocated worker)", 8000)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if ns.command in ("worker", "serve"):
        from tandem.workers.main import run_worker

        config = _worker_config(ns)
        if ns.command == "serve":
            config = config.model_copy(update={"role": "both"})
        return run_worker(config, log_level=ns.log_level)
    parser.error(f"unknown command {ns.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
