"""vLLM's KV events (``--kv-events-config``, ZMQ PUB, msgspec msgpack) as the node's events.

Wire (vllm/distributed/kv_events.py, vLLM 0.32): each message is three frames, ``(topic,
sequence as 8 big-endian bytes, payload)``; the payload is a ``KVEventBatch`` encoded as an
array ``[ts, events, data_parallel_rank?]``; each event is a map tagged ``type``:
``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
``extra_keys``...), ``BlockRemoved`` (``block_hashes``) or ``AllBlocksCleared``. (Older
releases encoded events as tagged arrays; both forms are read.)

vLLM's block hashes are its own (sha256 of its own encoding), so ``VllmEventTranslator``
re-hashes each stored block's token ids with the node's ``hash_block_tokens`` and the
gateway's cache identity, keeping vLLM hash -> ours per instance: the router's
``GlobalPrefixIndex`` then indexes decode instances exactly like pipelines. A block whose
parent is unknown (stored before the gateway subscribed) is skipped, with its children:
the index under-counts the instance's cache, never over-counts it. Sans-IO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefill_node.core.hashing import BlockHash, ExtraKeys, hash_block_tokens
from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys")  # fmt: skip


class MalformedEventError(ValueError):
    """A payload that is not a vLLM KVEventBatch."""


@dataclass(frozen=True, slots=True)
class VllmBatch:
    """One decoded message: its publisher sequence and events as vLLM sent them (maps)."""

    sequence: int
    events: tuple[dict[str, Any], ...]


def decode_message(frames: Sequence[bytes]) -> VllmBatch:
    """Decode one ZMQ multipart message ``(topic, seq, payload)``."""
    import msgspec

    if len(frames) != 3 or len(frames[1]) != 8:
        raise MalformedEventError(f"expected (topic, 8-byte seq, payload), got {len(frames)}")
    try:
        batch = msgspec.msgpack.decode(frames[2])
    except msgspec.DecodeError as exc:
        raise MalformedEventError(f"payload is not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise MalformedEventError("payload is not a KVEventBatch [ts, events, ...]")
    return VllmBatch(int.from_bytes(frames[1], "big"), tuple(map(_as_map, batch[1])))


def _as_map(event: Any) -> dict[str, Any]:
    if isinstance(event, dict):
        return event
    if isinstance(event, list) and event and isinstance(event[0], str):
        fields = {"BlockStored": _STORED_FIELDS, "BlockRemoved": ("block_hashes", "medium")}
        return {"type": event[0], **dict(zip(fields.get(event[0], ()), event[1:], strict=False))}
    raise MalformedEventError(f"not a KV cache event: {event!r}")


def _key(h: Any) -> bytes | int:
    return bytes(h) if isinstance(h, bytes | bytearray | list) else h


class VllmEventTranslator:
    """One decode instance's vLLM events -> the node's ``KVEvent``s under the gateway's
    hashing (``model_id`` + each block's cache salt). Not thread-safe."""

    def __init__(self, model_id: str) -> None:
        self._model_id = model_id
        # vLLM hash -> (our chained hash, the ExtraKeys of its chain: vLLM puts the salt in
        # a prompt's first block only, so later blocks inherit their parent's)
        self._ours: dict[bytes | int, tuple[BlockHash, ExtraKeys]] = {}
        self._extra: dict[str | None, ExtraKeys] = {}
        self.block_size = 0  # from the first BlockStored

    def reset(self) -> None:
        """Forget the hash map (a gap or a new subscription)."""
        self._ours.clear()

    def translate(self, events: Sequence[dict[str, Any]]) -> tuple[KVEvent, ...]:
        out: list[KVEvent] = []
        for event in events:
            kind = event.get("type")
            if kind == "BlockStored":
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif kind == "BlockRemoved":
                gone = [self._ours.pop(_key(h), None) for h in event.get("block_hashes") or ()]
                hashes = tuple(h[0] for h in gone if h is not None)
                if hashes:
                    out.append(BlockRemoved(hashes))
            elif kind == "AllBlocksCleared":
                self._ours.clear()
                out.append(AllBlocksCleared())
        return tuple(out)

    def _stored(self, event: dict[str, Any]) -> BlockStored | None:
        vllm_hashes = [_key(h) for h in event.get("block_hashes") or ()]
        tokens, size = list(event.get("token_ids") or ()), int(event.get("block_size") or 0)
        if not vllm_hashes or size <= 0 or len(tokens) != size * len(vllm_hashes):
            return None
        parent_key = event.get("parent_block_hash")
        parent = None
        if parent_key is None:
            extra = self._extra_keys(event)
        else:
            known = self._ours.get(_key(parent_key))
            if known is None:
                return None  # stored before we listened: its chain is unknown here
            parent, extra = known
        self.block_size = size
        ours = hash_block_tokens(tokens, size, extra, parent)
        self._ours.update(zip(vllm_hashes, ((h, extra) for h in ours), strict=True))
        return BlockStored(ours, parent, tuple(tokens), size)

    def _extra_keys(self, event: dict[str, Any]) -> ExtraKeys:
        """The cache salt is the string among the first block's extra keys (vLLM puts the
        LoRA name, multimodal ids and the salt there; the gateway serves no LoRA)."""
        salt = None
        extra = event.get("extra_keys")
        if extra and extra[0]:
            salt = next((k for k in extra[0] if isinstance(k, str)), None)
        keys = self._extra.get(salt)
        if keys is None:
            keys = self._extra[salt] = ExtraKeys(self._model_id, salt)
        return keys
