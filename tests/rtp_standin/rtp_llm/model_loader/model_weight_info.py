"""Test stand-in of RTP-LLM's weight containers (not RTP-LLM code). The C++ post-layers read only
``global_weights["lm_head"]`` on the Python-model path (``WeightsConverter::createGptWeights``)."""


class ModelWeights:
    """Loaded weights: ``weights[layer][name]`` per layer and ``global_weights[name]``.

    The engine applies the LM head itself from ``global_weights["lm_head"]`` ([vocab, hidden]).
    """

    def __init__(self, num_layers, device, dtype):
        self.num_layers = num_layers
        self.device = device
        self.dtype = dtype
        self.weights = [{} for _ in range(num_layers)]
        self.global_weights = {}

    def set_global_weight(self, name, tensor):
        self.global_weights[name] = tensor

    def get_global_weight(self, name):  # model_weight_info.py:859 (what get_sp_model's alias check reads)
        return self.global_weights[name]

    def set_layer_weight(self, layer, name, tensor):
        self.weights[layer][name] = tensor


class ModelDeployWeightInfo:
    """Empty base of a model's weight-info class (``get_weight_cls()``); the stand-in never loads by it."""

    def __init__(self, *args, **kwargs):
        pass
