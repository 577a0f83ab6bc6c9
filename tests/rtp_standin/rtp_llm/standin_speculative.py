"""Test stand-in of RTP-LLM's MTP speculative decoding around a plugin target and draft model. NOT RTP-LLM code.

Written from rtp-llm 4b8d39cd5 (``cpp/normal_engine/speculative/MtpExecutor.cc``, ``MtpBatchStreamProcessor.cc``,
``model_factory.py``); what a plugin sees, greedily, on one device (eager, or with the CUDA graphs below):

- the draft model: ``create_propose_model_config`` (``model_factory.py:404-482``): sp_type "mtp" (else
  ValueError), a draft checkpoint (none: no draft model at all, so no speculation: ValueError here),
  ``get_model_cls(sp_model_type)._create_config(sp_checkpoint_path)``, the target's ``max_seq_len``, the launch's
  compute dtype; ``from_config`` (``get_sp_model``, ``model_factory.py:112-217``); its own cache with the
  target's block count and block ids (``getMTPModuleGroupedCacheLayerLayout(0)``, ``MtpExecutor.cc:643-645``);
- prefill (``MtpExecutor::prefillStep``, lines 812-1010): the target's prefill, its last rows sampled; the
  draft prefill on the same attention inputs with every request's tokens shifted left by one and the sampled
  token last (``updatePrefillPostDraftModelInput``, ``MtpBatchStreamProcessor.cc:814-867``), ``input_hiddens`` the
  target's hidden rows (``all_hidden_states``); the draft's last rows through its lm_head give d1;
- decode (``decodeStep``, from line 1182): with k > 1 the draft chain (``draftModelDecode``, lines 2174-2372):
  k-1 draft decode steps of one token per request at ``sequence_lengths`` = the committed length (the target's
  decode ``sequence_lengths`` + 1, ``normalDecodePositionToDraftDecodePosition``) and one more per step, its
  ``input_hiddens`` the stream's last draft hidden row, then each step's draft hidden rows
  (``updateDecodeDraftModelInput``, lines 776-812); then the target verify: a prefill of [last token, d1..dk]
  per request behind ``prefix_lengths`` = the target's decode ``sequence_lengths`` with ``is_target_verify``
  (``prepareOneStepSpecDecodeModelInput`` / ``draftModelDecode``), every row scored; greedy acceptance; the
  draft extend (``updateDecodePostDraftModelInput``, lines 1014-1106, the host path): a prefill behind the same
  prefix of each request's accepted tokens (the target's samples at its rows 0..a) with the target's hidden
  rows 0..a, its last row giving the next d1.
With CUDA graphs (the target's ``enable_cuda_graph``): the target's verify steps replay from its target-verify
graphs, the draft chain's decode steps from the draft's decode graphs (``draft_model_``, a ``PyWrappedModel`` of
the draft with ``num_tokens_per_bs`` 1, ``MtpExecutor.cc:716-731``, ``PyWrappedModel.h:305-331``), at the target's
capture sizes, and the draft extend after each verify from the draft-prefill graphs (``sp_prefill_draft_model_``,
``MtpExecutor.cc:732-744``, used by ``runDraftPrefillForward``, lines 1960-1970: ``standin_graph.
DraftPrefillGraphRunner``); the draft prefill after the target's prefill stays eager (``draft_model_``, whose
decode graphs do not run a prefill: ``prefillStep``, lines 945-951). Each wrapper is a ``PyWrappedModel``:
``initialize`` once, and with graphs once more before its capture (``PyWrappedModel.h:237-241, 366-376``).
A draft model's ``get_mtp_target_hidden_states(rows)``, where it has one, replaces its returned rows as the hidden
state carried to the next draft step (``maybeOverrideLastHiddenWithMtpBuffer``, ``MtpExecutor.cc:241-254``;
``PyWrappedModel.cc:111-121``).

Ranks: the draft gets the target's ``parallelism_config`` (``model_factory.py:183-186``); its logits are each
rank's lm_head shard's, all-gathered along the vocabulary as the target's (``Engine._tp_sync_logits``);
:func:`mtp_generate_on_rank` runs an MtpEngine on each rank of ``standin_engine.multi_rank_start``.
Shared weights (``get_sp_model``, ``model_factory.py:173-218``): the draft class's
``speculative_weight_alias_names(target, draft_config)`` names the target's global weights it borrows; the draft is
built with ``weight_alias_owner`` = the target and those names, and each name's tensor must then be the owner's
own (RuntimeError otherwise, as RTP's identity check).
"""

import torch

