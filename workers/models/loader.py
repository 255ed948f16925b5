"""Turns a model source (the "smollm2" alias, a .gguf file or a HF folder) into a ready model + tokenizer."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch

from tandem.gguf_file import open_gguf
from tandem.model_source import DEFAULT_MODEL_ALIAS, resolve_model_source  # noqa: F401 (re-exported)
from tandem.tokenizer import Tokenizer
from tandem.workers.kernels import gguf_linear
from tandem.workers.layers.ops import get_ops
from tandem.workers.models.config import ModelConfig
from tandem.workers.models.gguf_loader import iter_gguf_blocks, iter_gguf_tensors, load_gguf_config
from tandem.workers.models.hf_loader import iter_hf_tensors, load_hf_config
from tandem.workers.models.llama import MAX_GGUF_BLOCK_ROWS, LlamaForCausalLM
from tandem.workers.models.registry import model_class
from tandem.workers.tensor_parallel import TPGroup

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = (None, "fp8")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    source: str  # the resolved path
    dtype: torch.dtype
    device: torch.device
    tp: TPGroup | None = None  # this rank's tensor-parallel group: the model is its shard

    @property
    def gguf_block_gemms(self) -> int:
        """GEMMs that read GGUF blocks at small batch sizes (see quantized_gemv)."""
        return self.model.gguf_block_gemms


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Tensors created inside are `dtype` by default (the model is built in its final dtype)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _has_tokenizer(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, "tokenizer.json"))


def load_engine_config(source: str) -> ModelConfig:
    """The architecture of the model `source` names, read without its weights."""
    path = resolve_model_source(source)
    return load_hf_config(path) if os.path.isdir(path) else load_gguf_config(open_gguf(path))


def load_model(
    source: str,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    backend: str = "torch",
    served_name: str | None = None,
    quantized_gemv: str = "auto",
    quantization: str | None = None,
    tp: TPGroup | None = None,
) -> LoadedModel:
    """Loads weights, config and tokenizer (None when the checkpoint has none). dtype "auto" is float32 on
    CPU and bfloat16 on CUDA; the served name defaults to "smollm2" for the alias, else the checkpoint's
    folder or file stem. quantized_gemv "auto": on CPU, the GEMMs of a GGUF file's Q4_0 / Q4_1 / Q8_0
    weights also keep the file's blocks, read instead of the float weights for a few rows (decode steps of
    small batches) where the native kernel runs (AVX-512); "off": the float weights only. quantization "fp8": the
    decoder layers' GEMM weights are quantized to FP8 once loaded (tandem.workers.layers.fp8_linear). `tp`: load
    this rank's shard (tandem.workers.tensor_parallel)."""
    if quantized_gemv not in ("auto", "off"):
        raise ValueError(f"quantized_gemv must be 'auto' or 'off', not {quantized_gemv!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; supported: {', '.join(map(str, QUANTIZATIONS[1:]))}")
    path = resolve_model_source(source)
    if quantization is not None and not os.path.isdir(path):
        raise ValueError(f"--quantization {quantization} quantizes a float checkpoint, and {source!r} is a GGUF file, "
                         "whose weights are quantized already")
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device)
    ops = get_ops(backend)
    if served_name is None:
        stem = os.path.basename(os.path.normpath(path))
        served_name = DEFAULT_MODEL_ALIAS if source == DEFAULT_MODEL_ALIAS else os.path.splitext(stem)[0]

    if os.path.isdir(path):
        config = load_hf_config(path)
        tokenizer = Tokenizer.from_pretrained(path) if _has_tokenizer(path) else None
        weights = iter_hf_tensors(path)
    else:
        reader = open_gguf(path)
        config = load_gguf_config(reader)
        tokenizer = Tokenizer.from_gguf(reader) if "tokenizer.ggml.model" in reader.fields else None
        weights = iter_gguf_tensors(reader, config)
    config.name = served_name

    # Parameters are allocated uninitialised, in the target dtype and on the target device, then loaded.
    with torch.device(device), default_dtype(torch_dtype):
        model = model_class(config.architecture)(config, ops, tp)
    model.load_weights(weights)
    if quantization == "fp8":
        model.quantize_fp8()
    model.eval()
    if (quantized_gemv == "auto" and device.type == "cpu" and not os.path.isdir(path) and tp is None
            and torch_dtype in MAX_GGUF_BLOCK_ROWS):  # float16 activations, or shards: the float weights only
        if gguf_linear.supported():
            model.attach_gguf_blocks(iter_gguf_blocks(reader, config))
        else:
            log.info("GGUF blocks are not read here (the GEMV needs the native CPU extension and AVX-512): "
                     "every GEMM uses the dequantized weights")
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, source=path, dtype=torch_dtype, device=device,
                       tp=tp)
