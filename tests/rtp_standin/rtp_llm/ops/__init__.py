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
