"""Moving KV-cache blocks between workers: NIXL (UCX) or plain TCP, behind one interface."""

from tandem.workers.kv_transfer.base import KVTransfer, KVTransferError, create_kv_transfer, nixl_available

__all__ = ["KVTransfer", "KVTransferError", "create_kv_transfer", "nixl_available"]
