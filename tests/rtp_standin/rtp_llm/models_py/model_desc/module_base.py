"""Test stand-in of RTP-LLM's inner Python model base class (``models_py/model_desc/module_base.py`` at
4b8d39cd5; not RTP-LLM code).

Per step the engine calls ``impl = prepare_fmha_impl(inputs, is_cuda_graph)`` then ``forward(inputs, impl)``
-> ``PyModelOutputs``; ``initialize`` is called once per executor (the prefill warm-up's without a cache)
and must return True. RTP's base class picks attention impls from its own factory; here it raises.
"""

import torch


class GptModelBase(torch.nn.Module):
    def __init__(self, config, parallelism_config, weight, max_generate_batch_size, fmha_config=None,
                 py_hw_kernel_config=None, device_resource_config=None):
        super().__init__()
        self.config, self.parallelism_config, self.weight = config, parallelism_config, weight
        self.fmha_config, self.py_hw_kernel_config = fmha_config, py_hw_kernel_config
        self.micro_batch_size = 1
        self.layer_num, self.vocab_size = config.num_layers, config.vocab_size
        self.kv_cache = None

    def initialize(self, init_resource):
        self.kv_cache = init_resource.kv_cache
        return True

    def prepare_fmha_impl(self, inputs, is_cuda_graph=False):
        raise NotImplementedError(f"{type(self).__name__}.prepare_fmha_impl: the stand-in has no attention factory")

    def forward(self, inputs, fmha_impl=None):
        raise NotImplementedError(f"{type(self).__name__}.forward")
