"""Test stand-in of ``rtp_llm.ops`` (not RTP-LLM code): the pybind enums a model's config exposes.

RTP registers these with ``py::enum_`` (``cpp/pybind/ConfigInit.cc``): ``str()`` is ``"DataType.TYPE_BF16"``,
``.name`` is ``"TYPE_BF16"``; Python's ``enum.Enum`` behaves the same way for both.
"""

import enum


class DataType(enum.Enum):
    TYPE_INVALID = 0
    TYPE_UINT8 = 2
    TYPE_INT32 = 8
    TYPE_FP16 = 10
    TYPE_FP32 = 11
    TYPE_BF16 = 14
    TYPE_FP8_E4M3 = 15


class KvCacheDataType(enum.Enum):
    BASE = 0
    FP8 = 1


class ParallelismConfig:
    """``cpp/config/ConfigModules.h`` ``ParallelismConfig``: its fields and defaults, and its accessors (the
    stand-in has no prefill context parallel, so attention and FFN TP are ``tp_size`` / ``ffn_tp_size``)."""

    def __init__(self):
        self.tp_size, self.ep_size, self.dp_size, self.pp_size = 1, 1, 1, 1
        self.world_size, self.world_rank, self.local_world_size, self.local_rank = 1, 0, 1, 0
        self.ffn_sp_size, self.tp_rank, self.ep_rank, self.dp_rank, self.ffn_tp_size, self.ffn_tp_rank = 1, 0, 0, 0, 1, 0
        self.enable_sp, self.use_ub_comm = False, False

    def get_attn_tp_size(self):
        return self.tp_size

    def get_attn_tp_rank(self):
        return self.tp_rank

    def get_ffn_tp_size(self):
        return self.ffn_tp_size

    def get_ffn_tp_rank(self):
        return self.ffn_tp_rank


class NcclCommConfig:
    """The pybind constructor's ``nccl_ip`` (stored as ``master_ip``; ``collective_torch`` reads ``nccl_ip``)."""

    def __init__(self, nccl_ip=""):
        self.nccl_ip = self.master_ip = nccl_ip
