"""Triton KV-cache writes against the torch reference (tandem.workers.layers.attention.write_kv_cache).

Writes are copies, so results must match exactly (also across dtypes, both sides cast the same way).
"""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels.cache_write import write_kv_cache
from tandem.workers.layers import attention as reference


def random_write(
    device, num_tokens, num_blocks, block_size, num_kv_heads, head_dim, dtype, num_padding=0, seed=0
):
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, head_dim, generator=gen).to(
        device, dtype
    )
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    return kv_cache, key, value, slots.to(device)


def check(kv_cache, key, value, slots, layer=1):
    expected = kv_cache.clone()
    keep = slots >= 0  # the reference has no notion of padding slots
    reference.write_kv_cache(
        key[keep], value[keep], expected[:, layer, 0], expected[:, layer, 1], slots[keep]
    )
    write_kv_cache(key, value, kv_cache[:, layer, 0], kv_cache[:, layer, 1], slots)
    # Other layers and untouched slots must be left as they were: compare the whole cache.
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "num_tokens,num_blocks,block_size,num_kv_heads,head_dim",
    [(1, 2, 16, 1, 64), (37, 6, 16, 2, 64), (20, 3, 32, 3, 128), (70, 4, 64, 4, 80)],
)
def test_matches_reference(device, num_tokens, num_blocks, block_size, num_kv_heads, head_dim):
    check(
        *random_write(
            device, num_tokens, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, seed=num_tokens
        )
    )


def test_negative_slots_are_skipped(device):
    kv_cache, key, value, slots = random_write(device, 30, 4, 16, 2, 64, torch.float32, num_padding=9)
    assert (slots < 0).sum() == 9
    check(kv_cache, key, value, slots)


def test_strided_key_value_and_int32_slots(device):
    kv_cache, key, value, slots = random_write(device, 12, 2, 16, 2, 64, torch.float32, seed=5)
    qkv = torch.randn(12, 2 + 2 + 2, 64, device=device)
    qkv[:, 2:4], qkv[:, 4:6] = key, value
    check(kv_cache, qkv[:, 2:4], qkv[:, 4:6], slots.to(torch.int32))


def test_rejects_mismatched_shapes(device):
    kv_cache, key, value, slots = random_write(device, 4, 2, 16, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, value, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots[:3])
    with pytest.raises(ValueError, match="do not match"):
        write_kv_cache(key[:, :1], value[:, :1], kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots)
    with pytest.raises(ValueError, match="integer"):
        write_kv_cache(key, value, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots.float())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_full_size_gpu(device, dtype, block_size):
    # A 4096-token prefill of Llama-3-8B's KV heads into a cache with room for 8192 tokens.
    check(*random_write(device, 4096, 8192 // block_size, block_size, 8, 128, dtype, num_padding=64))
