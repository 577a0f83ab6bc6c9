"""Test stand-in of RTP-LLM's server entry, ``python -m rtp_llm.start_server`` (``rtp_llm/start_server.py`` at
4b8d39cd5; not RTP-LLM code).

- ``main`` (``:597-601``) runs ``setup_args()``, which parses ``sys.argv`` strictly (stock main has no
  ``--external_model_packages``; see ``server.server_args``), then ``setup_and_configure_server``, then
  ``start_server``. The module calls ``main()`` only as ``__main__`` (``:1034-1035``). A spawned child re-runs it
  as ``__mp_main__``, which runs nothing.
- ``start_server`` makes ``spawn`` the start method (``:612-613``). It then starts the backend process
  (``:121-126``, target ``start_backend_server``; its ranks are spawned in turn, see ``start_backend_server``)
  and the frontend process (``:489-490``, target ``start_frontend_server``).
- In the stand-in the parent waits for both processes and exits non-zero if either failed. Real RTP runs health
  checks and then serves.

With ``RTP_STANDIN_RESULT_DIR`` set, the parent records the model class its model type resolves to, as
``server.json`` (``standin_report``).
"""

import multiprocessing
import socket
import sys

from rtp_llm import standin_report
from rtp_llm.config.server_config_setup import setup_and_configure_server
from rtp_llm.model_factory_register import _model_factory, ensure_model_registered
from rtp_llm.server.server_args.server_args import setup_args
from rtp_llm.start_backend_server import start_backend_server
from rtp_llm.start_frontend_server import start_frontend_server

TIMEOUT = 1800  # seconds: the stand-in's ranks compile on a CPU


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    py_env_configs = setup_args()
    setup_and_configure_server(py_env_configs)
    start_server(py_env_configs)


def start_server(py_env_configs):
    model_type = py_env_configs.args["model_type"]
    ensure_model_registered(model_type)
    standin_report.write("server", model_type=model_type,
                         model_class=standin_report.qualname(_model_factory[model_type]))
    multiprocessing.set_start_method("spawn", force=True)
    py_env_configs.nccl_init_port = _free_port()
    backend = multiprocessing.Process(target=start_backend_server, args=(py_env_configs,), name="backend_manager")
    frontend = multiprocessing.Process(target=start_frontend_server, args=(py_env_configs,), name="frontend")
    for process in (backend, frontend):
        process.start()
    failed = []
    for process in (backend, frontend):
        process.join(TIMEOUT)
        if process.is_alive():
            process.terminate()
            process.join(10)
        if process.exitcode != 0:
            failed.append(f"{process.name} exited with code {process.exitcode}")
    if failed:
        print(f"rtp_llm.start_server (stand-in): {'; '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
