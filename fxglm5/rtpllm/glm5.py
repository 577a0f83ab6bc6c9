"""fxglm5's GLM-5 as an RTP-LLM model (imported only where ``rtp_llm`` is).

- :class:`Fxglm5Glm5` (an RTP ``BaseModel``): the config for RTP's cache allocator, the checkpoint loaded as
  is (FP8 block-scaled or bf16), the lm_head / embedding / final norm published for RTP's C++ side.
- :class:`Fxglm5PyModel` (an RTP ``GptModelBase``): the decoder captured once and rewritten by fxglm5's
  passes (``head="hidden"``: RTP applies the lm_head itself), run on the caches RTP allocated. ``forward``
  never syncs with the host, so RTP can capture it in its decode CUDA graphs.

Tensor / expert parallel (``fxglm5.rtpllm.parallel``): rank and world come from RTP's ``parallelism_config``,
the collectives run on the TP process group RTP created; each rank compiles its shard, reads only its slices and
publishes its lm_head vocabulary shard, and returns every token's full hidden state.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import torch

from fxglm5.compiler import MAX_STEP_TOKENS, PREFILL_STEP_TOKENS, compile_model
from fxglm5.errors import ConfigError
from fxglm5.model.config import Glm5Config
from fxglm5.program import PagedProgram
from fxglm5.rtpllm.config import compute_dtype, fill_model_config, no_weight_info_cls
from fxglm5.rtpllm.config import act_quant as _act_quant, fp8_kv_cache as _fp8_kv_cache, rtp_symbol as _rtp_symbol
from fxglm5.rtpllm.context import StepMetadata, bind_caches, scratch_step, step_prologue
from fxglm5.rtpllm.parallel import join_rtp_tp_group, graph_weight, load_rtp_rank, rtp_mapping
from fxglm5.rtpllm.verify import verify_step
from rtp_llm.models.base_model import BaseModel
from rtp_llm.models_py.model_desc.module_base import GptModelBase

log = logging.getLogger(__name__)
NAME, ALIAS, ARCHITECTURE = "glm_5", "fxglm5_glm5", "GlmMoeDsaForCausalLM"


class Fxglm5PyModel(GptModelBase):
    """The compiled decoder on RTP's paged caches; ``forward`` returns the final-norm hidden states."""

    def __init__(self, config, parallelism_config, weight, max_generate_batch_size, fmha_config=None,
                 py_hw_kernel_config=None, device_resource_config=None, *, model, kv_cache: str = "bf16",
                 compiled=None, act_quant: bool = False):
        """``model``: the loaded Glm5ForCausalLM, compiled here (W8A8 FP8 GEMMs with ``act_quant``); or, with
        ``compiled`` (a rank's sharded ``(program, pass_results)``, already filled with its slices), the meta model
        it was compiled from."""
        super().__init__(config, parallelism_config, weight, max_generate_batch_size, fmha_config, py_hw_kernel_config,
                         device_resource_config)
        self.glm5_config: Glm5Config = model.config
        self.dtype = model.dtype
        if compiled is None:
            device = next(model.parameters()).device
            done = compile_model(model, max_tokens=max(model.config.max_position_embeddings, MAX_STEP_TOKENS),
                                 device=device, head="hidden", act_quant=act_quant, inputs_validated=True)
            compiled = done.program, done.results
        self.program: PagedProgram = compiled[0]
        self.pass_results = compiled[1]
        self.device = next(self.program.graph.parameters()).device
        self.max_step_tokens = PREFILL_STEP_TOKENS
        # RTP's layout: latent rows as FP8_KV_CACHE says, indexer keys always FP8 (kv_scale_base)
        self.cache_spec = self.program.cache_spec(kv_cache, "fp8", self.dtype)
        self.caches, self.layout = None, None

    def initialize(self, init_resource) -> bool:
        """Bind RTP's caches; ``kv_cache`` None (RTP's warm-up) leaves the model on private scratch caches."""
        kv = getattr(init_resource, "kv_cache", None)
        if kv is None:
            self.caches, self.layout = None, None
        else:
            self.caches, self.layout = bind_caches(kv, self.cache_spec, self.glm5_config.max_position_embeddings)
        return True

    def prepare_fmha_impl(self, inputs, is_cuda_graph: bool = False) -> StepMetadata:
        attn = inputs.attention_inputs
        if is_cuda_graph:
            if bool(attn.is_prefill):  # RTP's target-verify graphs (speculative decoding) are prefills
                return verify_step(attn, self.layout, self.device)
            return StepMetadata(attn, self.layout, self.device, static=True)
        return StepMetadata(attn, self.layout, self.device, scratch=lambda a: scratch_step(
            a, self.cache_spec, self.device, self.glm5_config.max_position_embeddings))

    def forward(self, inputs, fmha_impl: StepMetadata | None = None):
        impl, ids, caches = step_prologue(self, inputs, fmha_impl)
        with torch.no_grad():
            chunks = self._step_chunks(impl)
            if len(chunks) == 1:
                hidden = self.program(impl.inputs(), ids, caches).hidden
            else:
                hidden = torch.cat([self.program(impl.inputs(rows), ids[rows], caches).hidden for rows in chunks])
        return _rtp_symbol("rtp_llm.ops.compute_ops:PyModelOutputs", "rtp_llm.ops:PyModelOutputs")(hidden)

    def _step_chunks(self, impl: StepMetadata) -> list[slice]:
        """Token-row slices the step runs as, in order. RTP may hand over a prefill of any size (the stand-in's
        8 x 32k prompts: 262144 tokens in one step, whose [tokens, heads, 576] attention tensors pass the
        kernels' int32 offsets and whose indexer logits alone would take 34 GB), so a prefill longer than
        ``max_step_tokens`` runs as consecutive chunks of rows, each behind the cache rows the earlier ones
        wrote, as the Runner's chunked prefill does (every row reads its causal window through its block table
        and position, so the hidden states are the unchunked step's). Prefill returns every row's hidden state
        (``logits_indices`` is the rows in order): each chunk returns the ones among its rows."""
        rows = impl.positions.shape[0]
        if impl.static or rows <= self.max_step_tokens:
            return [slice(0, rows)]
        return [slice(s, min(rows, s + self.max_step_tokens)) for s in range(0, rows, self.max_step_tokens)]


