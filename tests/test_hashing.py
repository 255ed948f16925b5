"""The shared token-block hash: format, chaining, and resumable hashing."""

import hashlib
import struct

from tandem.hashing import block_hashes, hash_block, model_seed


def test_hash_matches_documented_format():
    seed = model_seed("smollm2")
    ids = list(range(16))
    expected = hashlib.blake2b(seed.to_bytes(8, "little") + struct.pack("<16i", *ids), digest_size=8).digest()
    assert hash_block(seed, ids) == int.from_bytes(expected, "little")


def test_chained_and_only_full_blocks():
    seed = model_seed("m")
    ids = list(range(40))
    hs = block_hashes(ids, 16, seed)
    assert len(hs) == 2  # the partial third block is never hashed
    assert hs[1] == hash_block(hs[0], ids[16:32])
    # Same tokens under a different prefix hash differently: the hash names the whole prefix.
    other = block_hashes([7] * 16 + ids[16:32], 16, seed)
    assert other[1] != hs[1]


def test_models_do_not_share_keys():
    ids = list(range(16))
    assert block_hashes(ids, 16, model_seed("a")) != block_hashes(ids, 16, model_seed("b"))


def test_resume_from_a_hashed_prefix():
    seed = model_seed("m")
    ids = list(range(100))
    full = block_hashes(ids, 16, seed)
    assert block_hashes(ids, 16, seed, start=3, parent=full[2]) == full[3:]