from rtp_llm.model_factory_register import ensure_model_registered
from rtp_llm.models_py.model_desc.module_base import GptModelBase
from rtp_llm.ops.compute_ops import init_resources
from rtp_llm.standin_cache import allocate_kv_cache
from rtp_llm.standin_engine import Engine, _Request, rank_parallelism_config
from rtp_llm.standin_graph import CudaGraphRunner, DraftPrefillGraphRunner


def verify_step(target, reqs, cached, drafts, *, graphs=True):
    """The target's verify step: each request's last token and its k drafts at positions ``cached[b]`` .. behind
    its cached prefix, replayed from a target-verify graph where one fits (``graphs``), else eager. Returns (the
    hidden rows, each request's k+1 greedy tokens)."""
    q = len(drafts[0]) + 1
    inputs = target._prefill_inputs([[r.tokens[-1]] + d for r, d in zip(reqs, drafts)], cached,
                                    [r.blocks for r in reqs])
    inputs.attention_inputs.is_target_verify = True
    if graphs and target.graph_runner is not None and target.graph_runner.can_run(len(reqs)):
        hidden = target._check_hidden(target.graph_runner.forward(inputs), len(reqs) * q)
        target.graph_replays += 1
    else:
        hidden = target._eager(inputs)
    flat = target._post_layers(hidden)
    return hidden, [flat[b * q:(b + 1) * q] for b in range(len(reqs))]