class Fxglm5Glm5(BaseModel):
    """GLM-5 (GlmMoeDsaForCausalLM) through fxglm5: RTP's model factory entry."""

    @classmethod
    def _create_config(cls, ckpt_path):
        model_config = _rtp_symbol("rtp_llm.config.model_config:ModelConfig")()
        return fill_model_config(model_config, Glm5Config.from_json(Path(ckpt_path) / "config.json"), ckpt_path)

    @staticmethod
    def get_weight_cls():
        return no_weight_info_cls()

    def support_cuda_graph(self) -> bool:
        """Block-FP8 checkpoints (GLM-5-FP8): every op of the compiled decoder has a kernel that never syncs with
        the host. A bf16 checkpoint's routed experts run the torch reference MoE, which does (it groups tokens
        by expert on the host), so it must not be captured: ENABLE_CUDA_GRAPH=1 is refused by :meth:`load`."""
        return Glm5Config.from_json(Path(self.model_config.ckpt_path) / "config.json").is_fp8

    def load(self, skip_python_model: bool = False):
        from fxglm5.model.modeling import Glm5ForCausalLM

        model_config = self.model_config
        cfg = Glm5Config.from_json(Path(model_config.ckpt_path) / "config.json")
        # every check reads only the config, the same on every rank: all ranks refuse before any collective
        self.mapping = rtp_mapping(getattr(self, "parallelism_config", None), cfg)
        # RTP's BaseModel.load makes this check; this load replaces it
        if getattr(getattr(self, "hw_kernel_config", None), "enable_cuda_graph", False) and not self.support_cuda_graph():
            raise ConfigError(f"ENABLE_CUDA_GRAPH=1: {model_config.ckpt_path} is not block-FP8; the bf16 checkpoint's "
                              "MoE syncs with the host, so its decode cannot be captured (ENABLE_CUDA_GRAPH=0)")
        if int(getattr(model_config, "max_seq_len", 0) or 0) > cfg.max_position_embeddings:
            raise ConfigError(f"MAX_SEQ_LEN={model_config.max_seq_len} is past the model's max_position_embeddings "
                              f"({cfg.max_position_embeddings})")
        dtype = compute_dtype(model_config)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.compiled, self.act_quant = None, _act_quant()
        if self.mapping.tp == 1:
            self.glm5 = Glm5ForCausalLM.from_pretrained(model_config.ckpt_path, dtype=dtype, device=device,
                                                        progress=False)
            lm_head, embedding, norm = (self.glm5.lm_head.weight, self.glm5.model.embed_tokens.weight,
                                        self.glm5.model.norm.weight)
        else:  # the compile is the load: the rank's graph holds its slices (and the replicated embedding, norm)
            join_rtp_tp_group(self.mapping)
            program, results, self.glm5, lm_head = load_rtp_rank(model_config.ckpt_path, self.mapping, dtype, device,
                                                                 self.act_quant)
            self.compiled = (program, results)
            embedding = graph_weight(program.graph, "model.embed_tokens.weight", "sharded graph")
            norm = graph_weight(program.graph, "model.norm.weight", "sharded graph")
        weights = _rtp_symbol("rtp_llm.model_loader.model_weight_info:ModelWeights",
                              "rtp_llm.utils.model_weight:ModelWeights")(cfg.num_hidden_layers, device, dtype)
        weights.set_global_weight("lm_head", lm_head)  # at tp > 1 the rank's vocab rows: RTP gathers the logits
        weights.set_global_weight("embedding", embedding)
        weights.set_global_weight("final_layernorm.gamma", norm)
        # rpc_engine._start hands model_weights_loader to RTP's HTTP server, which only stores it; RTP's LoRA
        # manager would need its ModelLoader (fxglm5 loads the checkpoint itself: no LoRA)
        self.weight, self.weight_manager, self.py_eplb, self.model_weights_loader = weights, None, None, None
        if not skip_python_model:
            self._create_python_model()

    def _create_python_model(self):
        self.py_model = Fxglm5PyModel(
            self.model_config, getattr(self, "parallelism_config", None), self.weight,
            getattr(self, "max_generate_batch_size", 1), fmha_config=getattr(self, "fmha_config", None),
            py_hw_kernel_config=getattr(self, "hw_kernel_config", None), model=self.glm5,
            kv_cache="fp8" if _fp8_kv_cache(self.model_config) else "bf16", compiled=self.compiled,
            act_quant=self.act_quant)
        return self.py_model


def register():
    """Take ``glm_5`` (and its HF architecture) over from RTP's DeepSeekV2, and register ``fxglm5_glm5``; returns
    RTP's registry module (``fxglm5.rtpllm.models`` then registers the MTP draft types there)."""
    try:  # RTP's own glm_5 is registered on this import; ours must come after it
        importlib.import_module("rtp_llm.models.deepseek_v2")
    except ImportError as err:
        log.warning("fxglm5: rtp_llm.models.deepseek_v2 did not import (%s); registering glm_5 anyway", err)
    factory = importlib.import_module("rtp_llm.model_factory_register")
    factory.register_model(ALIAS, Fxglm5Glm5)
    factory._model_factory[NAME] = Fxglm5Glm5
    factory._hf_architecture_2_ft[ARCHITECTURE] = NAME
    return factory
