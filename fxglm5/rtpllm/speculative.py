"""RTP-LLM's speculative decoding (sp_type "mtp") through the plugin: GLM-5's MTP layer as RTP's draft model
``glm_5-mtp``. Read from rtp-llm 4b8d39cd5; the contract,
with file:line, is docs/rtp_speculative.md.

- The target's verify step replayed from RTP's CUDA graphs: :mod:`fxglm5.rtpllm.verify`.
- :class:`Fxglm5MtpPyModel` / :class:`Fxglm5Glm5Mtp`: ``compile_mtp``'s graph as the draft. RTP hands it the
  target's returned hidden states (``PyModelOutputs.hidden_states``, carried as ``all_hidden_states``) in
  ``PyModelInputs.input_hiddens`` (``MtpBatchStreamProcessor.cc:777, 815, 1070``; ``PyWrappedModel.cc:785-786``),
  one row per input token, with its own one-layer cache (``getMTPModuleGroupedCacheLayerLayout(0)``,
  ``MtpExecutor.cc:643-645``) under the target's block ids. Its returned hidden states go through RTP's lm_head
  (``PyWrappedModel.cc:866-884``, the final norm skipped), so the draft returns ``shared_head_norm(y)``; the
  pre-norm ``y`` that a chained draft step feeds back goes through ``get_mtp_target_hidden_states``, which RTP
  prefers over the returned rows for the next draft input (``MtpExecutor.cc:241-254, 967, 2282``). Its weights
  are the MTP layer's, the embedding and the lm_head only (``Glm5MtpDraft``): the decoder stack is the target's.
- :class:`DraftDecodeGraphStep`: the draft's decode CUDA graphs (``draft_model_``, one token per request,
  ``PyWrappedModel.h:305-331``): the target decode graph's static metadata, RTP's static ``input_hiddens``
  buffer (``cuda_graph_runner.cc:193-229, 1075-1082``), and a static buffer for ``y`` per graph.
- :class:`DraftPrefillGraphStep`: the draft-prefill CUDA graphs (``sp_prefill_draft_model_``, built whenever
  ``ENABLE_CUDA_GRAPH=1``: ``MtpExecutor.cc:734-744``; keyed by the total token count ``i * (k+1)``,
  ``cuda_graph_prefill.cc:100-114``) that run the draft extend after every verify step: the accepted tokens of each
  request packed, a count that varies per request inside one replay. Every token row's request, position and
  cache slot is a static buffer rebuilt by ``prepare_cuda_graph`` from RTP's refilled host lengths and tables; the
  rows past the live tokens are padding that writes nothing.
- Tensor / expert parallel: RTP builds the draft with the target's ``parallelism_config``
  (``model_factory.py:183-186``). The MTP layer is sharded as the target's layers (``compiler.compile_mtp`` with
  the rank's Mapping: its heads, its experts by EP, its head's vocabulary rows) and filled from the rank's slices
  (``runtime.shard_loader``); the draft publishes that vocabulary shard as ``lm_head``, which RTP's C++ multiplies
  and all-gathers as the target's (``PyWrappedModel.cc:915-935, 1051-1053``). Where RTP aliases the target's
  global weights (:meth:`Fxglm5Glm5Mtp.speculative_weight_alias_names`, ``model_factory.py:173-218``) the draft's
  graph runs on the target's embedding and lm_head shard, which it neither reads nor holds twice.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fxglm5.errors import ConfigError, InputError
from fxglm5.model.config import Glm5Config
from fxglm5.rtpllm.config import act_quant as _act_quant
from fxglm5.rtpllm.config import compute_dtype, fill_model_config, fp8_kv_cache, no_weight_info_cls, rtp_symbol
from fxglm5.rtpllm.context import StepMetadata, _context, _host, _tables, bind_caches, scratch_step, step_prologue
from fxglm5.rtpllm.glm5 import Fxglm5Glm5
from fxglm5.rtpllm.parallel import graph_weight, join_rtp_tp_group, loaded_everywhere, rtp_mapping
from fxglm5.runtime.decode_graphs import request_rows
from rtp_llm.models.base_model import BaseModel
from rtp_llm.models_py.model_desc.module_base import GptModelBase

MTP_NAME, MTP_ALIAS = "glm_5-mtp", "fxglm5_glm5_mtp"  # RTP's pattern: deepseek-v3-mtp, qwen_3_moe-mtp
# RTP's global weight names the draft publishes -> the MTP graph's attributes that hold them
GRAPH_WEIGHTS = {"lm_head": "mtp.head.weight", "embedding": "mtp.embed_tokens.weight",
                 "final_layernorm.gamma": "mtp.shared_head_norm.weight"}


class DraftDecodeGraphStep(StepMetadata):
    """The static step inputs of a draft decode CUDA graph (RTP's ``draft_model_``: one token per request, built
    as the target's decode graph, ``StepMetadata(static=True)``) and the static buffer its forward writes the
    pre-norm rows ``y`` into. A replay runs no Python forward, so :meth:`prepare_cuda_graph`, which RTP calls
    before every replay, points the model's ``get_mtp_target_hidden_states`` at this graph's buffer."""

    def __init__(self, attn, layout, device, model: "Fxglm5MtpPyModel"):
        rows = _host(attn, "input_lengths").shape[0]
        self.model = model
        self.mtp_hidden = torch.zeros(rows, model.glm5_config.hidden_size, dtype=model.dtype, device=device)
        super().__init__(attn, layout, device, static=True)

    def prepare_cuda_graph(self, attn) -> None:
        super().prepare_cuda_graph(attn)
        self.model.mtp_hidden = self.mtp_hidden


class DraftPrefillGraphStep(StepMetadata):
    """The static step inputs of one draft-prefill CUDA graph (RTP's ``sp_prefill_draft_model_``), captured for a
    total of ``tokens`` token rows (a multiple of k+1) over RTP's ``max_bs`` request rows.

    RTP replays it for the draft extend after a verify step: each request's accepted tokens (1..k+1 of them, a
    count that varies per request and per step) packed behind its verify prefix, the total rounded up to the next
    captured count (``cuda_graph_runner.cc:717-737``); it copies the live ``input_lengths`` / ``prefix_lengths`` /
    tables into the graph's static inputs, zeroes the padding requests' lengths but not their host table rows
    (``:351-373, 505-517, 588-612``) and then calls :meth:`prepare_cuda_graph`. So nothing about a token row is
    fixed at capture but its index: the rows' request ids, positions and cache slots are static device buffers
    rebuilt here from the host lengths and tables. Request b's tokens are rows ``sum(input_lengths[:b])`` .. of the
    packed input; a request is live where its input length is positive and its table starts with a real block
    (padding requests and the capture's all-zero tables are not); every other row (past the live tokens, or a
    request that is not live) is padding: position 0, slot -1 (written nowhere), request 0. Every row's hidden
    state is returned (RTP selects the rows it samples, ``lm_output_indexes``), and the pre-norm ``y`` goes to
    this graph's static buffer, which :meth:`prepare_cuda_graph` makes the model's ``get_mtp_target_hidden_states``
    (RTP reads it right after the replay: ``runDraftPrefillForward``, ``MtpExecutor.cc:1960-1970``)."""

    static, caches = True, None

    def __init__(self, attn, layout, device, model: "Fxglm5MtpPyModel", tokens: int):
        if tokens < 1:
            raise InputError(f"input_ids: a draft-prefill graph of {tokens} token rows")
        self.layout, self.device, self.model, self.tokens = layout, device, model, tokens
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.req_idx = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(tokens, device=device)
        self.block_table = attn.kv_cache_kernel_block_id_device  # RTP's static buffer: its address is fixed
        self.mtp_hidden = torch.zeros(tokens, model.glm5_config.hidden_size, dtype=model.dtype, device=device)
        self.prepare_cuda_graph(attn)

    def prepare_cuda_graph(self, attn) -> None:
        """Each live request's tokens at their packed rows (validated as an eager prefill's); padding elsewhere."""
        if self.layout is None:
            raise InputError("CUDA-graph draft prefill before initialize() was given RTP's KV cache")
        lengths = _host(attn, "input_lengths")
        if lengths is None or lengths.dim() != 1:
            raise InputError("input_lengths: unset in a draft-prefill graph step")
        lengths = lengths.long()
        if int(lengths.min()) < 0 or int(lengths.sum()) > self.tokens:
            raise InputError(f"input_lengths: {lengths.tolist()} pack {int(lengths.sum())} tokens; this draft-prefill "
                             f"graph was captured for {self.tokens}")
        kernel = _tables(attn, self.layout)[1]
        first = kernel[:, 0] if kernel.shape[1] else torch.zeros_like(lengths)
        live = torch.nonzero((lengths > 0) & (first != 0)).flatten()
        positions = torch.zeros(self.tokens, dtype=torch.int64)
        slots = torch.full((self.tokens,), -1, dtype=torch.int64)
        requests = torch.zeros(self.tokens, dtype=torch.int64)
        if live.numel():
            ctx = _context(attn, live, self.layout)
            offsets = torch.cumsum(lengths, 0) - lengths
            rows = torch.cat([torch.arange(int(offsets[b]), int(offsets[b] + lengths[b])) for b in live])
            positions[rows], slots[rows] = ctx.positions.cpu().long(), ctx.slot_mapping.cpu().long()
            requests[rows] = live.repeat_interleave(lengths[live])
        self.positions.copy_(positions)
        self.slot_mapping.copy_(slots)
        self.req_idx.copy_(requests)
        self.model.mtp_hidden = self.mtp_hidden


def mtp_model_config(ckpt_path) -> Glm5Config:
    """The checkpoint's config as the draft model sees it (one MoE layer with its indexer); ConfigError for a
    checkpoint without an MTP layer."""
    cfg = Glm5Config.from_json(Path(ckpt_path) / "config.json")
    if cfg.num_nextn_predict_layers < 1:
        raise ConfigError(f"{Path(ckpt_path) / 'config.json'}: num_nextn_predict_layers="
                          f"{cfg.num_nextn_predict_layers}; the checkpoint has no MTP layer to serve as RTP's draft "
                          f"model {MTP_NAME!r}")
    from fxglm5.compiler import mtp_graph_config

    return mtp_graph_config(cfg)


class Fxglm5MtpPyModel(GptModelBase):
    """The compiled MTP layer on RTP's draft cache; ``forward`` returns ``shared_head_norm(y)`` for every row."""

    def __init__(self, config, parallelism_config, weight, max_generate_batch_size, fmha_config=None,
                 py_hw_kernel_config=None, device_resource_config=None, *, model, program, kv_cache: str = "bf16"):
        """``model``: the (meta) Glm5MtpDraft ``program`` was compiled from; the weights are the program's."""
        super().__init__(config, parallelism_config, weight, max_generate_batch_size, fmha_config, py_hw_kernel_config,
                         device_resource_config)
        from fxglm5.model.layers import RMSNorm

        self.glm5_config: Glm5Config = model.config
        self.dtype, self.program = model.dtype, program
        gamma = graph_weight(program.graph, GRAPH_WEIGHTS["final_layernorm.gamma"], "compiled MTP graph")
        self.device = gamma.device
        self.shared_head_norm = RMSNorm(gamma.shape[0], model.config.rms_norm_eps, gamma.dtype, "meta")
        self.shared_head_norm.weight = torch.nn.Parameter(gamma, requires_grad=False)
        self.cache_spec = program.cache_spec(kv_cache, "fp8", self.dtype)  # RTP's layout, as the target's
        self.caches, self.layout, self.mtp_hidden = None, None, None

    def initialize(self, init_resource) -> bool:
        kv = getattr(init_resource, "kv_cache", None)
        self.caches, self.layout = (None, None) if kv is None else bind_caches(
            kv, self.cache_spec, self.glm5_config.max_position_embeddings)
        return True

    def prepare_fmha_impl(self, inputs, is_cuda_graph: bool = False) -> StepMetadata:
        if is_cuda_graph:
            attn = inputs.attention_inputs
            if bool(attn.is_prefill):  # sp_prefill_draft_model_: a draft is never target-verify
                if bool(getattr(attn, "is_target_verify", False)):
                    raise InputError(f"attention_inputs: {MTP_NAME} is a draft model; RTP builds target-verify graphs "
                                     "for the target only")
                return DraftPrefillGraphStep(attn, self.layout, self.device, self, int(inputs.input_ids.shape[0]))
            return DraftDecodeGraphStep(attn, self.layout, self.device, self)
        return StepMetadata(inputs.attention_inputs, self.layout, self.device, scratch=lambda a: scratch_step(
            a, self.cache_spec, self.device, self.glm5_config.max_position_embeddings))

    def forward(self, inputs, fmha_impl: StepMetadata | None = None):
        impl, ids, caches = step_prologue(self, inputs, fmha_impl)
        hidden = inputs.input_hiddens
        want = (ids.shape[0], self.glm5_config.hidden_size)
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != want:
            got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise InputError(f"input_hiddens: the MTP draft needs the target's hidden state of every input token, "
                             f"expected {want}, got {got}")
        with torch.no_grad():
            y = self.program(impl.inputs(), ids, caches, hidden=hidden.to(self.dtype)).hidden
            if impl.static:  # the graph's static buffer; its prepare_cuda_graph points mtp_hidden at it
                impl.mtp_hidden.copy_(y)
            else:
                self.mtp_hidden = y
            out = self.shared_head_norm(y)
        return rtp_symbol("rtp_llm.ops.compute_ops:PyModelOutputs", "rtp_llm.ops:PyModelOutputs")(out)

    def get_mtp_target_hidden_states(self, num_tokens: int):
        """The last step's pre-norm MTP outputs ``y`` (its first ``num_tokens`` rows; all for a negative count; a
        graph step's: the replayed graph's static buffer, padding rows included): what a chained draft step takes as
        the hidden state of the position before it."""
        if self.mtp_hidden is None:
            return None
        n = self.mtp_hidden.shape[0] if num_tokens < 0 else int(num_tokens)
        if n > self.mtp_hidden.shape[0]:
            raise InputError(f"get_mtp_target_hidden_states: {n} rows asked, the last forward computed "
                             f"{self.mtp_hidden.shape[0]}")
        return self.mtp_hidden[:n]


