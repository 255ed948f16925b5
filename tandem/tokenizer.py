"""Text <-> token ids and chat templates, from a HF tokenizer folder or from GGUF metadata.

Built on the `tokenizers` library. A GGUF file carries no tokenizer.json, only llama.cpp's vocabulary,
merges and token types; we rebuild the byte-level BPE tokenizer they describe, with the pre-tokenizer
llama.cpp uses for the file's `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4

# Split regexes of llama.cpp's pre-tokenizer types that differ from GPT-2's (from llama-vocab.cpp, as in
# transformers' GGUF support).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizers that put every digit on its own before the GPT-2 split (SmolLM2's tokenizer.json has
# exactly Digits(individual_digits) + ByteLevel; llama.cpp's "smollm" regex list is the same).
_DIGIT_SPLIT = frozenset({"smollm", "starcoder", "refact"})


def _byte_level_pre_tokenizer(pre: str | None):
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level  # "gpt2", "default" and other GPT-2-style files


def _token_content(value) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as serialised AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Like transformers: jinja's own tojson escapes HTML characters, which templates do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(template: str) -> jinja2.Template:
    # The environment transformers renders chat templates in, so templates render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


class Tokenizer:
    """encode/decode and chat templates over a `tokenizers.Tokenizer`."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool | None = None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ):
        """add_bos: True makes encode(add_special_tokens=True) start with BOS even when the backend's
        post-processor does not add it; otherwise the post-processor alone decides (as in transformers).
        special_tokens: extra names (unk_token, pad_token...) that chat templates see."""
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._id_of(bos_token)
        eos_id = self._id_of(eos_token)
        self.eos_token_ids: list[int] = [] if eos_id is None else [eos_id]
        self.chat_template = chat_template
        self._compiled_template = None
        self._template_vars = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._template_vars.update(bos_token=bos_token, eos_token=eos_token)
        self._force_bos = bool(add_bos) and self.bos_token_id is not None
        adds_bos_itself = self.bos_token_id is not None and backend.encode("").ids[:1] == [self.bos_token_id]
        self.add_bos: bool = self._force_bos or adds_bos_itself
        self._added_token_ids = frozenset(backend.get_added_tokens_decoder())

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # -- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_dir: str) -> Tokenizer:
        """From a HF folder: tokenizer.json plus tokenizer_config.json / chat_template.jinja when present."""
        tokenizer_path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(tokenizer_path):
            raise ValueError(f"{model_dir!r} has no tokenizer.json")
        backend = BackendTokenizer.from_file(tokenizer_path)
        config = {}
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in chat_template}
            chat_template = named.get("default")
        template_path = os.path.join(model_dir, "chat_template.jinja")  # where transformers v5 saves it
        if chat_template is None and os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                chat_template = f.read()
        add_bos = config.get("add_bos_token")
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            add_bos=add_bos if isinstance(add_bos, bool) else None,
            chat_template=chat_template,
            special_tokens={
                "unk_token": _token_content(config.get("unk_token")),
                "pad_token": _token_content(config.get("pad_token")),
            },
        )

    @classmethod
    def from_gguf(cls, reader) -> Tokenizer:
        """From the tokenizer.ggml.* metadata of a gguf.GGUFReader (byte-level BPE files only)."""

        def meta(key, default=None):
            field = reader.fields.get(key)
            return default if field is None else field.contents()

        kind = meta("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, tokenizer.ggml.model='gpt2')"
            )
        tokens = meta("tokenizer.ggml.tokens")
        merges = meta("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ValueError("GGUF lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
        token_types = meta("tokenizer.ggml.token_type") or [0] * len(tokens)

        alphabet = set(_CHAR_OF_BYTE.values())

        def byte_level_spelling(token: str) -> str:
            # Every BPE token should already be spelled in the byte alphabet; respell the odd one that is not
            # (as transformers does) so the vocabulary keeps its size.
            if set(token) <= alphabet:
                return token
            return "".join(_CHAR_OF_BYTE[b] for b in token.encode("utf-8"))

        vocab = {byte_level_spelling(token): index for index, token in enumerate(tokens)}
        merge_pairs = []
        for merge in merges:
            pair = tuple(merge.split(" "))
            if len(pair) != 2:
                raise ValueError(f"malformed GGUF merge {merge!r}")
            merge_pairs.append(pair)
        backend = BackendTokenizer(
            models.BPE(
                vocab=vocab,
                merges=merge_pairs,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        backend.pre_tokenizer = _byte_level_pre_tokenizer(meta("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>...) must stay whole in text and be skippable on decode; user-defined
        # ones (<think>...) stay whole but are ordinary text.
        backend.add_special_tokens(
            [
                AddedToken(token, special=True, normalized=False)
                for token, token_type in zip(tokens, token_types)
                if token_type == _CONTROL and set(token) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                AddedToken(token, special=False, normalized=False)
                for token, token_type in zip(tokens, token_types)
                if token_type == _USER_DEFINED and token in vocab
            ]
        )

        def token_at(key: str) -> str | None:
            index = meta(key)
            return None if index is None or not 0 <= index < len(tokens) else tokens[index]

        return cls(
            backend,
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            add_bos=bool(meta("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta("tokenizer.chat_template"),
            special_tokens={
                "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
                "pad_token": token_at("tokenizer.ggml.padding_token_id"),
            },
        )

    # -- use -----------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast: the same ids as encode() without the character offsets nothing here reads, and it
        # releases the GIL while it works, so a thread can tokenize while the event loop goes on.
        ids = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._force_bos and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, whole even when it holds part of a UTF-8 character (which decoding it
        alone turns into U+FFFD): what OpenAI's logprobs `bytes` carry, so that a client can join them back
        into the text."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return self.token_to_str(token_id).encode()
        if token_id in self._added_token_ids:  # special and added tokens are literal
            return piece.encode()
        if isinstance(self.backend.decoder, decoders.ByteLevel):  # GPT-2's byte alphabet, one character a byte
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:
                return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece's byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()  # SentencePiece marks spaces with U+2581

    def token_to_str(self, token_id: int) -> str:
        """The text of one token as decoding it alone gives (special tokens included), e.g. for logprobs."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            variables: dict | None = None, **kwargs) -> str:
        """Renders the conversation with the model's chat template, as transformers' apply_chat_template
        (tokenize=False) does; `variables` and extra keyword arguments are passed to the template (a client's
        chat_template_kwargs come as `variables`: any name, `self` included, is a template variable)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        # transformers always passes tools and documents (None when unused); templates test `is defined`.
        context = {"tools": None, "documents": None, **self._template_vars, **kwargs, **(variables or {}),
                   "messages": messages, "add_generation_prompt": add_generation_prompt}
        return self._compiled_template.render(context)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet, by byte value)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_CHAR_OF_BYTE = _bytes_to_unicode()
_BYTE_OF_CHAR = {char: byte for byte, char in _CHAR_OF_BYTE.items()}


def load_tokenizer(source: str) -> Tokenizer | None:
    """The tokenizer of a model source ('smollm2', a .gguf file or a HF folder), without its weights."""
    from tandem.gguf_file import open_gguf
    from tandem.model_source import resolve_model_source

    path = resolve_model_source(source)
    if os.path.isdir(path):
        return Tokenizer.from_pretrained(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    reader = open_gguf(path)
    return Tokenizer.from_gguf(reader) if "tokenizer.ggml.model" in reader.fields else None
