"""Test stand-in of RTP-LLM's inner Python model base class (not RTP-LLM code; written from the contract).

Per step the engine calls ``impl = prepare_fmha_impl(inputs, is_cuda_graph)`` then
``forward(inputs, impl) -> PyModelOutputs``; ``initialize`` receives the KV cache (None during the
CUDA-graph warm-up) and must return True.
"""

import torch


class GptModelBase(torch.nn.Module):
    def __init__(self, config, parallelism_config, weight, max_generate_batch_size, fmha_config=None,
                 py_hw_kernel_config=None, device_resource_config=None):
        super().__init__()
        self.config = config
        self.parallelism_config = parallelism_config
        self.weight = weight
        self.max_generate_batch_size = max_generate_batch_size
        self.fmha_config = fmha_config
        self.py_hw_kernel_config = py_hw_kernel_config
        self.device_resource_config = device_resource_config
        self.kv_cache = None

    def initialize(self, init_resource):
        self.kv_cache = init_resource.kv_cache
        return True

    def prepare_fmha_impl(self, inputs, is_cuda_graph=False):
        raise NotImplementedError(f"{type(self).__name__}.prepare_fmha_impl")

    def forward(self, inputs, fmha_impl=None):
        raise NotImplementedError(f"{type(self).__name__}.forward")
