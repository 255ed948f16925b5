"""Multi-LoRA: adapters batched with the base model match transformers + peft; no KV shared across adapters."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tandem.config import EngineConfig
from tandem.metrics import EngineMetrics
from tandem.protocol import SamplingParams
from tandem.workers.engine.llm_engine import LLMEngine
from tandem.workers.lora.adapter import AdapterError
from tandem.workers.lora.layer import LoRALinear
from tandem.workers.lora.mapping import StepMapping
from tandem.workers.models.loader import load_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, seed): different ranks, targets and fused-projection slices.
ADAPTERS = {"a1": (8, 16, ALL, 11), "a2": (4, 8, ["q_proj", "v_proj"], 12), "a3": (16, 8, ["o_proj", "gate_proj", "down_proj"], 13)}
PROMPTS = [[1, 15, 27, 33, 9, 101, 7, 250, 18, 44, 3, 5, 77, 12, 90, 61, 300, 2000, 6, 71], [1, 400, 5, 8, 19, 3]]


def _hf_base(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def write_adapter(model_dir, path, rank, alpha, targets, seed) -> str:
    """A PEFT adapter of the tiny model with random non-zero lora_B (peft starts B at zero)."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(_hf_base(model_dir), peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                                     lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {name: write_adapter(tiny_llama_dir, root / name, *spec) for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, adapters) -> dict:
    """Greedy tokens of transformers (+ peft's PeftModel), float32, by (adapter or None, prompt index)."""
    out = {}
    for name in [None, *adapters]:
        model = _hf_base(tiny_llama_dir)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, adapters[name]).eval()
        for i, prompt in enumerate(PROMPTS):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)
            out[name, i] = gen[0, len(prompt):].tolist()
    return out


def make_engine(model_dir, adapters, **overrides) -> LLMEngine:
    loaded = load_model(model_dir, dtype="float32", backend="torch")  # fresh: the manager attaches to its Linears
    settings = dict(num_kv_blocks=256, max_num_batched_tokens=256, max_num_seqs=16, enable_lora=True,
                    lora_modules=[f"{n}={p}" for n, p in adapters.items()], max_loras=3, block_size=4)
    settings.update(overrides)
    return LLMEngine(loaded, EngineConfig(**settings), EngineMetrics(loaded.config.name, "both"))


