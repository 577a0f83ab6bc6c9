"""Test stand-in of ``rtp_llm/server/server_args/server_args.py`` (rtp-llm 4b8d39cd5; not RTP-LLM code).

``setup_args`` parses ``sys.argv`` (or ``args``) strictly, as RTP does: ``EnvArgumentParser.parse_args`` calls
argparse's ``parse_args`` (``:293``), ``setup_args`` uses it (``:523-543``), and nothing calls
``parse_known_args``. So an unknown flag is argparse's usage error and exits with code 2. A flag wins over its
environment variable.

The stand-in emulates stock main by default, which declares no ``--external_model_packages``. Setting
``RTP_STANDIN_PR1266=1`` emulates RTP patched with PR #1266 (6a6024414): ``model_group_args.py`` then declares
the flag (command line only), ``setup_default_args`` and ``ModelFactory.create_model_config`` import the packages
it names, and the stand-in's ``rtp_llm.utils.import_util`` has the loader whatever the switch says.
"""

import os
import sys

from rtp_llm.ops import ParallelismConfig
from rtp_llm.standin_engine import parse_args

PR1266_SWITCH = "RTP_STANDIN_PR1266"


def pr1266_enabled(env=None) -> bool:
    """Whether the stand-in's server emulates RTP patched with PR #1266 (else stock main 4b8d39cd5)."""
    return (os.environ if env is None else env).get(PR1266_SWITCH, "0") == "1"


class PyEnvConfigs:
    """What the stand-in's launch reads of RTP's ``PyEnvConfigs`` (``config/py_config_modules.py``): the parsed
    settings (``args``), the ``parallelism_config`` they bind (``parallel_group_args.py:14-62``), whether #1266 is
    emulated, and the port of the process group (RTP derives it from ``START_PORT``)."""

    def __init__(self, args, pr1266):
        self.args, self.pr1266, self.nccl_init_port = args, pr1266, 0
        pc = self.parallelism_config = ParallelismConfig()
        for field in ("tp_size", "ep_size", "dp_size", "world_size", "world_rank", "local_world_size"):
            setattr(pc, field, args[field])


def setup_args(args=None) -> PyEnvConfigs:
    """``setup_args``: ``args=None`` parses ``sys.argv[1:]``, as the server entry does."""
    pr1266 = pr1266_enabled()
    argv = sys.argv[1:] if args is None else list(args)
    return PyEnvConfigs(parse_args(argv, dict(os.environ), pr1266=pr1266, server=True), pr1266)
