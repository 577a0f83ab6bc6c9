"""Test stand-in of RTP-LLM's frontend process (``rtp_llm/start_frontend_server.py`` and
``frontend/frontend_server.py`` at 4b8d39cd5; not RTP-LLM code).

The frontend runs in a process of its own. It looks the model up through ``ModelFactory.create_model_config``
(``frontend_server.py:76``): with PR #1266, that imports the packages first, then ``get_model_cls`` and
``_create_config``. Real RTP then serves HTTP. The stand-in records the class it resolved (``frontend.json``) and
returns.
"""

from rtp_llm import standin_report
from rtp_llm.model_factory import ModelFactory


def start_frontend_server(py_env_configs):
    try:
        model_cls, _ = ModelFactory.create_model_config(py_env_configs)
        standin_report.write("frontend", model_class=standin_report.qualname(model_cls))
    except BaseException as err:
        standin_report.write("frontend", error=f"{type(err).__name__}: {err}")
        raise  # multiprocessing prints the traceback; the process exits with code 1
