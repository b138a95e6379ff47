"""Typed errors of the KV hand-off; importable without prefill_node (the node maps them)."""

from __future__ import annotations


class KVTransferError(Exception):
    """Base of every error kv_transfer raises on purpose."""


class InvalidTransferRequest(KVTransferError, ValueError):
    """The caller passed something wrong (a bad layout, block list or manifest).

    The message says what to fix. Maps to INVALID_ARGUMENT.
    """


class LayoutMismatch(InvalidTransferRequest):
    """Prefill and decode layouts cannot be converted (head count, head dim, layer range)."""


class DestinationNotAllowed(InvalidTransferRequest):
    """The destination is not on the sender's allow-list (CIDRs or agent names)."""


class DecodeUnreachable(KVTransferError):
    """The decode worker's metadata endpoint refused or did not answer (UNAVAILABLE)."""


class TransferTimeout(KVTransferError):
    """A handshake or transfer did not finish before its deadline (DEADLINE_EXCEEDED)."""


class TransferFailed(KVTransferError):
    """NIXL reported an error, e.g. the peer died mid-transfer (UNAVAILABLE)."""


class KVInvariantError(KVTransferError, RuntimeError):
    """An internal invariant of kv_transfer is broken: a bug, never the caller's (INTERNAL)."""


class LeaseNotFound(KVTransferError, KeyError):
    """A pull lease is unknown: never granted, already released or expired."""
