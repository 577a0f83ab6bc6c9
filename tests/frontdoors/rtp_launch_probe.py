"""What the plugin holds on one RTP rank, read by the stand-in's ranks through ``RTP_STANDIN_INSPECT``
(tests/rtp_standin/rtp_llm/standin_report.py) for ``tests/frontdoors/test_rtp_launch.py``.

:func:`expert_shards` reads the routed experts of every MoE layer from the rank's compiled program: how many
experts it holds, which ones (the ``expert_offset`` constant the EP shard pass adds; none when it holds them all),
their widths, and a checksum of each held expert's gate/up and down weights, which the test recomputes from the
checkpoint for the layout ``EP_SIZE`` asks for.
"""

from __future__ import annotations

SUFFIX = "mlp.experts.gate_up_proj"


def expert_shards(engine) -> dict:
    """``{"mapping": [tp, rank, ep], "layers": {layer: {...}}}`` of ``engine``'s target model (an MtpEngine's
    target too). Per layer: ``offset`` (None: no expert offset, the experts are all held), ``gate_up`` /
    ``down`` (shapes), ``gate_up_sums`` / ``down_sums`` (per held expert, float64 sums)."""
    model = getattr(engine, "target", engine).model
    graph = model.py_model.program.graph
    tensors = dict(graph.named_parameters())
    tensors.update(graph.named_buffers())
    layers = {}
    for name, gate_up in tensors.items():
        if not name.endswith(SUFFIX):
            continue
        prefix = name[:-len("gate_up_proj")]
        layer = int(name.split("layers.")[1].split(".")[0])
        down, offset = tensors[prefix + "down_proj"], tensors.get(prefix + "expert_offset")
        layers[layer] = dict(
            offset=None if offset is None else int(offset), gate_up=list(gate_up.shape), down=list(down.shape),
            gate_up_sums=[float(gate_up[e].double().sum()) for e in range(gate_up.shape[0])],
            down_sums=[float(down[e].double().sum()) for e in range(down.shape[0])])
    mapping = model.mapping
    return dict(mapping=[mapping.tp, mapping.rank, mapping.ep], layers=layers)
