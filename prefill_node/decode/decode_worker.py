"""DecodeWorker: the reference decode worker: receives a prompt's KV over NIXL, then generates.

It owns a full-model StageModel (all layers), one paged cache for all layers registered with
a KVReceiver (the decode-side kv_transfer library), and uses the receiver's allocator as its
block allocator. Generation is plain greedy decoding with the same torch model: each step is
a chunk of length 1 at the next position through ``StageModel.forward`` with the sequence's
block table, so the shipped KV is used exactly as the prefill wrote it. A hybrid model's
cache (attention blocks + recurrent-state slots per block) is registered whole: the stages
ship each recurrent layer's state after the prompt into the slot of the block holding the
prompt's last token, which is where the first step's recurrent layers resume from.

Block contract: ``expect_push`` / ``pull`` allocate the prompt's blocks and hand them to the
returned ``DecodeSequence``; ``generate`` adds blocks as the sequence grows; ``release``
frees them all, exactly once (also after a failed reception). Threading: one thread.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kv_transfer.agent import KVAgent
from kv_transfer.messages import StageManifest, TransferOutcome
from kv_transfer.progress import KVProgress
from kv_transfer.receiver import KVReceiver, ReceiverConfig
from prefill_node.engine.types import KVPushDestination, StageKVManifest
from prefill_node.errors import (
    InvalidRequestError,
    InvariantError,
    KVHandoffError,
)
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.config import ModelConfig
from prefill_node.model.latent_cache import stage_cache
from prefill_node.model.partition import LayerRange
from prefill_node.model.stage_model import StageModel
from prefill_node.wire.kv_handoff import engine_push_destination, hybrid_pool, wire_manifest


@dataclass
class DecodeSequence:
    """One request on the decode worker. ``blocks`` are owned until ``release``; positions
    ``[0, num_kv)`` hold KV (the prompt's after reception, then each fed token's)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    blocks: list[int]
    num_kv: int = 0
    generated: list[int] = field(default_factory=list)