def run(engine: LLMEngine, requests: list[tuple[list[int], str | None]], max_tokens: int = 8) -> list:
    """Runs the requests together; (tokens, cached prompt tokens) of each, in order."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = []
    for prompt, lora in requests:
        ids.append(f"r{len(ids)}-{id(requests)}")
        engine.add_request(ids[-1], prompt, params, lora=lora)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
    return [(tokens[i], cached.get(i, 0)) for i in ids]


def test_lora_linear_matches_per_row_reference():
    torch.manual_seed(0)
    mapping = StepMapping(torch.device("cpu"))
    layer = LoRALinear([("q", 0, 6), ("k", 6, 4)], 5, 10, num_slots=2, max_rank=3, mapping=mapping,
                       dtype=torch.float32, device=torch.device("cpu"))
    w = {0: {"q": (torch.randn(2, 5), torch.randn(6, 2))}, 1: {"q": (torch.randn(3, 5), torch.randn(6, 3)),
                                                              "k": (torch.randn(1, 5), torch.randn(4, 1))}}
    for slot, weights in w.items():
        layer.set_slot(slot, weights)
    x = torch.randn(7, 5)
    row_slots, query_lens = [1, -1, 0, 1], [3, 1, 2, 1]
    mapping.set(row_slots, query_lens)
    y = layer.apply(x, torch.zeros(7, 10))
    token_slots = [s for s, n in zip(row_slots, query_lens) for _ in range(n)]
    for t, slot in enumerate(token_slots):
        want = torch.zeros(10)
        for name, start, rows in layer.slices:
            if slot >= 0 and name in w[slot]:
                a, b = w[slot][name]
                want[start:start + rows] = b @ (a @ x[t])
        torch.testing.assert_close(y[t], want)


def test_each_adapter_alone_matches_peft(tiny_llama_dir, adapters, expected):
    engine = make_engine(tiny_llama_dir, adapters)
    for name in [None, *adapters]:
        for i, prompt in enumerate(PROMPTS):
            [(tokens, _)] = run(engine, [(prompt, name)])
            assert tokens == expected[name, i], (name, i)


def test_mixed_batch_equals_each_alone(tiny_llama_dir, adapters, expected):
    engine = make_engine(tiny_llama_dir, adapters, enable_prefix_caching=False)
    requests = [(p, name) for name in [None, *adapters] for p in PROMPTS]
    results = run(engine, requests)
    for (prompt, name), (tokens, _) in zip(requests, results):
        assert tokens == expected[name, PROMPTS.index(prompt)], name
    assert engine.lora.resident and len(set(engine.lora.resident)) == 3


def test_base_model_unchanged_while_adapters_loaded(tiny_llama_dir, adapters, expected):
    engine = make_engine(tiny_llama_dir, adapters)
    results = run(engine, [(PROMPTS[0], "a1"), (PROMPTS[0], None), (PROMPTS[1], "a2"), (PROMPTS[1], None)])
    assert [r[0] for r in results] == [expected["a1", 0], expected[None, 0], expected["a2", 1], expected[None, 1]]


def test_no_prefix_cache_hit_across_adapters(tiny_llama_dir, adapters, expected):
    engine = make_engine(tiny_llama_dir, adapters)
    prompt = PROMPTS[0]
    [(first, _)] = run(engine, [(prompt, "a1")])
    [(second, hits_other)] = run(engine, [(prompt, "a2")])
    [(third, hits_same)] = run(engine, [(prompt, "a1")])
    [(base, hits_base)] = run(engine, [(prompt, None)])
    assert (first, second, third, base) == (expected["a1", 0], expected["a2", 0], expected["a1", 0], expected[None, 0])
    assert hits_other == 0 and hits_base == 0 and hits_same > 0


def test_lru_beyond_max_loras(tiny_llama_dir, adapters, expected):
    """One device slot and one host slot: the scheduler runs one adapter at a time, swapping from disk."""
    engine = make_engine(tiny_llama_dir, adapters, max_loras=1, max_cpu_loras=1)
    requests = [(PROMPTS[1], name) for name in ["a1", "a2", None, "a3", "a1"]]
    results = run(engine, requests)
    assert [r[0] for r in results] == [expected[name, 1] for _, name in requests]


def test_load_and_unload_at_run_time(tiny_llama_dir, adapters, expected):
    engine = make_engine(tiny_llama_dir, {"a1": adapters["a1"]})
    with pytest.raises(ValueError, match="no LoRA adapter named 'a2'"):
        run(engine, [(PROMPTS[0], "a2")])
    engine.add_lora("a2", adapters["a2"])
    assert run(engine, [(PROMPTS[0], "a2")])[0][0] == expected["a2", 0]
    engine.remove_lora("a2")
    with pytest.raises(KeyError):
        engine.remove_lora("a2")
    # The same name, other weights: the old adapter's cached KV is not found.
    engine.add_lora("a2", adapters["a3"])
    tokens, hits = run(engine, [(PROMPTS[0], "a2")])[0]
    assert tokens == expected["a3", 0] and hits == 0


def _edit_adapter(src, dst, config_edit=None, tensor_edit=None) -> str:
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f)
    if config_edit:
        config_edit(config)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    if tensor_edit:
        tensors = tensor_edit(tensors)
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    return str(dst)


def test_malformed_adapters_are_refused_with_the_reason(tiny_llama_dir, adapters, tmp_path):
    engine = make_engine(tiny_llama_dir, {}, max_lora_rank=8)
    with pytest.raises(AdapterError, match="rank 16 exceeds --max-lora-rank 8"):
        engine.add_lora("big", adapters["a3"])
    unknown = _edit_adapter(adapters["a2"], tmp_path / "unknown",
                            config_edit=lambda c: c.update(target_modules=["q_proj", "embed_tokens"]))
    with pytest.raises(AdapterError, match="unknown target module 'embed_tokens'"):
        engine.add_lora("unknown", unknown)
    narrow = _edit_adapter(adapters["a2"], tmp_path / "narrow",
                           tensor_edit=lambda t: {k: v[:, :32].contiguous() if "lora_A" in k else v for k, v in t.items()})
    with pytest.raises(AdapterError, match="do not fit the base model"):
        engine.add_lora("narrow", narrow)
    assert engine.lora.names == []
    assert run(engine, [(PROMPTS[1], None)], max_tokens=2)  # nothing else disturbed


def test_bad_lora_modules_stop_the_start(tiny_llama_dir, adapters):
    with pytest.raises(AdapterError, match="rank 16 exceeds"):
        make_engine(tiny_llama_dir, {"a3": adapters["a3"]}, max_lora_rank=8)
    with pytest.raises(ValueError, match="needs --enable-lora"):
        EngineConfig(lora_modules=["x=/y"])


def test_worker_api_serves_adapters_by_model(tiny_llama_dir, adapters, expected, tmp_path):
    """A `tandem worker`: adapters chosen by `model`, listed with their parent, loaded and unloaded at run time."""
    import httpx

    from tandem.runtimes.launcher import ServiceProcess
    from tandem.tokenizer import load_tokenizer

    args = ["worker", "--role", "both", "--model", tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
            "--num-kv-blocks", "128", "--enable-lora", "--lora-modules", f"a1={adapters['a1']}", "--max-loras", "2"]
    text = load_tokenizer(tiny_llama_dir).decode
    with ServiceProcess(args, name="lora-worker") as worker, httpx.Client(base_url=worker.url, timeout=120) as http:
        def complete(model):
            return http.post("/v1/completions", json={"model": model, "prompt": PROMPTS[0], "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True})

        cards = http.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("a1", "tiny")]
        answer = complete("a1").json()
        assert answer["model"] == "a1" and answer["choices"][0]["text"] == text(expected["a1", 0])
        assert complete("tiny").json()["choices"][0]["text"] == text(expected[None, 0])
        missing = complete("a2")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters["a2"]})
        assert loaded.status_code == 200, loaded.text
        assert complete("a2").json()["choices"][0]["text"] == text(expected["a2", 0])
        assert http.get("/internal/load").json()["lora_adapters"] == ["a1", "a2"]
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 404
        assert complete("a2").status_code == 404


def test_pd_with_an_adapter_is_token_exact(tiny_llama_dir, adapters, expected):
    """Prefill on one engine and decode on another, both applying the adapter: the tokens of peft alone."""
    from tandem.workers.engine.llm_engine import RemoteKV
    from tandem.workers.kv_transfer import create_kv_transfer

    prefill = make_engine(tiny_llama_dir, adapters, kv_pull_in_background="on")
    decode = make_engine(tiny_llama_dir, adapters, kv_pull_in_background="on")
    prefill.kv_transfer = create_kv_transfer("tcp", prefill.runner.kv_cache, "p-lora")
    decode.kv_transfer = create_kv_transfer("tcp", decode.runner.kv_cache, "d-lora")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        for name in ["a1", "a3", None]:
            prefill.add_request(f"p-{name}", PROMPTS[0], params, prefill_only=True, lora=name)
            outs = [out for _ in range(50) for out in prefill.step()]
            lease = outs[-1].kv_lease
            source = RemoteKV(prefill.kv_transfer.agent_info(), lease.block_ids, lease.expires_at)
            decode.add_request(f"d-{name}", PROMPTS[0], params, first_token_id=outs[-1].new_token_ids[0],
                               kv_source=source, lora=name)
            tokens, status = list(outs[-1].new_token_ids), None
            while decode.has_unfinished_requests():
                for out in decode.step():
                    tokens += out.new_token_ids
                    status = status or out.kv_status
            prefill.release_lease(lease.lease_id)
            assert tokens == expected[name, 0] and status == "pulled", name
    finally:
        prefill.kv_transfer.close()
        decode.kv_transfer.close()
