"""Test stand-in of RTP-LLM's backend process: ``rtp_llm/start_backend_server.py`` and
``server/backend_manager.py:BackendManager.start`` at 4b8d39cd5. This is not RTP-LLM code.

- ``start_backend_server`` (``:411-464``) runs in the backend process that ``start_server`` spawned. With more
  than one rank it calls ``multi_rank_start``; with one rank it runs ``local_rank_start`` in this process
  (``:461``).
- ``multi_rank_start`` (``:282-361``) uses a ``multiprocessing.get_context("spawn")`` context (``:289``). It
  starts one process per local rank, with ``WORLD_RANK`` set in the environment and a pipe for the rank's
  startup status (``_create_rank_processes``, ``:159-188``). It waits for every rank's status; on a failed
  status or a dead rank, it terminates the others and raises (``_wait_for_ranks_startup``, ``:197-279``;
  ``:319-356``).
- ``local_rank_start`` (``:58-121``) derives the rank's ``ParallelismConfig`` (``set_parallelism_config``), then
  runs ``BackendManager.start``:
  - with ``world_size > 1``, the process groups (``backend_manager.py:50-57``);
  - ``ModelFactory.create_model_config`` (``:70-81``), which is where the model type is looked up;
  - ``ModelFactory.create_propose_model_config`` (``:131-135``): the draft's config, before any load;
  - ``ModelFactory.from_model_configs`` (``:138-145``): the target loaded, the draft loaded, then the engine
    (here the stand-in's ``Engine``, or ``standin_speculative.MtpEngine`` with a draft); see ``model_factory``.
  It then sends its status. Real RTP serves from then on; the stand-in records the launch's steps and
  ``RTP_STANDIN_INSPECT``'s view of the engine, runs ``RTP_STANDIN_REQUESTS``, records what the engine ran (its
  graphs' captures and replays) and returns (``standin_report``).

Differs: RTP calls ``multi_rank_start`` only with more than one CUDA device (``:454-460``), and on a host without
CUDA it runs rank 0 alone (``:433-434``). The stand-in acts as if each rank had a device of its own, and its
process groups are gloo.
"""

import multiprocessing
import os
import time

from rtp_llm import standin_report
from rtp_llm.config.server_config_setup import set_parallelism_config
from rtp_llm.model_factory import ModelFactory
from rtp_llm.models_py.distributed import collective_torch
from rtp_llm.ops import NcclCommConfig

TIMEOUT = 1800  # seconds for the ranks' startup and requests (they compile on a CPU)


def _send_status(pipe_writer, status, message):
    if pipe_writer is not None:
        pipe_writer.send({"status": status, "message": message})
        pipe_writer.close()


class BackendManager:
    def __init__(self, py_env_configs, parallelism_config):
        self.py_env_configs, self.parallelism_config = py_env_configs, parallelism_config
        self.engine = None

    def start(self):
        """``BackendManager.start`` (``server/backend_manager.py:41-145``), in its order."""
        pc, configs = self.parallelism_config, self.py_env_configs
        if pc.world_size > 1:  # :50-57
            collective_torch.init_distributed_environment(pc, NcclCommConfig("127.0.0.1"), configs.nccl_init_port,
                                                          backend="gloo")
        model = ModelFactory.create_model_config(configs)  # :70-81
        standin_report.write(f"rank{pc.world_rank}", model_class=standin_report.qualname(model[0]))
        propose = ModelFactory.create_propose_model_config(configs, model[1])  # :131-135
        self.engine = ModelFactory.from_model_configs(configs, pc, model, propose)  # :138-145
        return self.engine


def local_rank_start(py_env_configs, world_rank=0, pipe_writer=None):
    role = f"rank{world_rank}"
    try:
        pc = py_env_configs.parallelism_config
        set_parallelism_config(pc, world_rank)
        engine = BackendManager(py_env_configs, pc).start()
        _send_status(pipe_writer, "success", f"Backend server started successfully on rank {pc.local_rank}")
        pipe_writer = None
        standin_report.write(role, events=ModelFactory.events, inspected=standin_report.inspect(engine))
        tokens = [engine.generate(prompts, n, **({"reuse_prefix": True} if reuse else {}))  # MtpEngine: no reuse
                  for prompts, n, reuse in standin_report.requests()]
        standin_report.write(role, tokens=tokens, served=standin_report.served(engine))
    except BaseException as err:
        standin_report.write(role, error=f"{type(err).__name__}: {err}", events=ModelFactory.events)
        _send_status(pipe_writer, "failed", f"start server error: {err}")
        raise
    finally:
        collective_torch.destroy_distributed_environment()


def _wait_for_ranks(processes, readers, deadline):
    """Every rank's startup status; a failed status or a rank that died first raises."""
    pending = set(range(len(processes)))
    while pending:
        if time.time() > deadline:
            raise Exception(f"Ranks startup timeout: ranks {sorted(pending)} did not report")
        for i in sorted(pending):
            try:
                if not readers[i].poll(0.5):
                    if not processes[i].is_alive():
                        raise Exception(f"Rank {i} process died unexpectedly with exit code {processes[i].exitcode}")
                    continue
                data = readers[i].recv()
            except EOFError:
                raise Exception(f"Rank {i}: Pipe closed unexpectedly (process may have died)") from None
            pending.discard(i)
            if data.get("status") != "success":
                raise Exception(f"Rank {i} startup failed: {data.get('message', 'Unknown error')}")


def multi_rank_start(py_env_configs):
    ctx = multiprocessing.get_context("spawn")
    pc = py_env_configs.parallelism_config
    local_world_size = pc.local_world_size  # set_parallelism_config: every rank is local to the stand-in's host
    processes, readers = [], []
    try:
        for world_rank in range(pc.world_rank, pc.world_rank + local_world_size):
            reader, writer = ctx.Pipe(duplex=False)
            readers.append(reader)
            os.environ["WORLD_RANK"] = str(world_rank)
            proc = ctx.Process(target=local_rank_start, args=(py_env_configs, world_rank, writer),
                               name=f"rank-{world_rank}")
            processes.append(proc)
            try:
                proc.start()
            finally:
                writer.close()
        deadline = time.time() + TIMEOUT
        _wait_for_ranks(processes, readers, deadline)
        for proc in processes:  # the stand-in's ranks return after their requests
            proc.join(max(1.0, deadline - time.time()))
        failed = [f"{p.name} exited with code {p.exitcode}" for p in processes if p.exitcode != 0]
        if failed:
            raise Exception(f"ranks failed after startup: {', '.join(failed)}")
    except BaseException as err:
        for proc in processes:
            if proc.pid is not None and proc.is_alive():
                proc.terminate()
        for proc in processes:
            if proc.pid is not None:
                proc.join(5)
        raise Exception(f"Multi-rank startup failed: {err}") from err
    return processes


def start_backend_server(py_env_configs):
    if py_env_configs.parallelism_config.world_size > 1:
        return multi_rank_start(py_env_configs)
    return local_rank_start(py_env_configs, 0, None)
