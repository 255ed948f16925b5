"""CLI options come from the pydantic config models: one source of defaults; `tandem serve` says what stops it."""

import os
import socket
import subprocess
import sys

from tandem.cli.args import add_model_options, model_from_options
from tandem.config import EngineConfig, WorkerConfig
from tandem.runtimes.launcher import free_port


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
                  "--no-enable-prefix-caching", "--num-kv-blocks", "12", "--dtype", "float32",
                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert cfg.role == "prefill" and cfg.port == 9001
    e = cfg.engine
    assert (e.max_num_batched_tokens, e.enable_prefix_caching, e.num_kv_blocks, e.dtype) == (64, False, 12, "float32")
    assert (e.tool_call_parser, e.enable_auto_tool_choice) == ("hermes", True)


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONSAFEPATH": "1"})


def test_serve_on_a_port_in_use_says_so_before_starting_anything():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _serve("--port", str(taken.getsockname()[1]), timeout=30)
    assert done.returncode == 2
    assert "is in use" in done.stderr and "--port" in done.stderr and "starting" not in done.stdout


def test_a_worker_on_a_port_in_use_says_so_before_loading_its_model():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "tandem.cli", "worker", "--port", str(port)], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert done.returncode == 1
    assert done.stderr.strip().endswith(f"tandem worker: port {port} on 127.0.0.1 is in use; choose another with --port")
    assert "Traceback" not in done.stderr


def test_a_worker_whose_kv_cache_cannot_hold_its_context_says_so(tiny_llama_dir):
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "worker", "--model", tiny_llama_dir, "--port",
                           str(free_port()), "--num-kv-blocks", "4", "--max-model-len", "256"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert done.returncode == 1
    assert done.stderr.strip().endswith("tandem worker: max_model_len=256 does not fit: the KV cache holds 64 tokens "
                                        "(4 blocks of 16); give it more with --kv-cache-memory-gb or --num-kv-blocks, "
                                        "or lower --max-model-len")
    assert "Traceback" not in done.stderr


def test_serve_with_a_model_that_does_not_exist_says_why_before_starting_anything():
    for named in ([], ["--served-model-name", "mine"]):  # named or not, the model itself is checked
        done = _serve("--model", "smollm3", *named, "--port", str(free_port()), timeout=30)
        assert done.returncode == 2
        assert done.stderr.startswith("tandem serve: model 'smollm3' is neither 'smollm2'")
        assert "Traceback" not in done.stderr and "starting" not in done.stdout
        assert len(done.stderr.splitlines()) == 1


