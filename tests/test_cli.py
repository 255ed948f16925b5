"""CLI options come from the pydantic config models: one source of defaults."""

from tandem.cli_args import add_model_options, model_from_options
from tandem.config import EngineConfig, WorkerConfig


def _parse(argv):
    import argparse

    p = argparse.ArgumentParser()
    add_model_options(p, WorkerConfig)
    add_model_options(p, EngineConfig)
    ns = p.parse_args(argv)
    return model_from_options(WorkerConfig, ns, engine=model_from_options(EngineConfig, ns))


def test_defaults_equal_the_models():
    cfg = _parse([])
    assert cfg == WorkerConfig()


def test_options_parse_into_typed_fields():
    cfg = _parse(["--role", "prefill", "--port", "9001", "--max-num-batched-tokens", "64",
                  "--no-enable-prefix-caching", "--num-kv-blocks", "12", "--dtype", "float32"])
    assert cfg.role == "prefill" and cfg.port == 9001
    e = cfg.engine
    assert (e.max_num_batched_tokens, e.enable_prefix_caching, e.num_kv_blocks, e.dtype) == (64, False, 12, "float32")
