"""Test stand-in of ``rtp_llm/config/server_config_setup.py:set_parallelism_config`` (rtp-llm 4b8d39cd5; not
RTP-LLM code): the rank fields derived from ``world_rank`` and the sizes, and RTP's EP rule (``ep_size`` 0, i.e.
``EP_SIZE`` unset, becomes tp * dp; 1 is pure TP and needs dp == 1; anything else must equal tp * dp)."""


def set_parallelism_config(parallelism_config, world_rank=None):
    pc = parallelism_config
    if pc.world_size > 1 and pc.local_world_size == 1:
        pc.local_world_size = pc.world_size  # one host, no CUDA: every rank is local
    if pc.ep_size == 1:
        assert pc.dp_size == 1, f"Pure TP mode (ep_size=1) requires dp_size == 1, got dp_size={pc.dp_size}"
    elif pc.ep_size == 0:
        pc.ep_size = pc.tp_size * pc.dp_size
    else:
        assert pc.ep_size == pc.tp_size * pc.dp_size, (
            f"ep_size must be equal to 1 or tp_size * dp_size, got ep_size={pc.ep_size}, tp_size={pc.tp_size}, "
            f"dp_size={pc.dp_size}")
    pc.ffn_tp_size = pc.tp_size // pc.ffn_sp_size
    pc.enable_sp = pc.ffn_sp_size > 1
    if world_rank is not None:
        pc.world_rank = world_rank
    pc.local_rank = pc.world_rank % pc.local_world_size
    pc.tp_rank = pc.world_rank % pc.tp_size
    pc.dp_rank = pc.world_rank // pc.tp_size
    pc.ep_rank = pc.world_rank % pc.ep_size
    pc.ffn_tp_rank = pc.tp_rank % pc.ffn_tp_size
