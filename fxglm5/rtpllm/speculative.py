"""RTP-LLM's speculative decoding (sp_type "mtp") through the plugin: the target's verify step replayed from RTP's
CUDA graphs, and GLM-5's MTP layer as RTP's draft model ``glm_5-mtp``. Read from rtp-llm 4b8d39cd5; the contract,
with file:line, is docs/rtp_speculative.md.

- :class:`VerifyStepMetadata`: the static step inputs of a target-verify graph. RTP builds the target's graph
  runner with ``num_tokens_per_bs = gen_num_per_cycle + 1`` (k+1) and ``is_target_verify`` when speculation is on
  (``PyWrappedModel.h:320-341``); its capture inputs are a prefill of k+1 tokens per request behind a prefix
  (``cuda_graph_runner.cc:896-937``), every row's hidden state is returned and scored. So the graph computes
  batch * (k+1) token rows, request ``row // (k+1)`` (``decode_graphs.request_rows``, as the local runtime's verify
  graphs), positions ``prefix_lengths[b] + j``. At a replay RTP zeroes the padding rows' ``input_lengths`` and
  ``prefix_lengths`` but not their host block-table rows (``cuda_graph_runner.cc:509-517, 588-600``): a row is
  live where its input length is positive and its table starts with a real block, else it computes padding
  tokens that write nothing.
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
  buffer (``cuda_graph_runner.cc:193-229, 1075-1082``), and a static buffer for ``y`` per graph. The draft-prefill
  graph (``sp_prefill_draft_model_``) is refused at its capture.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fxglm5.errors import ConfigError, InputError
from fxglm5.model.config import Glm5Config
from fxglm5.rtpllm.config import compute_dtype, fill_model_config, fp8_kv_cache, no_weight_info_cls, rtp_symbol
from fxglm5.rtpllm.context import StepMetadata, _context, _host, _tables, bind_caches, scratch_step, step_prologue
from fxglm5.rtpllm.parallel import rtp_mapping
from fxglm5.runtime.decode_graphs import request_rows
from rtp_llm.models.base_model import BaseModel
from rtp_llm.models_py.model_desc.module_base import GptModelBase

MTP_NAME, MTP_ALIAS = "glm_5-mtp", "fxglm5_glm5_mtp"  # RTP's pattern: deepseek-v3-mtp, qwen_3_moe-mtp


class VerifyStepMetadata(StepMetadata):
    """The graph's step inputs for a target-verify CUDA graph of ``input_lengths[0]`` (= k+1) tokens per request:
    static buffers, refilled by :meth:`prepare_cuda_graph` before each replay."""

    static, caches = True, None

    def __init__(self, attn, layout, device):
        lengths = _host(attn, "input_lengths")
        if lengths is None or lengths.numel() == 0 or int(lengths.min()) < 1 or int(lengths.max()) != int(lengths.min()):
            got = None if lengths is None else lengths.tolist()
            raise InputError(f"input_lengths: a target-verify graph is captured with num_tokens_per_bs tokens for "
                             f"every request, got {got}")
        self.layout, self.device = layout, device
        self.batch, self.tokens_per_request = lengths.shape[0], int(lengths[0])
        rows = self.batch * self.tokens_per_request
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.req_idx, self.logits_indices = request_rows(self.batch, self.tokens_per_request, device)
        self.block_table = attn.kv_cache_kernel_block_id_device  # RTP's static buffer: its address is fixed
        self.prepare_cuda_graph(attn)

    def prepare_cuda_graph(self, attn) -> None:
        """Positions and slots of the live requests' k+1 tokens (validated); padding rows write nothing."""
        if self.layout is None:
            raise InputError("CUDA-graph verify step before initialize() was given RTP's KV cache")
        q = self.tokens_per_request
        lengths = _host(attn, "input_lengths")
        kernel = _tables(attn, self.layout)[1]
        first = kernel[:, 0] if kernel.shape[1] else torch.zeros_like(lengths)
        live = torch.nonzero((lengths > 0) & (first != 0)).flatten()
        wrong = [int(b) for b in live if int(lengths[b]) != q]
        if wrong:
            raise InputError(f"input_lengths: request {wrong[0]} verifies {int(lengths[wrong[0]])} tokens; this graph "
                             f"was captured for {q} per request (RTP's num_tokens_per_bs = gen_num_per_cycle + 1)")
        positions = torch.zeros(self.batch, q, dtype=torch.int64)
        slots = torch.full((self.batch, q), -1, dtype=torch.int64)
        if live.numel():
            ctx = _context(attn, live, self.layout)
            positions[live], slots[live] = ctx.positions.view(-1, q).cpu(), ctx.slot_mapping.view(-1, q).cpu()
        self.positions.copy_(positions.flatten())
        self.slot_mapping.copy_(slots.flatten())