class MtpEngine:
    """A target :class:`Engine` and its draft model. For tests: ``verify_steps``, ``drafted``, ``accepted`` (drafts
    the target kept), ``proposals``: (the request's tokens so far, the draft model's proposals after them) per
    request and verify step; ``draft_graph`` (the draft's decode graphs, None when eager) and
    ``draft_graph_replays``; ``draft_prefill_graph`` (its draft-prefill graphs) and ``draft_prefill_replays``;
    ``extend_lengths``: each draft extend's ``input_lengths``; ``alias_names``: the weights the draft borrowed.

    ``forced_drafts`` (tests only; RTP has no such thing): prompt (a tuple) -> a continuation; a request with one
    verifies ``continuation[done:done + k]`` in place of the draft model's proposals (which are still computed and
    recorded), so that the accepted counts, and the extend's per-request lengths, vary as the test chooses."""

    def __init__(self, ckpt_path, *, sp_model_type, sp_checkpoint_path=None, sp_type="mtp", gen_num_per_cycle=1,
                 forced_drafts=None, **engine_kwargs):
        if sp_type != "mtp":
            raise ValueError(f"Speculative engine only supports MTP, EAGLE and DSpARK, but got {sp_type}")
        if not sp_checkpoint_path:
            raise ValueError("SP_CHECKPOINT_PATH is not set: RTP builds no draft model (create_propose_model_config)")
        if gen_num_per_cycle < 1:
            raise ValueError(f"gen_num_per_cycle={gen_num_per_cycle}: speculative decoding proposes >= 1 token")
        self.k = gen_num_per_cycle
        self.target = t = Engine(ckpt_path, gen_num_per_cycle=gen_num_per_cycle, **engine_kwargs)
        cls = ensure_model_registered(sp_model_type)  # the packages were imported for the target
        config = cls._create_config(sp_checkpoint_path)
        config.ckpt_path, config.max_seq_len = sp_checkpoint_path, t.max_seq_len
        config.data_type = str(t.config.data_type).split("TYPE_")[-1].lower()
        config.attn_config.kv_cache_dtype = t.config.attn_config.kv_cache_dtype
        config.attn_config.tokens_per_block = t.block_size
        self.draft_config = config
        # get_sp_model (model_factory.py:173-218): the draft class's alias names, the target as their owner (a draft
        # the server launch loaded already, model_factory._LoadedDraft, gives the names its load applied)
        names = getattr(cls, "speculative_weight_alias_names", None)
        self.alias_names = tuple(names(t.model, config)) if names is not None else ()
        alias = dict(weight_alias_owner=t.model, weight_alias_names=self.alias_names) if self.alias_names else {}
        self.draft = cls.from_config(config, t.parallelism_config, t.hw_kernel_config, None, None, None, None,
                                     t.max_generate_batch_size, None, False, None, **alias)
        for name in self.alias_names:
            owner, alias = t.model.weight.get_global_weight(name), self.draft.weight.get_global_weight(name)
            if alias is not owner or alias.data_ptr() != owner.data_ptr():
                raise RuntimeError(f"speculative global weight alias {name!r} did not preserve storage identity")
        self.py_draft = self.draft.py_model
        if not isinstance(self.py_draft, GptModelBase):
            raise TypeError(f"draft model.py_model must be a GptModelBase, got {type(self.py_draft).__name__}")
        self.draft_lm_head = self.draft.weight.global_weights["lm_head"]
        self._draft_lm_head_fp32 = self.draft_lm_head.float()  # held from the load on, as the target's (Engine)
        kbs = t.kernel_block_size if t.kernel_block_size != t.block_size else 0
        self.draft_cache, _ = allocate_kv_cache(config, t.num_blocks, t.block_size, kbs, t.device)
        self._initialize_draft()  # draft_model_'s PyWrappedModel
        self.draft_graph = self.draft_prefill_graph = None
        if t.hw_kernel_config.enable_cuda_graph:
            graph = dict(max_bs=t.max_generate_batch_size, max_seq_len=t.max_seq_len, block_size=t.block_size,
                         kernel_block_size=t.kernel_block_size, hidden_size=config.hidden_size, dtype=t.dtype,
                         device=t.device)
            self._initialize_draft()
            sizes = t.hw_kernel_config.decode_capture_batch_sizes
            self.draft_graph = CudaGraphRunner(self.py_draft, capture_sizes=sizes, **graph)
            self.draft_graph.capture()
            self._initialize_draft()  # sp_prefill_draft_model_: another PyWrappedModel of the same Python model
            self._initialize_draft()
            self.draft_prefill_graph = DraftPrefillGraphRunner(self.py_draft, num_tokens_per_bs=self.k + 1, **graph)
            self.draft_prefill_graph.capture()
        self.forced_drafts = {tuple(p): list(c) for p, c in (forced_drafts or {}).items()}
        self.verify_steps = self.drafted = self.accepted = self.draft_graph_replays = self.draft_prefill_replays = 0
        self.proposals, self.extend_lengths = [], []

    def _initialize_draft(self):
        if self.py_draft.initialize(init_resources(self.draft_cache)) is not True:
            raise RuntimeError("draft py_model.initialize() did not return True")

    # --- the draft model ---------------------------------------------------------------------------------
    def _draft(self, inputs, hidden, extend=False):
        """The draft's returned rows (its lm_head makes their logits) and the hidden rows carried to the next draft
        step. ``extend``: the draft extend after a verify step (``runDraftPrefillForward``: sp_prefill_draft_model_
        where graphs are on)."""
        inputs.input_hiddens = hidden
        rows = inputs.input_ids.shape[0]
        a = inputs.attention_inputs
        if self.draft_graph is not None and not a.is_prefill and self.draft_graph.can_run(rows):
            out = self.target._check_hidden(self.draft_graph.forward(inputs), rows)
            self.draft_graph_replays += 1
        elif extend and self.draft_prefill_graph is not None and self.draft_prefill_graph.can_run(inputs):
            out = self.target._check_hidden(self.draft_prefill_graph.forward(inputs), rows)
            self.draft_prefill_replays += 1
        else:
            impl = self.py_draft.prepare_fmha_impl(inputs, False)
            out = self.target._check_hidden(self.py_draft.forward(inputs, impl).hidden_states, rows)
        carried = out
        if hasattr(self.py_draft, "get_mtp_target_hidden_states"):
            buffered = self.py_draft.get_mtp_target_hidden_states(out.shape[0])
            if buffered is not None and buffered.numel() > 0:
                carried = buffered
        return out, carried

    def _draft_tokens(self, rows):
        """The draft's post-layers: fp32 logits from its lm_head (at tp > 1 the rank's vocabulary shard, gathered as
        the target's), argmax."""
        return self.target._tp_sync_logits(rows.float() @ self._draft_lm_head_fp32.t()).argmax(dim=-1).tolist()

    # --- steps ---------------------------------------------------------------------------------------
    def _prefill(self, reqs):
        t = self.target
        blocks = [r.blocks for r in reqs]
        inputs = t._prefill_inputs([r.prompt for r in reqs], [0] * len(reqs), blocks)
        hidden = t._eager(inputs)
        t.prefill_steps += 1
        last = (inputs.attention_inputs.cu_seqlens[1:] - 1).long()
        sampled = t._post_layers(hidden[last])
        shifted = [r.prompt[1:] + [s] for r, s in zip(reqs, sampled)]
        out, carried = self._draft(t._prefill_inputs(shifted, [0] * len(reqs), blocks), hidden)
        for r, s, d, h in zip(reqs, sampled, self._draft_tokens(out[last]), carried[last]):
            r.tokens.append(s)
            r.next_draft, r.draft_hidden = d, h

    def _chain(self, reqs, cached):
        """k-1 draft decode steps after d1: the drafts of each request."""
        t, drafts = self.target, [[r.next_draft] for r in reqs]
        ids, hidden = [r.next_draft for r in reqs], torch.stack([r.draft_hidden for r in reqs])
        for i in range(self.k - 1):
            inputs = t._decode_inputs(ids, [len(r.prompt) for r in reqs], [c + 1 + i for c in cached],
                                      [r.blocks for r in reqs])
            out, hidden = self._draft(inputs, hidden)
            ids = self._draft_tokens(out)
            for d, token in zip(drafts, ids):
                d.append(token)
        return drafts


    def _extend(self, reqs, cached, emitted, hidden):
        t, q = self.target, self.k + 1
        rows = torch.tensor([b * q + j for b, e in enumerate(emitted) for j in range(len(e))])
        inputs = t._prefill_inputs(emitted, cached, [r.blocks for r in reqs])
        self.extend_lengths.append([len(e) for e in emitted])
        out, carried = self._draft(inputs, hidden[rows.to(hidden.device)], extend=True)
        last = (inputs.attention_inputs.cu_seqlens[1:] - 1).long()
        for r, d, h in zip(reqs, self._draft_tokens(out[last]), carried[last]):
            r.next_draft, r.draft_hidden = d, h

    def _forced(self, req, drafts):
        script = self.forced_drafts.get(tuple(req.prompt))
        if script is None:
            return drafts
        done = len(req.tokens) - len(req.prompt)
        return (script[done:done + self.k] + [0] * self.k)[:self.k]

    def generate(self, prompts, max_new_tokens):
        """Greedy speculative decoding of every prompt; the new tokens of each."""
        t = self.target
        for p in prompts:
            if not p or len(p) + max_new_tokens + self.k > t.max_seq_len:
                raise ValueError(f"prompt of {len(p)} + {max_new_tokens} new tokens + {self.k} drafts exceeds "
                                 "max_seq_len (or is empty)")
        reqs = [_Request(p) for p in prompts]
        try:
            for r in reqs:
                t._grow(r, len(r.prompt))
            self._prefill(reqs)
            while True:
                live = [r for r in reqs if len(r.tokens) - len(r.prompt) < max_new_tokens]
                if not live:
                    break
                cached = [len(r.tokens) - 1 for r in live]
                for r, c in zip(live, cached):
                    t._grow(r, c + self.k + 1)
                drafts = self._chain(live, cached) if self.k > 1 else [[r.next_draft] for r in live]
                self.proposals.extend((list(r.tokens), d) for r, d in zip(live, drafts))
                drafts = [self._forced(r, d) for r, d in zip(live, drafts)]
                hidden, scored = verify_step(t, live, cached, drafts)
                self.verify_steps += 1
                emitted = []
                for d, s in zip(drafts, scored):
                    a = next((j for j in range(self.k) if d[j] != s[j]), self.k)
                    self.drafted, self.accepted = self.drafted + self.k, self.accepted + a
                    emitted.append(s[:a + 1])
                self._extend(live, cached, emitted, hidden)
                for r, e in zip(live, emitted):
                    r.tokens.extend(e[:max_new_tokens - (len(r.tokens) - len(r.prompt))])
        finally:
            for r in reqs:
                t.block_manager.release(r.blocks, [])
        return [r.tokens[len(r.prompt):] for r in reqs]



