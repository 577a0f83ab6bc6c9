"""Test stand-in of RTP-LLM's outer model base class (not RTP-LLM code; written from the contract).

A plugin subclasses ``BaseModel`` and overrides ``_create_config``, ``get_weight_cls``,
``support_cuda_graph``, ``load`` and ``_create_python_model``; the engine builds it with ``from_config``.
"""


class BaseModel:
    def __init__(self, model_config, parallelism_config=None, hw_kernel_config=None, kv_cache_config=None,
                 fmha_config=None, moe_config=None, load_method=None, max_generate_batch_size=1, **kwargs):
        # Extra keyword arguments (fields added upstream later) are accepted and ignored.
        self.model_config = model_config
        self.parallelism_config = parallelism_config
        self.hw_kernel_config = hw_kernel_config
        self.kv_cache_config = kv_cache_config
        self.fmha_config = fmha_config
        self.moe_config = moe_config
        self.load_method = load_method
        self.max_generate_batch_size = max_generate_batch_size
        self.weight = None
        self.py_model = None
        self.weight_manager = None
        self.py_eplb = None

    @classmethod
    def from_config(cls, **kwargs):
        return cls(**kwargs)

    @classmethod
    def _create_config(cls, ckpt_path):
        raise NotImplementedError(f"{cls.__name__}._create_config")

    @staticmethod
    def get_weight_cls():
        raise NotImplementedError("get_weight_cls")

    def support_cuda_graph(self):
        return False

    def load(self, skip_python_model=False):
        raise NotImplementedError(f"{type(self).__name__}.load")

    def _create_python_model(self):
        raise NotImplementedError(f"{type(self).__name__}._create_python_model")
