"""Token-block hashing shared by workers (prefix cache) and routers (routing keys).

The hash of block i is blake2b(parent_hash || int32 little-endian token ids, digest_size=8);
the parent of block 0 is a seed derived from the model name (ARCHITECTURE.md §3). Hashes are
returned as unsigned 64-bit ints so they can key dicts and sit on a hash ring directly.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16


def model_seed(model_name: str) -> int:
    """The parent hash of block 0: different models never share cache keys."""
    digest = hashlib.blake2b(b"tandem-block-hash-v1:" + model_name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def adapter_seed(seed: int, adapter: str | None) -> int:
    """The block-0 parent of a LoRA adapter's requests: adapters never share cache keys with each other or the
    base model (None: the base model's seed itself)."""
    if adapter is None:
        return seed
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + b"lora:" + adapter.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block, chained on its parent's hash."""
    payload = parent.to_bytes(8, "little") + struct.pack(f"<{len(token_ids)}i", *token_ids)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, seed: int, start: int = 0,
                 parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`.

    `start`/`parent` let a caller extend an already-hashed prefix: hashing resumes at block
    index `start` with `parent` the hash of block start-1 (or the seed when start == 0).
    """
    hashes: list[int] = []
    prev = seed if parent is None else parent
    for i in range(start, len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(prev)
    return hashes
