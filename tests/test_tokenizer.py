"""Our Tokenizer against transformers' AutoTokenizer: SmolLM2 from its GGUF metadata, and a HF folder."""

from __future__ import annotations

import json
import shutil

import jinja2
import pytest
from tokenizers import pre_tokenizers

from tandem.gguf_file import open_gguf
from tandem.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nend\r\nwindows",
    "naïve café — 東京 🤖 emoji👍🏽 ÄÖÜ ß \u00a0nbsp",
    "def f(x):\n    return x**2  # square\n\n\tif x != 0: pass",
    "numbers 1234567 and 3.14159, year 2024, x1y2z3",
    "It's we've they'll I'd DON'T",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "plain <|im_start|>inline<|im_end|>specials",
    "",
    " ",
]
# Digits after a run of spaces: the SmolLM2 vocabulary was trained with each digit split off first
# (tokenizer.json: Digits(individual_digits) + ByteLevel; llama.cpp's "smollm" pre-tokenizer is the same).
# transformers' GGUF conversion does not know "smollm" and uses the plain GPT-2 split, which tokenizes
# "  1" as [Ġ, Ġ, 1] instead of [ĠĠ, 1]; for these we compare with the hub's pre-tokenizer instead.
DIGIT_RUNS = ["  1  22   333", "a  7\n  8"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi\nthere 👋"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ],
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2) -> Tokenizer:
    """Built from the GGUF metadata by the loader (shared with the model tests' session fixture)."""
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def hub_style_reference(tmp_path_factory, hf_smollm2_tokenizer):
    """The HF tokenizer with the pre-tokenizer SmolLM2's own tokenizer.json has."""
    folder = tmp_path_factory.mktemp("smollm2_hub_tokenizer")
    hf_smollm2_tokenizer.save_pretrained(folder)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return reference


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(smollm2_tokenizer, hf_smollm2_tokenizer, text):
    expected = hf_smollm2_tokenizer(text)["input_ids"]
    assert smollm2_tokenizer.encode(text) == expected
    for skip in (True, False):
        assert smollm2_tokenizer.decode(expected, skip_special_tokens=skip) == hf_smollm2_tokenizer.decode(
            expected, skip_special_tokens=skip
        )


@pytest.mark.parametrize("text", DIGIT_RUNS + TEXTS)
def test_gguf_tokenizer_matches_smollm2_hub_pre_tokenizer(smollm2_tokenizer, hub_style_reference, text):
    assert smollm2_tokenizer.encode(text) == hub_style_reference(text)["input_ids"]


def test_smollm2_special_tokens_and_no_bos(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, [2], 49152)
    assert not tok.add_bos and tok.encode("hi")[:1] != [1]  # the GGUF says add_bos_token = False
    assert tok.encode("<|im_start|>user") == [1, *tok.encode("user")]  # a control token stays whole
    assert tok.decode(tok.encode("<|im_end|>ok")) == "ok"
    assert tok.token_to_str(2) == "<|im_end|>"
    assert tok.token_to_str(tok.encode(" hello")[0]) == " hello"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    smollm2_tokenizer, hf_smollm2_tokenizer, tiny_llama_dir, conversation, add_generation_prompt
):
    expected = hf_smollm2_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert smollm2_tokenizer.apply_chat_template(conversation, add_generation_prompt) == expected
    # The same template read back from a HF folder (transformers v5 saves it as chat_template.jinja).
    assert Tokenizer.from_pretrained(tiny_llama_dir).apply_chat_template(conversation, add_generation_prompt) == expected


def test_hf_folder_tokenizer_matches_transformers(tiny_llama_dir):
    ours = Tokenizer.from_pretrained(tiny_llama_dir)
    reference = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    for text in TEXTS:
        ids = reference(text)["input_ids"]
        assert ours.encode(text) == ids
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == [reference.eos_token_id] and ours.bos_token_id == reference.bos_token_id


