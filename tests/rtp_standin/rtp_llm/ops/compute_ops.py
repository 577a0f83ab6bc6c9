"""Test stand-in of RTP-LLM's per-step and KV-cache types (``rtp_llm.ops.compute_ops``; not RTP-LLM code).

Checked against ``models_py/bindings/OpDefs.{h,cc}`` at rtp-llm 4b8d39cd5:
- every tensor field of ``PyAttentionInputs`` is unset (``None`` in Python, an undefined ``torch::Tensor`` in
  C++) until the engine sets it; the objects are built with no arguments and filled field by field;
- ``LayerKVCache(kv_cache_base, seq_size_per_block, layer_id=-1, group_id=-1, tag="default",
  kv_scale_base=None)``; for an MLA cache ``seq_size_per_block`` is the KERNEL block size and the tensors are
  ``[kernel_blocks, kernel_block_size, row]`` views;
- ``KVCache``: ``group_tags``, ``layer_count``, ``get_layer_cache(layer[, tag])``,
  ``get_layer_cache_groups(layer)``, and ``get_seq_size_per_block(tag)`` / ``get_kernel_seq_size_per_block(tag)``
  with a mandatory tag (the template is RTP's ``SingleGroupKVCacheAdapter``);
- ``PyModelInitResources()`` takes no arguments and its fields are read-only from Python.
"""

_ATTENTION_FIELDS = (
    "is_prefill", "is_cuda_graph", "is_target_verify", "dtype", "is_s_padded", "total_tokens",
    "context_total_kv_length", "input_lengths", "input_lengths_device", "prefix_lengths", "prefix_lengths_device",
    "sequence_lengths", "sequence_lengths_plus_1_device", "cu_seqlens", "cu_seqlens_device", "cu_kv_seqlens_device",
    "decode_cu_seqlens", "decode_cu_seqlens_device", "padding_offset", "kv_cache_kernel_block_id",
    "kv_cache_kernel_block_id_device", "kv_cache_block_id", "kv_cache_block_id_device", "combo_position_ids",
    "cache_store_inputs", "cache_store_writer", "prefill_cuda_graph_copy_params", "context_parallel_info",
    "headwise_config",
)


class PyAttentionInputs:
    """Every field exists; tensors are None until set; a misspelt field is an AttributeError (as pybind's)."""

    __slots__ = _ATTENTION_FIELDS

    def __init__(self):
        for name in _ATTENTION_FIELDS:
            setattr(self, name, None)
        self.is_prefill = self.is_cuda_graph = self.is_target_verify = self.is_s_padded = False
        self.total_tokens = self.context_total_kv_length = 0


class PyModelInputs:
    __slots__ = ("input_ids", "input_hiddens", "combo_position_ids", "embedding_inputs", "multimodal_inputs",
                 "attention_inputs", "bert_embedding_inputs")

    def __init__(self, input_ids=None, input_hiddens=None, combo_position_ids=None, embedding_inputs=None,
                 multimodal_inputs=None, attention_inputs=None, bert_embedding_inputs=None):
        self.input_ids, self.input_hiddens, self.combo_position_ids = input_ids, input_hiddens, combo_position_ids
        self.embedding_inputs, self.multimodal_inputs = embedding_inputs, multimodal_inputs
        self.attention_inputs = attention_inputs if attention_inputs is not None else PyAttentionInputs()
        self.bert_embedding_inputs = bert_embedding_inputs


class PyModelOutputs:
    def __init__(self, hidden_states=None):
        self.hidden_states = hidden_states


class PyModelInitResources:
    """Built by the engine; ``kv_cache`` is None for an executor without a cache layout (prefill warm-up)."""

    def __init__(self):
        self._kv_cache, self._is_speculative, self._is_decode_role, self._max_context_batch_size = None, False, False, 1

    kv_cache = property(lambda self: self._kv_cache)
    is_speculative = property(lambda self: self._is_speculative)
    is_decode_role = property(lambda self: self._is_decode_role)
    max_context_batch_size = property(lambda self: self._max_context_batch_size)


def init_resources(kv_cache, *, is_decode_role=False, max_context_batch_size=1):
    """What the C++ executor fills in (the fields are read-only from Python)."""
    res = PyModelInitResources()
    res._kv_cache, res._is_decode_role, res._max_context_batch_size = kv_cache, is_decode_role, max_context_batch_size
    return res


class LayerKVCache:
    def __init__(self, kv_cache_base, seq_size_per_block, layer_id=-1, group_id=-1, tag="default",
                 kv_scale_base=None):
        self.kv_cache_base, self.kv_scale_base = kv_cache_base, kv_scale_base
        self._meta = (int(seq_size_per_block), int(layer_id), int(group_id), str(tag))

    seq_size_per_block = property(lambda self: self._meta[0])
    layer_id = property(lambda self: self._meta[1])
    group_id = property(lambda self: self._meta[2])
    tag = property(lambda self: self._meta[3])


class KVCache:
    """One cache group (GLM-5's MLA layers, tag "default") over per-layer ``[kernel_blocks, kbs, row]`` views."""

    def __init__(self, kv_views, scale_views, seq_size_per_block, kernel_seq_size_per_block, tag="default"):
        self._kv, self._scale = tuple(kv_views), tuple(scale_views)
        self._seq, self._kernel_seq, self._tag = int(seq_size_per_block), int(kernel_seq_size_per_block), tag

    @property
    def group_tags(self):
        return [self._tag]

    @property
    def layer_count(self):
        return len(self._kv)

    def _check(self, layer_id, tag):
        if not 0 <= layer_id < self.layer_count:
            raise RuntimeError(f"Invalid layer index: {layer_id}")
        if tag != self._tag:
            raise RuntimeError(f"KV cache tag {tag!r} is not available")

    def get_layer_cache(self, layer_id, tag=None):
        self._check(layer_id, self._tag if tag is None else tag)
        return LayerKVCache(self._kv[layer_id], self._kernel_seq, layer_id=layer_id, group_id=0, tag=self._tag,
                            kv_scale_base=self._scale[layer_id])

    def get_layer_cache_groups(self, layer_id):
        return [self.get_layer_cache(layer_id)]

    def get_seq_size_per_block(self, tag):
        self._check(0, tag)
        return self._seq

    def get_kernel_seq_size_per_block(self, tag):
        self._check(0, tag)
        return self._kernel_seq
