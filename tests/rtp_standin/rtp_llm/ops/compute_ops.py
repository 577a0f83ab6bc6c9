"""Test stand-in of RTP-LLM's per-step input/output and KV-cache objects (not RTP-LLM code).

Written from the contract. Plain attribute bags. In ``PyAttentionInputs`` every tensor is int32; a bare
name is a host tensor (pinned when CUDA is available), a ``_device`` name its mirror on the device.
Unset tensor fields default to empty int32 CPU tensors; see the contract's per-step table for which
fields a prefill or a decode step fills.
"""

import torch

_TENSOR_FIELDS = (
    "input_lengths", "prefix_lengths", "sequence_lengths", "sequence_lengths_plus_1_device",
    "cu_seqlens", "cu_seqlens_device", "cu_kv_seqlens_device", "decode_cu_seqlens_device",
    "kv_cache_kernel_block_id", "kv_cache_kernel_block_id_device", "kv_cache_block_id",
    "kv_cache_block_id_device",
)


class PyAttentionInputs:
    def __init__(self, **fields):
        self.is_prefill = False
        self.is_cuda_graph = False
        self.dtype = None
        for name in _TENSOR_FIELDS:
            setattr(self, name, torch.empty(0, dtype=torch.int32))
        for name, value in fields.items():
            if name not in _TENSOR_FIELDS and name not in ("is_prefill", "is_cuda_graph", "dtype"):
                raise TypeError(f"PyAttentionInputs has no field {name!r}")
            setattr(self, name, value)


class PyModelInputs:
    """``input_ids``: int32 [num_tokens] on the device; ``attention_inputs``: one PyAttentionInputs."""

    def __init__(self, input_ids=None, attention_inputs=None, input_hiddens=None):
        self.input_ids = input_ids
        self.attention_inputs = attention_inputs
        self.input_hiddens = input_hiddens  # unused by the engine


class PyModelOutputs:
    """``hidden_states``: [num_tokens, hidden] in the compute dtype, final norm applied."""

    def __init__(self, hidden_states=None):
        self.hidden_states = hidden_states


class PyModelInitResources:
    def __init__(self, kv_cache=None):
        self.kv_cache = kv_cache


class LayerKVCache:
    """One layer's cache: ``kv_cache_base`` [kernel_blocks, kernel_block_size, W], ``kv_scale_base`` (the
    DSA indexer key cache, or None), ``seq_size_per_block`` at KERNEL granularity."""

    def __init__(self, kv_cache_base, kv_scale_base, seq_size_per_block, layer_id):
        self.kv_cache_base = kv_cache_base
        self.kv_scale_base = kv_scale_base
        self.seq_size_per_block = seq_size_per_block
        self.layer_id = layer_id


class KVCache:
    def __init__(self, layer_caches, seq_size_per_block, kernel_seq_size_per_block):
        self._layers = list(layer_caches)
        self._seq_size_per_block = seq_size_per_block
        self._kernel_seq_size_per_block = kernel_seq_size_per_block
        self.layer_count = len(self._layers)

    def get_layer_cache(self, layer_id):
        return self._layers[layer_id]

    def get_seq_size_per_block(self):
        return self._seq_size_per_block

    def get_kernel_seq_size_per_block(self):
        return self._kernel_seq_size_per_block