class Fxglm5Glm5Mtp(BaseModel):
    """GLM-5's MTP layer (checkpoint layer ``num_hidden_layers``) as RTP's draft model (``--sp_model_type
    glm_5-mtp --sp_type mtp``, ``--sp_checkpoint_path`` the GLM-5 checkpoint)."""

    @classmethod
    def _create_config(cls, ckpt_path):
        model_config = rtp_symbol("rtp_llm.config.model_config:ModelConfig")()
        fill_model_config(model_config, mtp_model_config(ckpt_path), ckpt_path)
        model_config.is_mtp = True  # as RTP's DeepSeekV3Mtp (models/deepseek_v2.py:798-806)
        model_config.reverse_e_h_norm = True  # eh_proj(cat([enorm(e), hnorm(h)])): the embedding first
        return model_config

    @staticmethod
    def get_weight_cls():
        return no_weight_info_cls()

    @classmethod
    def speculative_weight_alias_names(cls, target_model, draft_model_config) -> tuple[str, ...]:
        """RTP's opt-in to global weights a draft borrows from its target (``BaseModel.speculative_weight_alias_names``,
        ``models/base_model.py:276-287``; ``get_sp_model`` hands the draft ``weight_alias_owner = target`` and then
        requires each name's tensor to be the owner's own, ``model_factory.py:173-218``): ``embedding`` and, unless
        the MTP layer has a head of its own, ``lm_head``, from an fxglm5 GLM-5 target serving the same checkpoint
        directory in the same compute dtype. Those are then the tensors the draft would read: the embedding whole, and
        at every tp the same vocabulary rows of ``lm_head.weight`` (the target's published shard
        ``[V/tp * r, V/tp * (r+1))`` is the draft head's part at rank r). Any other target: none (the draft reads
        its own)."""
        from fxglm5.model.checkpoint import CheckpointReader

        target_config = getattr(target_model, "model_config", None)
        if not isinstance(target_model, Fxglm5Glm5) or target_config is None:
            return ()
        same = Path(target_config.ckpt_path).resolve() == Path(draft_model_config.ckpt_path).resolve()
        if not same or compute_dtype(target_config) != compute_dtype(draft_model_config):
            return ()
        layout = CheckpointReader(draft_model_config.ckpt_path, mtp_only=True).mtp_layout
        return ("embedding",) if layout.own_head else ("embedding", "lm_head")

    def support_cuda_graph(self) -> bool:
        """As the target's (``Fxglm5Glm5.support_cuda_graph``): block-FP8 checkpoints only, the bf16 MoE syncs with
        the host. The graphs are the draft decode graphs and the draft-prefill graphs."""
        return Glm5Config.from_json(Path(self.model_config.ckpt_path) / "config.json").is_fp8

    def load(self, skip_python_model: bool = False):
        model_config = self.model_config
        cfg = mtp_model_config(model_config.ckpt_path)
        # every check reads only the config, the same on every rank: all ranks refuse before any collective
        self.mapping = rtp_mapping(getattr(self, "parallelism_config", None), cfg)
        if getattr(getattr(self, "hw_kernel_config", None), "enable_cuda_graph", False) and not self.support_cuda_graph():
            raise ConfigError(f"ENABLE_CUDA_GRAPH=1: {model_config.ckpt_path} is not block-FP8; the bf16 MTP layer's "
                              f"MoE syncs with the host, so the {MTP_NAME} draft cannot be captured (ENABLE_CUDA_GRAPH=0)")
        if self.mapping.tp > 1 and cfg.vocab_size % self.mapping.tp:
            raise InputError(f"vocab_size = {cfg.vocab_size} is not divisible by tp={self.mapping.tp}: RTP-LLM "
                             "all-gathers the draft's logits as equal vocabulary shards")
        dtype = compute_dtype(model_config)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if self.mapping.tp > 1:
            join_rtp_tp_group(self.mapping)
        owner = getattr(self, "_weight_alias_owner", None)
        aliases = {name: owner.weight.get_global_weight(name) for name in getattr(self, "_weight_alias_names", ())}
        self.program, self.glm5, self.load_report = load_draft_rank(model_config.ckpt_path, self.mapping, dtype, device,
                                                                    aliases, _act_quant())
        weights = rtp_symbol("rtp_llm.model_loader.model_weight_info:ModelWeights",
                             "rtp_llm.utils.model_weight:ModelWeights")(1, device, dtype)
        for name, target in GRAPH_WEIGHTS.items():  # lm_head: at tp > 1 the rank's vocabulary rows, RTP gathers them
            weights.set_global_weight(name, aliases[name] if name in aliases else graph_weight(
                self.program.graph, target, "compiled MTP graph"))
        self.weight, self.weight_manager, self.py_eplb, self.model_weights_loader = weights, None, None, None
        if not skip_python_model:
            self.py_model = Fxglm5MtpPyModel(
                model_config, getattr(self, "parallelism_config", None), weights,
                getattr(self, "max_generate_batch_size", 1), fmha_config=getattr(self, "fmha_config", None),
                py_hw_kernel_config=getattr(self, "hw_kernel_config", None), model=self.glm5, program=self.program,
                kv_cache="fp8" if fp8_kv_cache(model_config) else "bf16")