def test_a_misspelt_option_is_said_by_its_command(capsys):
    import pytest

    from tandem.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["worker", "--modle", "smollm2"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "tandem worker: error: unrecognized arguments: --modle smollm2" in err and "--model" in err
    with pytest.raises(SystemExit) as exited:  # no abbreviations: `--pre 2` is not taken for --prefill 2
        main(["serve", "--colocated", "--pre", "2"])
    assert exited.value.code == 2
    assert "tandem serve: error: unrecognized arguments: --pre 2" in capsys.readouterr().err


def test_bad_options_and_models_are_one_line_before_anything_starts(capsys, tmp_path):
    """Each command says what is wrong in one line and exits 2, before loading a model or starting a process: a
    pydantic traceback before, and for `serve` a router option was only refused by the router process once the
    workers had started (found by a newcomer's walkthrough)."""
    import socket

    import pytest

    from tandem.cli import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    foreign = tmp_path / "gpt2"  # a checkpoint of an architecture the engine does not run
    foreign.mkdir()
    (foreign / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    cases = {
        ("worker", "--model", "nonexistent"): "tandem worker: model 'nonexistent' is neither 'smollm2'",
        ("worker", "--model", str(tmp_path / "gone.gguf")): f"tandem worker: model '{tmp_path / 'gone.gguf'}': no such",
        ("worker", "--model", str(foreign)): "tandem worker: unsupported architecture GPT2LMHeadModel (supported: ",
        ("serve", "--model", str(foreign)): "tandem serve: unsupported architecture GPT2LMHeadModel (supported: ",
        ("router", "--model", "nonexistent", "--decode", "http://127.0.0.1:1"): "tandem router: model 'nonexistent'",
        ("router", "--decode", "http://127.0.0.1:1", "--port", str(taken.getsockname()[1])):
            f"tandem router: port {taken.getsockname()[1]} on 127.0.0.1 is in use",
        ("serve", "--kv-cache-memory-gb", "0"): "tandem serve: --kv-cache-memory-gb: Input should be greater than 0",
        ("serve", "--max-num-seqs", "0"): "tandem serve: --max-num-seqs: Input should be greater than or equal to 1",
        ("serve", "--port", "99999"): "tandem serve: --port: Input should be less than or equal to 65535",
        ("serve", "--disagg-min-tokens", "-5"): "tandem serve: --disagg-min-tokens: Input should be greater",
        # vLLM's switch is taken, and as in vLLM it needs a parser (which alone serves tool_choice "auto" here).
        ("worker", "--enable-auto-tool-choice"): "tandem worker: options: --enable-auto-tool-choice needs "
                                                 "--tool-call-parser",
        ("router", "--decode", "http://127.0.0.1:1", "--enable-auto-tool-choice"):
            "tandem router: options: --enable-auto-tool-choice needs --tool-call-parser",
    }
    with pytest.raises(SystemExit) as exited:  # an option that would be ignored is refused too
        main(["serve", "--colocated", "--prefill", "2"])
    assert exited.value.code == 2 and "--colocated runs no prefill pool" in capsys.readouterr().err
    try:
        for argv, said in cases.items():
            with pytest.raises(SystemExit) as exited:
                main(list(argv))
            err = capsys.readouterr().err
            assert exited.value.code == 2, argv
            assert err.startswith(said) and len(err.splitlines()) == 1, (argv, err)
    finally:
        taken.close()


def test_a_process_a_signal_ended_is_said_so():
    from tandem.runtimes.local_stack import how_it_ended

    assert how_it_ended(-9) == "was killed by SIGKILL" and how_it_ended(1) == "exited with 1"


def test_device_cuda_without_cuda_is_one_line_before_anything_starts(monkeypatch, capsys):
    """Found by a newcomer's walkthrough: `serve --device cuda` on a CPU machine loaded the model for 20 s, then
    ended in torch's "Torch not compiled with CUDA enabled" traceback."""
    import pytest
    import torch

    from tandem.cli import main

    def started(*args, **kwargs):
        raise AssertionError("started with a device that is not there")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("tandem.runtimes.local_stack.run_local_stack", started)
    monkeypatch.setattr("tandem.workers.main.run_worker", started)
    for command in ("serve", "worker"):
        with pytest.raises(SystemExit) as exited:
            main([command, "--device", "cuda", "--port", str(free_port())])
        err = capsys.readouterr().err
        assert exited.value.code == 2
        assert err.startswith(f"tandem {command}: --device cuda: CUDA is not available here") and \
            len(err.splitlines()) == 1, err


def test_serve_says_its_own_argument_errors_with_its_own_usage(capsys):
    """`serve --decode 0` printed the top-level usage (`tandem [-h] {worker,serve,...}`) and `tandem: error: serve:`."""
    import pytest

    from tandem.cli import main

    for argv, said in ((["serve", "--decode", "0"], "tandem serve: error: needs --decode >= 1"),
                       (["serve", "--colocated", "--prefill", "1"], "tandem serve: error: --colocated runs no prefill"),
                       (["bench", "--requests", "0"], "tandem bench: error: --requests: Input should be greater")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and said in err, err
        assert err.startswith(f"usage: tandem {argv[0]} ") and "tandem: error" not in err, err
