"""LoRA adapters on the router: which a request's `model` names, and adapter affinity in placement."""

from __future__ import annotations

from tandem.openai.model_routes import model_not_found


def served_adapters(router) -> list[str]:
    """Every adapter some worker in rotation reports serving, in name order."""
    pools = (router.prefill, router.decode)
    return sorted({name for pool in pools for worker in pool.healthy() for name in worker.lora_adapters})


def resolve_lora(router, model: str | None) -> str | None:
    """The adapter `model` names (None: the base model), or a 404 model_not_found."""
    if model is None or model == router.served_name:
        return None
    if any(model in worker.lora_adapters for pool in (router.prefill, router.decode) for worker in pool.healthy()):
        return model
    raise model_not_found(router.served_name, model)


def lacking_adapter(pool, lora: str | None) -> set[str]:
    """The pool's workers that do not hold `lora`, to leave out of its placement while some healthy one does
    (the policy then chooses among the holders, with its bounded loads); empty for the base model."""
    if lora is None:
        return set()
    holders = {w.url for w in pool.healthy() if lora in w.lora_adapters}
    return set() if not holders else {url for url in pool.workers if url not in holders}