def mtp_generate_on_rank(world_rank, tp_size, dp_size, ckpt_path, runs):
    """One rank (``standin_engine.multi_rank_start``) of each run in turn: ``dict(engine={Engine kwargs}, sp={MtpEngine
    kwargs}, prompts=[...], new=n)`` (no ``sp``: plain decoding); per run the tokens and, speculative, what the
    draft did (``proposals``, the graphs' keys and replays, the extend lengths, the lm_head shard, the aliases)."""
    out = []
    for run in runs:
        pc = rank_parallelism_config(world_rank, tp_size, dp_size, run.get("ep_size", 0))
        if "sp" not in run:
            engine = Engine(ckpt_path, parallelism_config=pc, **run["engine"])
            out.append(dict(tokens=engine.generate(run["prompts"], run["new"])))
            continue
        mtp = MtpEngine(ckpt_path, parallelism_config=pc, **run["sp"], **run["engine"])
        tokens = mtp.generate(run["prompts"], run["new"])
        graphs = {name: None if g is None else dict(captured=g.captured_sizes, replays=g.replays_by_size)
                  for name, g in (("verify", mtp.target.graph_runner), ("decode", mtp.draft_graph),
                                  ("prefill", mtp.draft_prefill_graph))}
        out.append(dict(tokens=tokens, proposals=mtp.proposals, accepted=mtp.accepted, graphs=graphs,
                        extend_lengths=mtp.extend_lengths, draft_replays=mtp.draft_graph_replays,
                        prefill_replays=mtp.draft_prefill_replays, verify_steps=mtp.verify_steps,
                        lm_head=mtp.draft_lm_head.detach().cpu(), alias_names=mtp.alias_names,
                        prefill_batches=None if mtp.draft_prefill_graph is None else
                        mtp.draft_prefill_graph.replayed_batches))
    return out
