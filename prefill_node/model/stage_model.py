"""One pipeline stage of a decoder LLM: layers [a, b), plus embedding / LM head at the ends.

Contract of ``forward``: the caller (the stage loop) owns the batch's blocks in ``kv`` and
keeps them pinned until the forward returns; positions [0, start) of every chunk already
hold that sequence's KV for this stage's layers. The forward writes each chunk's K/V for
[start, end) and returns the residual stream (NOT final-normed), which is what the next
stage consumes; only the last stage turns selected rows into logits (``compute_logits``).
All code paths are device- and dtype-agnostic (CPU/CUDA, fp32/bf16): the device and dtype
are the ones given at construction, and inputs are expected there. Forwards run under
``torch.no_grad`` (not inference mode), so outputs are ordinary tensors a runtime may copy
into, send, or modify in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from prefill_node.errors import InvariantError, MissingTensorError
from prefill_node.model.attention import AttentionPath, AttentionPlan
from prefill_node.model.batch import ChunkBatch
from prefill_node.model.config import ModelConfig
from prefill_node.model.latent_cache import StageCache
from prefill_node.model.layers import DecoderLayer
from prefill_node.model.partition import LayerRange
from prefill_node.model.rope import RotaryEmbedding
from prefill_node.model.tensor_ops import linear, rms_norm, take
from prefill_node.model.weights import EMBED, FINAL_NORM, LM_HEAD, random_weights, weight_shapes


class StageModel(nn.Module):
    """Layers ``layer_range`` of ``config``; weights are uninitialised until ``load_weights``."""

    def __init__(
        self,
        config: ModelConfig,
        layer_range: LayerRange,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if layer_range.end > config.num_layers:
            raise InvariantError(f"stage layers {layer_range} exceed {config.num_layers} layers")
        self.config = config
        self.layer_range = layer_range
        self.dtype = dtype
        self.device = torch.device(device)
        vocab_shape = (config.vocab_size, config.hidden_size)

        def param(shape: tuple[int, ...]) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=self.device), False)

        self.embed = param(vocab_shape) if self.is_first else None
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer, dtype, self.device) for layer in layer_range
        )
        self.norm = param((config.hidden_size,)) if self.is_last else None
        self.lm_head: nn.Parameter | None = None
        if self.is_last:
            tied_here = config.tie_word_embeddings and self.embed is not None
            self.lm_head = self.embed if tied_here else param(vocab_shape)
        self.rotary = RotaryEmbedding(config, self.device)
        # which computation GQA attention uses; both are exact (attention.py), MASKED is the
        # reference a benchmark or test may select
        self.attention_path = AttentionPath.default_for(self.device, gqa=config.mla is None)
        self._loaded = False

    @property
    def is_first(self) -> bool:
        return self.layer_range.is_first()

    @property
    def is_last(self) -> bool:
        return self.layer_range.is_last(self.config.num_layers)

    @classmethod
    def random_init(
        cls,
        config: ModelConfig,
        layer_range: LayerRange,
        seed: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> StageModel:
        """A stage with ``random_weights(config, seed, layer_range)``: stages built from the
        same seed form the same model as ``random_weights(config, seed)``."""
        model = cls(config, layer_range, dtype, device)
        model.load_weights(random_weights(config, seed, layer_range))
        return model

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy this slice's tensors from HF-named ``weights`` (extra names are ignored).
        MissingTensorError names the first absent tensor; a wrong shape raises
        InvalidModelConfigError."""
        shapes = weight_shapes(self.config, self.layer_range)
        for name in shapes:
            if name not in weights:
                raise MissingTensorError(
                    f"tensor {name!r} is missing (needed by the stage holding layers "
                    f"{self.layer_range} of {self.config.num_layers})"
                )
        if self.embed is not None:
            self.embed.copy_(take(weights, EMBED, shapes[EMBED]))
        for layer in self.layers:
            layer.load(weights, shapes)
        if self.norm is not None and self.lm_head is not None:
            final_norm = take(weights, FINAL_NORM, shapes[FINAL_NORM]).float()
            self.norm.copy_(final_norm + self.config.norm_weight_offset)
            if self.lm_head is not self.embed:
                head = LM_HEAD if LM_HEAD in shapes else EMBED
                self.lm_head.copy_(take(weights, head, shapes[head]))
        self._loaded = True

    @torch.no_grad()
    def forward(
        self,
        inputs: torch.Tensor,
        batch: ChunkBatch,
        kv: StageCache,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """inputs: token ids LongTensor [T] on the first stage, else hidden [T, hidden] from
        the previous stage. Returns the residual stream [T, hidden] in this stage's dtype.
        ``after_layer(layer)``: called with each layer's global index once its kernels that
        write the batch's KV into ``kv`` were issued (on CUDA, possibly not yet run), while
        the later layers still have to run (streamed KV hand-off: docs/kv_streaming.md)."""
        self._check_call(inputs, batch, kv)
        x = F.embedding(inputs, self.embed) if self.embed is not None else inputs.to(self.dtype)
        plan = AttentionPlan.build(batch, kv, self.dtype, self.attention_path)
        cos, sin = self.rotary.cos_sin(batch.positions(self.device), self.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, plan, kv)
            if after_layer is not None:
                after_layer(layer.layer)
        return x

    @torch.no_grad()
    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Last stage only: final RMSNorm + LM head on hidden rows [N, hidden] -> fp32 [N, vocab].
        Select the rows first (``ChunkBatch.last_token_rows``): the head is the biggest matmul."""
        if self.norm is None or self.lm_head is None:
            raise InvariantError(f"compute_logits called on a non-last stage {self.layer_range}")
        normed = rms_norm(hidden_rows.to(self.dtype), self.norm, self.config.rms_norm_eps)
        return linear(normed, self.lm_head).float()

    def _check_call(self, inputs: torch.Tensor, batch: ChunkBatch, kv: StageCache) -> None:
        if not self._loaded:
            raise InvariantError("StageModel.forward before load_weights")
        if kv.layer_range != self.layer_range:
            raise InvariantError(
                f"KV cache holds layers {kv.layer_range}, stage {self.layer_range}"
            )
        want = (
            (batch.total_tokens,)
            if self.is_first
            else (batch.total_tokens, self.config.hidden_size)
        )
        if tuple(inputs.shape) != want:
            raise InvariantError(f"stage input shape {tuple(inputs.shape)}, expected {want}")
