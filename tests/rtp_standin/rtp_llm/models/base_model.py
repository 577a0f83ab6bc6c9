"""Test stand-in of RTP-LLM's outer model base class (``rtp_llm/models/base_model.py`` at 4b8d39cd5; not
RTP-LLM code).

- ``__init__`` takes RTP's required keyword arguments (no catch-all);
- ``from_config`` constructs the model AND calls ``load(skip_python_model=...)``; a speculative draft gets its
  ``weight_alias_owner`` (the loaded target) and ``weight_alias_names`` first, kept as ``_weight_alias_owner`` /
  ``_weight_alias_names`` (lines 306-344); ``speculative_weight_alias_names`` is the draft class's opt-in, empty by
  default (lines 276-287);
- ``load`` is where RTP refuses ``ENABLE_CUDA_GRAPH=1`` for a model whose ``support_cuda_graph()`` is False,
  then builds its weight loader (``model_weights_loader``, read later by ``rpc_engine._start``): a plugin that
  overrides ``load`` skips both, as with real RTP.
"""


class BaseModel:
    def __init__(self, *, model_config, parallelism_config, hw_kernel_config, kv_cache_config, fmha_config,
                 moe_config, max_generate_batch_size, load_method, vit_config, merge_lora, device_resource_config,
                 force_cpu_load_weights=False, loader_recycle_handles=False, moe_pure_tp_preshard=False):
        self.model_config, self.parallelism_config, self.hw_kernel_config = model_config, parallelism_config, \
            hw_kernel_config
        self.kv_cache_config, self.fmha_config, self.moe_config = kv_cache_config, fmha_config, moe_config
        self.max_generate_batch_size, self.load_method, self.vit_config = max_generate_batch_size, load_method, \
            vit_config
        self.merge_lora, self.device_resource_config = merge_lora, device_resource_config
        self.weight = self.weight_manager = self.py_eplb = self.py_model = None
        self._weight_alias_owner, self._weight_alias_names = None, ()

    @classmethod
    def speculative_weight_alias_names(cls, target_model, draft_model_config):
        return ()

    @classmethod
    def from_config(cls, model_config, parallelism_config, hw_kernel_config, kv_cache_config, fmha_config,
                    moe_config, load_method, max_generate_batch_size, vit_config, merge_lora, device_resource_config,
                    force_cpu_load_weights=False, skip_python_model=False, loader_recycle_handles=False,
                    moe_pure_tp_preshard=False, weight_alias_owner=None, weight_alias_names=()):
        model = cls(model_config=model_config, parallelism_config=parallelism_config,
                    hw_kernel_config=hw_kernel_config, kv_cache_config=kv_cache_config, fmha_config=fmha_config,
                    moe_config=moe_config, load_method=load_method, max_generate_batch_size=max_generate_batch_size,
                    vit_config=vit_config, merge_lora=merge_lora, device_resource_config=device_resource_config,
                    force_cpu_load_weights=force_cpu_load_weights, loader_recycle_handles=loader_recycle_handles,
                    moe_pure_tp_preshard=moe_pure_tp_preshard)
        if weight_alias_names and weight_alias_owner is None:
            raise ValueError("weight_alias_names require an explicit weight_alias_owner")
        model._weight_alias_owner, model._weight_alias_names = weight_alias_owner, tuple(weight_alias_names)
        model.load(skip_python_model=skip_python_model)
        return model

    @classmethod
    def _create_config(cls, ckpt_path):
        raise NotImplementedError(f"{cls.__name__}._create_config")

    @staticmethod
    def get_weight_cls():
        raise NotImplementedError("get_weight_cls")

    def support_cuda_graph(self):
        return False

    def load(self, skip_python_model=False):
        if self.hw_kernel_config.enable_cuda_graph and self.support_cuda_graph() is False:
            raise Exception("current model can't support cuda graph in py model mode")
        raise NotImplementedError(f"{type(self).__name__}: the stand-in has no RTP weight loader; override load()")

    def _create_python_model(self):
        raise NotImplementedError(f"{type(self).__name__}._create_python_model")
