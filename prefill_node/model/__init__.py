"""Model backend: Llama, Qwen3 and MiniMax-M2 (MoE) as pipeline stages over a paged KV cache.

Modules: ``config`` (ModelConfig), ``partition`` (LayerRange, split_layers) - both torch-free;
``batch`` (ChunkBatch), ``paged_kv`` (PagedKVCache), ``stage_model`` (StageModel),
``layers`` / ``moe`` (a decoder layer, a sparse MoE block),
``loader_hf`` / ``loader_gguf`` (checkpoints), ``reference`` (single-process reference
forward), ``weights`` (HF tensor names, random weights). Import the torch modules directly;
this package import stays torch-free so the sans-IO core can use the config types.
"""

from prefill_node.model.config import ModelConfig, ModelFamily, RopeScaling
from prefill_node.model.partition import LayerRange, split_layers

__all__ = ["LayerRange", "ModelConfig", "ModelFamily", "RopeScaling", "split_layers"]