def verify_step(attn, layout, device):
    """A CUDA-graph step's metadata where RTP captures a prefill: only its target-verify graphs (InputError for
    any other prefill graph, which the plugin does not support)."""
    if not bool(getattr(attn, "is_target_verify", False)):
        raise InputError("attention_inputs: the plugin's CUDA graphs are decode and target-verify steps; got a "
                         "prefill batch without is_target_verify")
    return VerifyStepMetadata(attn, layout, device)


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
        super().__init__(config, parallelism_config, weight, max_generate_batch_size, fmha_config, py_hw_kernel_config,
                         device_resource_config)
        self.glm5_config: Glm5Config = model.config
        self.dtype, self.program = model.dtype, program
        self.shared_head_norm = model.mtp.shared_head_norm
        self.device = next(model.mtp.parameters()).device
        self.cache_spec = program.cache_spec(kv_cache, "fp8", self.dtype)  # RTP's layout, as the target's
        self.caches, self.layout, self.mtp_hidden = None, None, None

    def initialize(self, init_resource) -> bool:
        kv = getattr(init_resource, "kv_cache", None)
        self.caches, self.layout = (None, None) if kv is None else bind_caches(
            kv, self.cache_spec, self.glm5_config.max_position_embeddings)
        return True

    def prepare_fmha_impl(self, inputs, is_cuda_graph: bool = False) -> StepMetadata:
        if is_cuda_graph:
            if bool(inputs.attention_inputs.is_prefill):
                raise InputError(f"{MTP_NAME}: RTP's draft-prefill CUDA graph (sp_prefill_draft_model_: each "
                                 "request's accepted tokens behind its prefix, a variable count per request) is not "
                                 "supported, only the draft's decode graphs are; RTP captures both with "
                                 "ENABLE_CUDA_GRAPH=1, so serve the MTP draft with ENABLE_CUDA_GRAPH=0")
            return DraftDecodeGraphStep(inputs.attention_inputs, self.layout, self.device, self)
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
        graph step's: its static buffer's, padding rows included): what a chained draft step takes as the hidden
        state of the position before it."""
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

    def support_cuda_graph(self) -> bool:
        """As the target's (``Fxglm5Glm5.support_cuda_graph``): block-FP8 checkpoints only, the bf16 MoE syncs with
        the host. The graphs are the draft decode graphs; the draft-prefill graph is refused at its capture
        (``Fxglm5MtpPyModel.prepare_fmha_impl``)."""
        return Glm5Config.from_json(Path(self.model_config.ckpt_path) / "config.json").is_fp8

    def load(self, skip_python_model: bool = False):
        from fxglm5.compiler import MAX_STEP_TOKENS, compile_mtp
        from fxglm5.model.modeling import Glm5MtpDraft

        model_config = self.model_config
        cfg = mtp_model_config(model_config.ckpt_path)
        if rtp_mapping(getattr(self, "parallelism_config", None), cfg).tp != 1:
            raise ConfigError(f"{MTP_NAME}: the MTP graph is compiled for one rank only (tp_size=1)")
        if getattr(getattr(self, "hw_kernel_config", None), "enable_cuda_graph", False) and not self.support_cuda_graph():
            raise ConfigError(f"ENABLE_CUDA_GRAPH=1: {model_config.ckpt_path} is not block-FP8; the bf16 MTP layer's "
                              f"MoE syncs with the host, so the {MTP_NAME} draft cannot be captured (ENABLE_CUDA_GRAPH=0)")
        dtype = compute_dtype(model_config)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        # the MTP layer, the embedding and the lm_head only: the decoder stack is the target's (not read twice)
        self.glm5 = Glm5MtpDraft.from_pretrained(model_config.ckpt_path, dtype=dtype, device=device, progress=False)
        self.program = compile_mtp(self.glm5, max_tokens=max(cfg.max_position_embeddings, MAX_STEP_TOKENS),
                                   device=device, inputs_validated=True).program
        mtp = self.glm5.mtp
        weights = rtp_symbol("rtp_llm.model_loader.model_weight_info:ModelWeights",
                                   "rtp_llm.utils.model_weight:ModelWeights")(1, device, dtype)
        weights.set_global_weight("lm_head", mtp.head.weight)  # RTP's lm_head turns the draft's rows into logits
        weights.set_global_weight("embedding", mtp.embed_tokens.weight)
        weights.set_global_weight("final_layernorm.gamma", mtp.shared_head_norm.weight)
        self.weight, self.weight_manager, self.py_eplb, self.model_weights_loader = weights, None, None, None
        if not skip_python_model:
            self.py_model = Fxglm5MtpPyModel(
                model_config, getattr(self, "parallelism_config", None), weights,
                getattr(self, "max_generate_batch_size", 1), fmha_config=getattr(self, "fmha_config", None),
                py_hw_kernel_config=getattr(self, "hw_kernel_config", None), model=self.glm5, program=self.program,
                kv_cache="fp8" if fp8_kv_cache(model_config) else "bf16")


def register(factory) -> None:
    """``glm_5-mtp`` and ``fxglm5_glm5_mtp``: RTP has no GLM-5 draft type of its own to take over."""
    factory.register_model(MTP_NAME, Fxglm5Glm5Mtp)
    factory.register_model(MTP_ALIAS, Fxglm5Glm5Mtp)
