"""Test stand-in of RTP-LLM's model config classes (not RTP-LLM code; written from the contract).

Plain attribute bags: a model's ``_create_config`` fills them; the stand-in engine sizes the KV cache from
``attn_config`` and sets ``data_type``, ``ckpt_path`` and ``attn_config.kv_cache_dtype`` itself.
"""


class AttnConfig:
    """Attention fields (MLA and the DSA sparse indexer)."""

    def __init__(self):
        self.head_num = 0
        self.kv_head_num = 0
        self.size_per_head = 0
        self.use_mla = False
        self.q_lora_rank = 0
        self.kv_lora_rank = 0
        self.nope_head_dim = 0
        self.rope_head_dim = 0
        self.v_head_dim = 0
        self.rope_config = None
        self.softmax_extra_scale = 1.0
        self.is_sparse = False
        self.indexer_head_dim = 0
        self.indexer_head_num = 0
        self.indexer_topk = 0
        self.kv_cache_dtype = None  # set by the engine: torch.float8_e4m3fn (FP8_KV_CACHE) or compute dtype


class ModelConfig:
    """Model-level fields; ``ModelConfig()`` constructs with defaults."""

    def __init__(self):
        self.num_layers = 0
        self.hidden_size = 0
        self.vocab_size = 0
        self.inter_size = 0
        self.max_seq_len = 0
        self.layernorm_eps = 1e-5
        self.expert_num = 0
        self.moe_k = 0
        self.moe_inter_size = 0
        self.data_type = None  # set by the engine from ACT_TYPE (a torch dtype)
        self.ckpt_path = None  # set by the engine
        self.attn_config = AttnConfig()
