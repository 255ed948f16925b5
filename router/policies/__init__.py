"""Worker-selection policies: consistent hashing with bounded loads (prefill), sticky key assignments bounded per
worker (both pools), power of two choices (decode)."""

from tandem.router.policies.key_table import KeyAssignments
from tandem.router.policies.p2c import DecodeWorkerState, PowerOfTwoChoices, decode_score, healthy, with_room
from tandem.router.policies.ring import DEFAULT_VNODES, HashRing, routing_key

__all__ = [
    "DEFAULT_VNODES", "DecodeWorkerState", "HashRing", "KeyAssignments", "PowerOfTwoChoices", "decode_score", "healthy",
    "routing_key", "with_room",
]