def load_draft_rank(ckpt_path, mapping, dtype: torch.dtype, device, aliases: dict, act_quant: bool = False):
    """This rank's compiled MTP program (W8A8 FP8 GEMMs with ``act_quant``, as the target's), filled with its
    slices: ``(program, meta Glm5MtpDraft, LoadReport)``.

    The draft reads the MTP layer and the model tensors it shares only (``CheckpointReader(mtp_only=True)``), is
    compiled on the meta device with the rank's Mapping (``compile_mtp``; at tp 1 nothing is sharded) and filled by
    ``shard_loader`` (at tp > 1 after the ranks agree on the plan, and with every rank's outcome exchanged, as the
    target's ``load_rtp_rank``). ``aliases``: RTP global weight name -> the target's tensor, which the graph takes
    instead of reading it (:meth:`Fxglm5Glm5Mtp.speculative_weight_alias_names`)."""
    from fxglm5.compiler import MAX_STEP_TOKENS, compile_mtp
    from fxglm5.model.checkpoint import CheckpointReader
    from fxglm5.model.modeling import Glm5MtpDraft
    from fxglm5.runtime.shard_loader import load_rank, load_sharded

    reader = CheckpointReader(ckpt_path, mtp_only=True)
    cfg = reader.config
    model = Glm5MtpDraft(cfg, dtype, "meta", reader.mtp_layout)
    compiled = compile_mtp(model, max_tokens=max(cfg.max_position_embeddings, MAX_STEP_TOKENS), device=device,
                           mapping=mapping, act_quant=act_quant, inputs_validated=True)
    given = {GRAPH_WEIGHTS[name]: tensor for name, tensor in aliases.items()}
    failure = report = None
    try:
        if mapping.tp > 1:
            report = load_rank(compiled.graph, mapping, reader, model, device, given)
        else:
            report = load_sharded(compiled.graph, reader, model, device, given)
    except Exception as err:  # noqa: BLE001 - raised again below, on this rank and (named) on every other
        failure = err
    if mapping.tp > 1:
        loaded_everywhere(failure, mapping)
    elif failure is not None:
        raise failure
    return compiled.program, model, report


def register(factory) -> None:
    """``glm_5-mtp`` and ``fxglm5_glm5_mtp``: RTP has no GLM-5 draft type of its own to take over."""
    factory.register_model(MTP_NAME, Fxglm5Glm5Mtp)
    factory.register_model(MTP_ALIAS, Fxglm5Glm5Mtp)