class DecodeWorker:
    """A full model + paged KV pool registered with NIXL; generates from shipped KV."""

    def __init__(
        self,
        model: StageModel,
        num_blocks: int,
        block_size: int,
        agent_name: str | None = None,
        receiver_config: ReceiverConfig | None = None,
        kv_progress: KVProgress = KVProgress.EVENT,
    ) -> None:
        if not (model.is_first and model.is_last):
            raise InvalidRequestError("the decode worker needs the whole model (all layers)")
        self.model = model
        cfg = model.config
        self.kv = stage_cache(
            cfg, model.layer_range, num_blocks, block_size, model.dtype, model.device
        )
        self.agent_name = agent_name or f"wavepp-decode-{uuid.uuid4().hex[:8]}"
        self.receiver = KVReceiver(
            KVAgent(self.agent_name, progress=kv_progress),
            self.kv.tensors,
            receiver_config or ReceiverConfig(),
            hybrid=hybrid_pool(self.kv),  # recurrent layers: their state slots, too
        )
        self._outcomes: dict[str, TransferOutcome] = {}
        # request id -> time.monotonic() its whole prompt's KV was there (newest 4096)
        self.ready_at: OrderedDict[str, float] = OrderedDict()
        self._sequences: dict[str, DecodeSequence] = {}

    @classmethod
    def from_weights(
        cls, config: ModelConfig, weights: dict[str, torch.Tensor], **kw: object
    ) -> DecodeWorker:
        model = StageModel(config, LayerRange(0, config.num_layers))
        model.load_weights(weights)
        return cls(model, **kw)  # type: ignore[arg-type]

    @classmethod
    def from_model_dir(cls, path: str | Path, **kw: object) -> DecodeWorker:
        from prefill_node.model.loader_hf import load_hf_config, load_stage_model

        config = load_hf_config(path)
        return cls(load_stage_model(path, LayerRange(0, config.num_layers)), **kw)  # type: ignore[arg-type]

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def endpoint(self) -> str:
        return self.receiver.endpoint

    @property
    def used_blocks(self) -> int:
        return self.kv.num_blocks - self.receiver.free_blocks

    # ---- receiving the prompt's KV ---------------------------------------------------

    def _new_sequence(self, request_id: str, prompt_ids: Sequence[int]) -> DecodeSequence:
        if request_id in self._sequences:
            raise InvalidRequestError(f"request {request_id!r} is already on this decode worker")
        need = -(-len(prompt_ids) // self.block_size)
        blocks = self.receiver.allocate(need)
        if blocks is None:
            raise KVHandoffError(
                f"decode pool has {self.receiver.free_blocks} free blocks, the prompt needs {need}"
            )
        seq = DecodeSequence(request_id, tuple(prompt_ids), list(blocks))
        self._sequences[request_id] = seq
        return seq

    def expect_push(
        self, request_id: str, prompt_ids: Sequence[int], timeout_s: float | None = None
    ) -> KVPushDestination:
        """Allocate the prompt's blocks; send the returned destination with the prefill.
        ``timeout_s``: how long the reception waits from now (``KVReceiver.expect``): at
        least the prefill call's deadline plus the transfer."""
        seq = self._new_sequence(request_id, prompt_ids)
        try:
            wire = self.receiver.expect(request_id, seq.blocks, len(prompt_ids), 0, timeout_s)
        except Exception:
            self.release(request_id)
            raise
        return engine_push_destination(wire, self.agent_name, self.receiver.layout)

    def pull(
        self, request_id: str, prompt_ids: Sequence[int], manifests: Sequence[StageKVManifest]
    ) -> None:
        """Start READing every stage's blocks named by the prefill result's manifests."""
        wire = [wire_manifest(m, request_id, len(manifests)) for m in manifests]
        self.pull_wire(request_id, prompt_ids, wire)

    def pull_wire(
        self, request_id: str, prompt_ids: Sequence[int], manifests: Sequence[StageManifest]
    ) -> None:
        """``pull`` from manifests already in wire form (``kv_transfer_params``), each named
        ``request_id``. Nothing stays allocated when it raises."""
        seq = self._new_sequence(request_id, prompt_ids)
        try:
            self.receiver.pull(manifests, seq.blocks)
        except Exception:
            self.release(request_id)
            raise

    def compute_prompt(self, request_id: str, prompt_ids: Sequence[int]) -> int:
        """Local prefill: allocate the prompt's blocks, compute its KV in one forward; the
        greedy first token. Nothing stays allocated when it raises."""
        seq = self._new_sequence(request_id, prompt_ids)
        try:
            return self._compute_from(seq, 0)
        except Exception:
            self.release(request_id)
            raise

    def pump(self) -> None:
        """Advance receptions (call often while waiting for KV)."""
        for outcome in self.receiver.poll():
            self._outcomes[outcome.request_id] = outcome
            if outcome.ok:
                self.ready_at[outcome.request_id] = time.monotonic()
                while len(self.ready_at) > 4096:
                    self.ready_at.popitem(last=False)

    def wait_kv(
        self, request_id: str, timeout_s: float = 30.0, poll_s: float = 0.0005
    ) -> DecodeSequence:
        """Block (bounded) until the prompt's KV arrived, polling every ``poll_s``;
        KVHandoffError if it failed."""
        deadline = time.monotonic() + timeout_s
        while self.kv_outcome(request_id) is None:
            if time.monotonic() > deadline:
                self.receiver.cancel(request_id)
                raise KVHandoffError(f"KV of {request_id} did not arrive within {timeout_s}s")
            self.pump()
            time.sleep(poll_s)
        return self.take_kv(request_id)

    def kv_outcome(self, request_id: str) -> TransferOutcome | None:
        """How the reception of ``request_id`` ended, None while it runs (no polling here)."""
        return self._outcomes.get(request_id)

    def take_kv(self, request_id: str) -> DecodeSequence:
        """Consume the ended reception: the sequence, its prompt's KV in place; KVHandoffError
        (the blocks stay with the sequence until ``release``) if it failed."""
        seq = self._sequences[request_id]
        outcome = self._outcomes.pop(request_id)
        if outcome.error is not None:
            raise KVHandoffError(
                f"receiving KV of {request_id} failed: {type(outcome.error).__name__}: "
                f"{outcome.error}",
                outcome.error,
            )
        seq.num_kv = len(seq.prompt_ids)
        return seq

    def recompute_last(self, request_id: str) -> int:
        """The greedy first token after a received prompt: its last token is fed again over
        the received KV (as vLLM does for a full prompt hit, to get its logits)."""
        seq = self._sequences[request_id]
        if seq.num_kv != len(seq.prompt_ids):
            raise InvalidRequestError(f"KV of {request_id} has not arrived; call take_kv first")
        return self._compute_from(seq, len(seq.prompt_ids) - 1)

    # ---- generation ------------------------------------------------------------------

    def generate(
        self,
        request_id: str,
        first_token: int,
        max_new_tokens: int,
        stop_ids: Sequence[int] = (),
    ) -> Iterator[int]:
        """Greedy continuation: yields ``first_token`` (the prefill's) and then up to
        ``max_new_tokens - 1`` more, stopping after a token in ``stop_ids``. Runs out of
        blocks -> stops early (the caller sees fewer tokens)."""
        seq = self._sequences[request_id]
        if seq.num_kv != len(seq.prompt_ids):
            raise InvalidRequestError(f"KV of {request_id} has not arrived; call wait_kv first")
        token = first_token
        for i in range(max_new_tokens):
            seq.generated.append(token)
            yield token
            if token in stop_ids or i == max_new_tokens - 1 or not self._grow(seq):
                return
            token = self._step(seq, token)

    def _grow(self, seq: DecodeSequence) -> bool:
        if seq.num_kv < len(seq.blocks) * self.block_size:
            return True
        more = self.receiver.allocate(1)
        if more is None:
            return False
        seq.blocks.extend(more)
        return True

    def _compute_from(self, seq: DecodeSequence, start: int) -> int:
        """Feed prompt tokens ``[start, end)`` in one chunk; the greedy next token."""
        batch = ChunkBatch((ChunkSpec(start, len(seq.prompt_ids) - start, tuple(seq.blocks)),))
        x = torch.tensor(seq.prompt_ids[start:], dtype=torch.long, device=self.model.device)
        hidden = self.model(x, batch, self.kv)
        seq.num_kv = len(seq.prompt_ids)
        return int(torch.argmax(self.model.compute_logits(hidden[-1:])[0]).item())

    def _step(self, seq: DecodeSequence, token: int) -> int:
        """Feed ``token`` at the next position; the greedy next token."""
        batch = ChunkBatch((ChunkSpec(seq.num_kv, 1, tuple(seq.blocks)),))
        x = torch.tensor([token], dtype=torch.long, device=self.model.device)
        hidden = self.model(x, batch, self.kv)
        seq.num_kv += 1
        return int(torch.argmax(self.model.compute_logits(hidden[-1:])[0]).item())

    def held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (0 when it has none)."""
        seq = self._sequences.get(request_id)
        return 0 if seq is None else len(seq.blocks)

    def release(self, request_id: str) -> None:
        """Free the request's blocks (after generation, or after a failed reception)."""
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return
        self._outcomes.pop(request_id, None)
        self.receiver.cancel(request_id)
        self.receiver.free(seq.blocks)

    def check_integrity(self) -> None:
        self.receiver.check_integrity()
        held = sum(len(s.blocks) for s in self._sequences.values())
        if held != self.used_blocks:
            raise InvariantError(f"{held} blocks held by sequences, {self.used_blocks} allocated")

    def close(self) -> None:
        for request_id in list(self._sequences):
            self.release(request_id)
        self.receiver.close()
