"""A follower rank of a tensor-parallel worker (tandem.workers.tensor_parallel): it loads its shard of the model, holds
the cache of its KV heads, and runs every step rank 0 broadcasts, until rank 0 sends none or goes away.

    python -m tandem.workers.tp_follower --rank R --size N --port P --engine-config JSON   (started by rank 0)
"""

from __future__ import annotations

import argparse
import logging

from tandem.config import EngineConfig
from tandem.workers.engine.llm_engine import load_engine_model, resolve_device
from tandem.workers.engine.model_runner import ModelRunner
from tandem.workers.tensor_parallel import device_for, init_process_group

log = logging.getLogger("tandem.worker.tp")


def run_follower(rank: int, size: int, port: int, config: EngineConfig) -> None:
    import torch

    device, _ = resolve_device(config)
    group = init_process_group(rank, size, port, device_for(rank, torch.device(device)))
    loaded = load_engine_model(config, group)
    runner = ModelRunner(loaded, config)  # takes rank 0's context limit and cache size
    log.info("tensor-parallel rank %d of %d ready", rank, size)
    while (step := group.broadcast(None)) is not None:
        runner.run_step(step)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine-config", required=True, help="the worker's EngineConfig as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(name)s: %(message)s")
    run_follower(args.rank, args.size, args.port, EngineConfig.model_validate_json(args.engine_config))


if __name__ == "__main__":
    main()
