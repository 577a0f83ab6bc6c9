"""What the plugin holds on one RTP rank, read by the stand-in's ranks through ``RTP_STANDIN_INSPECT``
(tests/rtp_standin/rtp_llm/standin_report.py) for ``tests/frontdoors/test_rtp_launch.py``.

:func:`expert_shards` reads the routed experts of every MoE layer from the rank's compiled program: how many
experts it holds, which ones (the ``expert_offset`` constant the EP shard pass adds; none when it holds them all),
their widths, and a checksum of each held expert's gate/up and down weights, which the test recomputes from the
checkpoint for the layout ``EP_SIZE`` asks for.

:func:`mtp_draft` adds, for an MTP launch, what the started draft holds of RTP's aliased global weights (``embedding``
and ``lm_head``, ``get_sp_model``'s alias, ``model_factory.py:173-218`` at 4b8d39cd5): whether each is the target's
tensor itself and on its storage, its shape, and a checksum that the test recomputes from the checkpoint (at
tp > 1 the rank's vocabulary rows of ``lm_head``).
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


def mtp_draft(engine) -> dict:
    """:func:`expert_shards` and ``draft``: per RTP global weight name the draft publishes (``embedding``,
    ``lm_head``): ``aliased`` (the draft's tensor is the target's object), ``same_storage`` (same ``data_ptr``),
    ``shape`` and ``sum`` (float64); ``alias_names``: what MtpEngine's alias step was given."""
    target, draft = engine.target.model, engine.draft
    weights = {}
    for name in ("embedding", "lm_head"):
        mine, owner = draft.weight.get_global_weight(name), target.weight.get_global_weight(name)
        weights[name] = dict(aliased=mine is owner, same_storage=mine.data_ptr() == owner.data_ptr(),
                             shape=list(mine.shape), sum=float(mine.double().sum()))
    return dict(expert_shards(engine), draft=weights, alias_names=list(engine.alias_names))