def test_template_helpers_behave_like_transformers(smollm2_tokenizer):
    template = (
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ bos_token }}{{ messages[0] | tojson }}{% if tools is defined %}|tools{% endif %}"
    )
    tok = Tokenizer(smollm2_tokenizer.backend, bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}]) == (
        '<|im_start|>{"role": "user", "content": "é<b>"}|tools'
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer(smollm2_tokenizer.backend, chat_template="{{ ''.__class__.__mro__ }}").apply_chat_template([])


def test_add_bos_token_from_tokenizer_config(tiny_llama_dir, tmp_path):
    folder = tmp_path / "with_bos"
    shutil.copytree(tiny_llama_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(add_bos_token=True, bos_token={"content": "<|endoftext|>", "special": True})
    config_path.write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(str(folder))
    assert tok.add_bos and tok.bos_token_id == 0
    assert tok.encode("hi") == [0, *tok.encode("hi", add_special_tokens=False)]
    assert tok.encode("<|endoftext|>hi")[:2] == [0, 6004]  # BOS is not doubled


def test_missing_or_unsupported_tokenizers_are_refused(tmp_path):
    import gguf

    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'llama' is not supported"):
        Tokenizer.from_gguf(open_gguf(str(tmp_path / "spm.gguf")))


@pytest.mark.parametrize("text", ["Hello 🎉 日本語 wörld", "<|im_start|>user\nnaïve café<|im_end|>"])
def test_token_bytes_join_back_into_the_text(smollm2_tokenizer, text):
    """A token holding part of a UTF-8 character decodes alone to U+FFFD; its bytes (logprobs' `bytes`) are whole."""
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert any(smollm2_tokenizer.token_to_str(i) == "\ufffd" for i in ids) or "🎉" not in text
    assert b"".join(smollm2_tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_a_sentencepiece_style_tokenizer():
    """Llama 2 / Mistral style: spaces as U+2581, characters outside the vocabulary as <0xNN> byte tokens."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("\u2581", "h", "i", "\u2581h", "\u2581hi"):
        vocab[piece] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab, [("\u2581", "h"), ("\u2581h", "i")], byte_fallback=True,
                                          unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = Tokenizer(backend)
    ids = tokenizer.encode("hi 日", add_special_tokens=False)
    assert any(backend.id_to_token(i).startswith("<0x") for i in ids)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == " hi 日".encode()


@pytest.mark.parametrize("final", ["My favourite colour is", "  The answer: ", "x"])
def test_a_conversation_left_open_matches_transformers(smollm2_tokenizer, hf_smollm2_tokenizer, final):
    """vLLM's continue_final_message: the client begins the assistant's answer and the model goes on with it."""
    from tandem.openai.chat import ChatCompletionRequest

    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": final}]
    expected = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    request = ChatCompletionRequest(model="m", messages=messages, add_generation_prompt=False,
                                    continue_final_message=True)
    assert request.prompt_text(smollm2_tokenizer) == expected
    closed = ChatCompletionRequest(model="m", messages=messages, add_generation_prompt=False)
    assert closed.prompt_text(smollm2_tokenizer) == hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize("options,param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with the default add_generation_prompt
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")])
def test_chat_template_options_that_contradict_are_refused(smollm2_tokenizer, options, param):
    from tandem.errors import APIError
    from tandem.openai.chat import ChatCompletionRequest

    request = ChatCompletionRequest(model="m", messages=[{"role": "assistant", "content": "Hi"}], **options)
    with pytest.raises(APIError) as caught:
        request.prompt_text(smollm2_tokenizer)
    assert caught.value.status == 400 and caught.value.param == param


def test_a_developer_message_is_a_system_message_to_a_template_that_knows_no_developer(smollm2_tokenizer):
    """OpenAI's newer name for the system role: SmolLM2's template would add its default system prompt too."""
    from tandem.openai.chat import ChatCompletionRequest

    def prompt(role: str) -> str:
        return ChatCompletionRequest(model="m", messages=[{"role": role, "content": "Be brief."},
                                                          {"role": "user", "content": "Hi"}]).prompt_text(smollm2_tokenizer)

    assert "developer" not in smollm2_tokenizer.chat_template
    assert prompt("developer") == prompt("system") and "Be brief." in prompt("system")


def test_any_chat_template_kwarg_is_a_template_variable_or_a_400(smollm2_tokenizer):
    """`self` collided with a Python parameter (a 500 on router and worker, found by a robustness-testing helper);
    a variable the template cannot use (a number where it loops) is the client's 400, not a 500."""
    import copy

    from tandem.errors import APIError
    from tandem.openai.chat import ChatCompletionRequest

    def prompt(tokenizer, **kwargs) -> str:
        return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}],
                                     chat_template_kwargs=kwargs).prompt_text(tokenizer)

    assert prompt(smollm2_tokenizer, self=1, variables=2) == prompt(smollm2_tokenizer)
    looping = copy.copy(smollm2_tokenizer)
    looping.chat_template = "{% for tool in tools or [] %}{{ tool }}{% endfor %}{{ messages[0]['content'] }}"
    looping._compiled_template = None
    assert prompt(looping, tools=["t1"]) == "t1Hi"
    with pytest.raises(APIError) as caught:
        prompt(looping, tools=5)
    assert caught.value.status == 400 and caught.value.param == "chat_template_kwargs"
