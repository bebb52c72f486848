"""LLMEngine: requests in, one batched step at a time, outputs out.

Each `step()` follows nano-vllm's schedule -> run -> postprocess: `scheduler.schedule()`
picks the batch and launches its rows, `runner.prepare` + `runner.launch` run it on the
device, `scheduler.retire` appends the sampled tokens, detects finishes and frees resources. The scheduler owns every request
transition; the engine wires the calls, turns requests into outputs and counts.

Launch-ahead (`async_scheduling=True`, `_launch_ahead`): with step N in flight, step N+1
is scheduled speculatively (every running request continues) and launched BEFORE N's
bookkeeping, its decode inputs taken from N's samples on the device; N's bookkeeping then
runs while the device computes N+1, and `_reconcile` decides row by row what of N+1 stays
valid. Each request owns two Mamba state copies (`MambaStateAllocator`): a row reads one
and writes the other, retiring it commits the copy it wrote, rejecting it commits nothing
-- an exact restore with no copy traffic.

A step that raises ends the requests it touched with finish_reason "error" and returns
their resources; every other request carries on.
"""
import dataclasses
import gc
import logging
import os
import random
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from cache.kv_cache import KVBlockAllocator
from cache.mamba_cache import MambaStateAllocator
from cache.prefix_cache import PrefixCache
from hybrid_engine.config import DTYPES, EngineConfig, resolve_mamba_ssm_cache_dtype
from hybrid_engine.cuda_graphs import DECODE_OPS, DecodeGraphs
from hybrid_engine.detokenizer import IncrementalDetokenizer
from hybrid_engine.gc_control import StepGarbageCollector
from hybrid_engine.host_memory import available_host_memory
from hybrid_engine.models.embedded import EMBEDDED_CONFIG, EMBEDDED_MODEL_NAME, EMBEDDED_WEIGHT_SEED
from hybrid_engine.models.base import PoolShape
from hybrid_engine.models.config import parse_hf_config
from hybrid_engine.models.loader import load_model, read_config
from hybrid_engine.models.tensor_parallel import validate_tensor_parallel
from hybrid_engine.models.presets import get_preset
from hybrid_engine.parallel.channel import StepSender
from hybrid_engine.parallel.group import TensorParallelGroup
from hybrid_engine.prompts import RequestLimits, validate_request
from hybrid_engine.request import Request, RequestOutput, RequestStatus
from hybrid_engine.runner import ModelRunner
from hybrid_engine.sampling import derive_seed
from hybrid_engine.sampling_params import ParameterError, SamplingParams
from hybrid_engine.scheduler import RetiredStep, Scheduler, SchedulerOutput
from hybrid_engine.spec.draft_model import DRAFT_CHECKPOINTS_PER_SEQ, DraftModel, draft_engine_config
from hybrid_engine.spec.drafter import Drafter
from hybrid_engine.step import StepHandle, StepSamples
from hybrid_engine.structured.grammar import GrammarCompiler, GrammarState
from hybrid_engine.structured.vocabulary import TokenVocabulary
from hybrid_engine.tokenizer import build_byte_tokenizer, load_tokenizer
from layers.kernels import select_ops
from layers.kernels.reference.ssd import clamps_dt
from layers.parallel import SINGLE, ParallelContext

logger = logging.getLogger(__name__)

PRESET_PREFIX = "preset:"


@dataclass(frozen=True)
class PoolBytes:
    """Device bytes of a model's pools: the Mamba state copies one request owns, one state
    copy (a checkpoint slot), one KV block."""

    per_seq: int
    per_slot: int
    per_block: int


@dataclass
class LoadedModel:
    """A model's weights on the device, with its HF config, tokenizer and display name."""

    model: Any
    hf_config: dict
    tokenizer: Any
    name: str


def release_cached_memory() -> None:
    """Hand the CUDA memory no live tensor uses back to the driver: unreachable objects (an
    earlier engine in this process, say) are collected, then the caching allocator's free
    blocks released."""
    gc.collect()
    torch.cuda.empty_cache()


def load_engine_model(cfg: EngineConfig, kernels: Any, tp: ParallelContext = SINGLE) -> LoadedModel:
    """Load the model `cfg.model` names (None: the embedded one; "preset:NAME"; a checkpoint
    directory) with the kernels `kernels` (`layers.kernels.select_ops`); under tensor
    parallelism, this rank's shard of it (`tp`)."""
    hf_config, path, tokenizer, name, weight_seed = _resolve_model(cfg)
    if torch.device(cfg.device).type == "cuda":
        # A weight placed inside a cached block of dropped tensors (an earlier engine's KV
        # cache, say) would keep all of that block reserved, and the pools sized after
        # loading would lose it (1.2 GiB measured).
        release_cached_memory()
    model = load_model(hf_config, path, torch.device(cfg.device), cfg.torch_dtype, cfg.load_format, weight_seed,
                       ops=kernels, tp=tp)
    return LoadedModel(model, hf_config, tokenizer, name)


def check_max_model_len(cfg: EngineConfig) -> None:
    """Raise ValueError if `cfg.max_model_len` is past the model's max_position_embeddings
    (as vLLM refuses it, instead of cutting it silently). Reads only config files: run
    before anything is loaded."""
    if cfg.max_model_len is None:
        return
    limit = parse_hf_config(_hf_config(cfg)).max_position_embeddings
    if cfg.max_model_len > limit:
        raise ValueError(f"max_model_len ({cfg.max_model_len}) is greater than the model's max_position_embeddings "
                         f"({limit})")


def check_tensor_parallel(cfg: EngineConfig) -> None:
    """Raise ValueError (naming the config field and the sizes that work) if the model --
    or the draft model -- cannot be split `cfg.tensor_parallel_size` ways. Reads only
    config files: run before any worker process starts."""
    spec = cfg.speculative_config
    checks = [("", cfg)]
    if spec is not None and spec.method == "draft_model":
        checks.append(("speculative_config.model: ", draft_engine_config(cfg, spec)))
    for prefix, model_cfg in checks:
        try:
            validate_tensor_parallel(parse_hf_config(_hf_config(model_cfg)), cfg.tensor_parallel_size,
                                     cfg.enable_expert_parallel)
        except ValueError as error:
            raise ValueError(f"{prefix}{error}") from None


def _hf_config(cfg: EngineConfig) -> dict:
    """The HF config dict of the model `cfg.model` names (config files only: no weights,
    no tokenizer)."""
    if cfg.model is None:
        return EMBEDDED_CONFIG
    if cfg.model.startswith(PRESET_PREFIX):
        return get_preset(cfg.model[len(PRESET_PREFIX):])
    if not os.path.isdir(cfg.model):
        raise ValueError(f"model must be None, 'preset:NAME' or a checkpoint directory; {cfg.model!r} is not a directory")
    return read_config(cfg.model)


def _resolve_model(cfg: EngineConfig) -> tuple[dict, str | None, Any, str, int]:
    """(hf config dict, weights path or None, tokenizer or None, display name, weight seed)."""
    hf_config = _hf_config(cfg)
    if cfg.model is None:
        return hf_config, None, build_byte_tokenizer(), EMBEDDED_MODEL_NAME, EMBEDDED_WEIGHT_SEED
    if cfg.model.startswith(PRESET_PREFIX):
        if cfg.load_format != "dummy":
            logger.info("preset %s has no weights on disk: using load_format='dummy'", cfg.model[len(PRESET_PREFIX):])
        return hf_config, None, None, cfg.model, cfg.seed
    path = None if cfg.load_format == "dummy" else cfg.model
    return hf_config, path, load_tokenizer(cfg.model), cfg.model, cfg.seed


class LLMEngine:
    """Continuous-batching engine over a paged KV cache and a Mamba state slot pool."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 group: TensorParallelGroup | None = None, engine_id: int = 0):
        """`loaded`: the model, already on the device (a draft engine's); else loaded here.

        Tensor parallelism: with `tensor_parallel_size` > 1 and no `group`, this engine is
        the driver: it starts the worker processes (`TensorParallelGroup.start`) and stops
        them at `shutdown()` or when it is garbage-collected. A worker builds its engine with
        the group it joined; a draft engine gets its target's group and `engine_id` 1.
        """
        self._user_max_num_seqs = config.max_num_seqs is not None
        cfg = config.resolve()
        if loaded is None:
            check_max_model_len(cfg)
        self.group, self._finalizer, self.dead = group, None, None
        if group is None and cfg.tensor_parallel_size > 1:
            check_tensor_parallel(cfg)
            group = self.group = TensorParallelGroup.start(cfg.tensor_parallel_size, cfg.enable_expert_parallel,
                                                           cfg.device)
            sender = StepSender(group, engine_id)
            self._finalizer = weakref.finalize(self, group.shutdown, sender.send_stop)
            cfg = dataclasses.replace(cfg, device=str(group.device))
            try:
                # The config as given (each rank resolves its defaults the same way), with
                # the speculative config resolved: a caller's proposer object stays here,
                # workers never draft.
                spec = cfg.speculative_config
                group.send_object(dataclasses.replace(
                    config, device=cfg.device,
                    speculative_config=None if spec is None else dataclasses.replace(spec, proposer=None)))
                self._build(cfg, loaded, sender, engine_id)
                group.confirm_started()
            except Exception as error:
                group.broken = "start-up failed"
                # A configuration error is the driver's own (each rank would hit it): as it is.
                startup = error if isinstance(error, ValueError) else group.startup_error(error)
                self._finalizer()
                raise startup from (None if startup is error else error)
            except BaseException:
                group.broken = "start-up interrupted"
                self._finalizer()
                raise
        else:
            sender = StepSender(group, engine_id) if group is not None and group.is_driver else None
            self._build(cfg, loaded, sender, engine_id)

    def _build(self, cfg: EngineConfig, loaded: LoadedModel | None, sender: StepSender | None,
               engine_id: int) -> None:
        """Model, pools, scheduler, runner and graphs (`__init__`'s body)."""
        group = self.group
        tp = SINGLE if group is None else group.context
        self.config = cfg
        self.device = torch.device(cfg.device)
        self.kernels = select_ops(self.device)
        if loaded is None:
            loaded = load_engine_model(cfg, self.kernels, tp)
        self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        self.config = cfg = dataclasses.replace(
            cfg, mamba_ssm_cache_dtype=resolve_mamba_ssm_cache_dtype(cfg.mamba_ssm_cache_dtype, loaded.hf_config))
        mc = self.model_config = self.model.config
        # (Only a draft engine can be asked for more than its model's positions, its
        # target's context: it proposes up to its own, as vLLM's draft models do.)
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer is not None and self.tokenizer.eos_token_id is not None
            else set()
        )
        spec = cfg.speculative_config
        max_drafts = 0 if spec is None else spec.num_speculative_tokens
        # Launch-ahead keeps the committed state while a row writes its successor (two
        # banks, ping-pong); a verify row writes the state after each of its positions.
        self.state_banks, self.state_positions = (2 if cfg.async_scheduling else 1), 1 + max_drafts
        draft = None
        if spec is not None and spec.method == "draft_model":
            # Its weights are loaded first: the pools below are sized in what is left.
            draft_config = draft_engine_config(cfg, spec)
            try:
                draft = load_engine_model(draft_config, self.kernels, tp)
            except ValueError as error:
                raise ValueError(f"speculative_config.model: {error}") from error
            if draft.model.config.vocab_size != mc.vocab_size:
                raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of "
                                 f"{draft.model.config.vocab_size} tokens; the target's has {mc.vocab_size}")
        max_num_seqs, num_blocks, checkpoint_slots = self._size_pools(
            None if draft is None else self._pool_bytes(
                draft.model.pool_shape(), draft.model.config.conv_kernel - 1,
                resolve_mamba_ssm_cache_dtype(draft_config.mamba_ssm_cache_dtype, draft.hf_config), self.state_banks))
        shape = self.model.pool_shape()  # this rank's share under tensor parallelism
        self.kv = KVBlockAllocator(num_blocks, cfg.kv_block_size, shape.num_attention_layers, shape.num_kv_heads,
                                   shape.head_dim, cfg.torch_dtype, self.device)
        self.limits = RequestLimits(vocab_size=mc.vocab_size, max_model_len=self.max_model_len,
                                    kv_tokens=self.kv.num_blocks * cfg.kv_block_size)
        self.mamba = MambaStateAllocator(max_num_seqs, shape.num_mamba_layers, shape.mamba_conv_dim,
                                         mc.conv_kernel - 1, shape.mamba_num_heads, shape.mamba_head_dim,
                                         shape.ssm_state_size, cfg.torch_dtype, self.device, banks=self.state_banks,
                                         row_positions=self.state_positions,
                                         ssm_dtype=DTYPES[cfg.mamba_ssm_cache_dtype], checkpoint_slots=checkpoint_slots)
        self.draft_engine = None
        if draft is not None:
            # As many requests and KV blocks as the target (the draft's own bytes were
            # counted in each), and the checkpoints its proposals resume from.
            self.draft_engine = LLMEngine(dataclasses.replace(
                draft_config, max_num_seqs=max_num_seqs, num_kv_blocks=num_blocks,
                prefix_cache_max_checkpoints=DRAFT_CHECKPOINTS_PER_SEQ * max_num_seqs), loaded=draft,
                group=group, engine_id=1)
        self.drafter = None if spec is None else Drafter(
            spec, mc.vocab_size, None if draft is None else DraftModel(self.draft_engine))
        self.prefix_cache = None
        if cfg.enable_prefix_caching:
            self.prefix_cache = PrefixCache(self.kv, self.mamba, cfg.prefix_cache_checkpoint_interval)
        self.scheduler = Scheduler(self.kv, self.mamba, cfg.max_num_batched_tokens, self.max_model_len, self.drafter,
                                   self.prefix_cache)
        # Exactness of the prefix cache (docs/cache.md): where the model's prefill clamps dt
        # (the prompt-only dt limit), what a request computed for its generated tokens is
        # cached only if no such dt was out of the limit. The draft engine (engine_id 1)
        # does not check: its cached states only shape drafts, which verification checks.
        # Under tensor parallelism each rank holds some heads only, so the driver assumes
        # every row that computed a generated token was out of the limit (only prompt
        # content is cached).
        checks = (self.prefix_cache is not None and engine_id == 0
                  and any(clamps_dt(m.dt_limit) for m in self.model.mamba_mixers()))
        self._assume_dt_limit_hits = checks and tp.world_size > 1
        self.runner = ModelRunner(self.model, self.kv, self.mamba, cfg.max_num_batched_tokens, self.max_model_len,
                                  self.device, max_drafts, sender=sender,
                                  follower=group is not None and not group.is_driver,
                                  check_dt_limit=checks and tp.world_size == 1)
        if cfg.cuda_graphs:
            self._capture_graphs(max_num_seqs)
        self.requests: dict[str, Request] = {}  # accepted requests whose final output is not out yet
        self._aborted: list[Request] = []  # their final outputs go out with the next step's
        self._undelivered: list[RequestOutput] = []  # an interrupted step's outputs: out with the next step's
        self._gc = StepGarbageCollector()
        self._seed_counter = 0
        self._grammars: GrammarCompiler | None = None  # structured outputs (`_grammar_compiler`)
        self._inflight: StepHandle | None = None  # launched, not yet retired (kept across step calls)
        self._unretired: list[SchedulerOutput] = []  # scheduled steps whose rows have not retired
        self._rejector = random.Random(cfg.seed)  # inject_rejection_rate draws, deterministic
        self._counters = dict(steps=0, launch_ahead_steps=0, rejected_launches=0, state_restores=0,
                              prefill_tokens=0, decode_tokens=0, spec_steps=0, spec_proposed_tokens=0,
                              spec_accepted_tokens=0)
        logger.info(
            "engine ready: model=%s device=%s dtype=%s mamba_ssm_cache_dtype=%s kernels=%s capacity: %d concurrent "
            "requests, %d KV tokens (%d blocks x %d), prefix caching %s (%d state checkpoints)", self.model_name,
            self.device, cfg.dtype, cfg.mamba_ssm_cache_dtype, self.kernels.name, max_num_seqs,
            num_blocks * cfg.kv_block_size, num_blocks, cfg.kv_block_size,
            "on" if cfg.enable_prefix_caching else "off", checkpoint_slots,
        )
        if group is not None and group.is_driver and engine_id == 0:
            logger.info("tensor parallel: %d ranks%s, this process is rank 0 (the driver)", group.world_size,
                        ", experts split whole (expert parallel)" if cfg.enable_expert_parallel else "")

    def _capture_graphs(self, max_num_seqs: int) -> None:
        """Capture decode CUDA graphs when every decode op is a sync-free fast kernel."""
        slow = [op for op in DECODE_OPS if "reference" in self.kernels.describe()[op]]
        if slow:
            logger.warning("CUDA graphs disabled: decode ops %s have no fast kernel here", slow)
            return
        graphs = DecodeGraphs(max_num_seqs, self.runner.max_width)
        if self.group is not None:
            self.group.graphs.append(graphs)  # (destroyed before the communicators: `shutdown`)
        graphs.capture(self.runner)
        self.runner.graphs = graphs
        self.runner.buffer.num_syncs = 0  # capture's own copies are not steps

    # ---- sizing ----------------------------------------------------------------------
    def _pool_bytes(self, shape: PoolShape, conv_width: int, ssm_cache_dtype: str, banks: int,
                    positions: int = 1) -> PoolBytes:
        """What a model's pools cost on this rank (`shape`: `model.pool_shape()`), with this
        engine's dtype and KV block size (`ssm_cache_dtype`: a resolved `mamba_ssm_cache_dtype`)."""
        cfg = self.config
        slot = MambaStateAllocator.bytes_per_seq(shape.num_mamba_layers, shape.mamba_conv_dim, conv_width,
                                                 shape.mamba_num_heads, shape.mamba_head_dim, shape.ssm_state_size,
                                                 cfg.torch_dtype, copies_per_request=1,
                                                 ssm_dtype=DTYPES[ssm_cache_dtype])
        block = KVBlockAllocator.bytes_per_block(cfg.kv_block_size, max(shape.num_attention_layers, 1),
                                                 shape.num_kv_heads, shape.head_dim, cfg.torch_dtype)
        return PoolBytes(per_seq=slot * banks * positions, per_slot=slot, per_block=block)

    def _size_pools(self, draft: PoolBytes | None = None) -> tuple[int, int, int]:
        """(max_num_seqs, num_kv_blocks, prefix-cache checkpoint slots): given values win;
        on CUDA the rest fills memory; elsewhere pools that do not fit in the host memory
        available are an error.

        A default `max_num_seqs` shrinks until its Mamba state takes at most half of what
        is left after weights and activations; default checkpoints (2 per max_num_seqs)
        take at most a quarter; the rest is KV cache. An explicit size that does not fit
        is an error. A draft model (`draft`: its pools' bytes) gets as many requests and KV
        blocks as the target, plus its proposals' checkpoints: each request and each block
        costs both models' bytes.
        """
        cfg, mc = self.config, self.model_config
        max_num_seqs = cfg.max_num_seqs
        tokens_needed = max_num_seqs * self.max_model_len
        checkpoints = 0
        if cfg.enable_prefix_caching:
            checkpoints = cfg.prefix_cache_max_checkpoints
            if checkpoints is None:
                checkpoints = 2 * max_num_seqs
        own = self._pool_bytes(self.model.pool_shape(), mc.conv_kernel - 1, cfg.mamba_ssm_cache_dtype,
                               self.state_banks, self.state_positions)
        seq_bytes, slot_bytes, block_bytes = own.per_seq, own.per_slot, own.per_block
        if draft is not None:
            seq_bytes += draft.per_seq + DRAFT_CHECKPOINTS_PER_SEQ * draft.per_slot
            block_bytes += draft.per_block
        if self.device.type != "cuda":
            # Sized as asked; pools that cannot fit are a start-up error naming the flags,
            # not an allocator failure halfway through building the engine.
            num_blocks = cfg.num_kv_blocks or -(-tokens_needed // cfg.kv_block_size)
            need = max_num_seqs * seq_bytes + checkpoints * slot_bytes + num_blocks * block_bytes
            available = available_host_memory()
            if available is not None and need > available:
                raise ValueError(
                    f"not enough host memory for {max_num_seqs} Mamba state slots ({seq_bytes / 2**20:.2f} MiB each), "
                    f"{checkpoints} prefix-cache checkpoints ({slot_bytes / 2**20:.2f} MiB each) and {num_blocks} KV "
                    f"blocks ({block_bytes / 2**10:.0f} KiB each): {need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB "
                    f"available: lower max_num_seqs, max_model_len, num_kv_blocks or prefix_cache_max_checkpoints")
            return max_num_seqs, num_blocks, checkpoints
        release_cached_memory()  # memory no live tensor uses counts as free
        free, total = torch.cuda.mem_get_info(self.device)
        if self.group is not None:  # pools of the same size on every rank: the tightest one decides
            free = self.group.min_over_ranks(free)
        budget = free - (1.0 - cfg.gpu_memory_utilization) * total
        # Activations of the largest step plus sampling scratch: a generous estimate.
        width = max(mc.hidden_size * 4, mc.mamba_d_ssm * 2 + mc.mamba_conv_dim, mc.intermediate_size,
                    mc.moe_intermediate_size * max(mc.top_k, 1))
        # (a verify step samples every position of its rows: K+1 rows of logits each)
        sampled_rows = max_num_seqs * self.state_positions
        reserve = cfg.max_num_batched_tokens * width * 4 * 6 + sampled_rows * mc.vocab_size * 4 * 8 + (1 << 30)
        left = budget - reserve
        if not self._user_max_num_seqs and max_num_seqs * seq_bytes > left / 2:
            max_num_seqs = max(1, int(left / 2 // seq_bytes))
            tokens_needed = max_num_seqs * self.max_model_len
            logger.info("max_num_seqs lowered to %d so Mamba state (%.1f MiB per request) fits", max_num_seqs,
                        seq_bytes / 2**20)
        if cfg.enable_prefix_caching and cfg.prefix_cache_max_checkpoints is None:
            # A quarter at most, and never what the requests' states and the KV floor need.
            spare = min(left / 4, left - max_num_seqs * seq_bytes - block_bytes * self.kv_blocks_floor())
            checkpoints = min(2 * max_num_seqs, max(0, int(spare // slot_bytes)))
        if cfg.num_kv_blocks is not None:
            return max_num_seqs, cfg.num_kv_blocks, checkpoints
        left -= max_num_seqs * seq_bytes + checkpoints * slot_bytes
        if left < block_bytes * self.kv_blocks_floor():
            raise ValueError(
                f"not enough GPU memory for {max_num_seqs} Mamba state slots ({seq_bytes / 2**20:.1f} MiB each), "
                f"{checkpoints} prefix-cache checkpoints ({slot_bytes / 2**20:.1f} MiB each) and the KV cache: lower "
                f"max_num_seqs or prefix_cache_max_checkpoints, or raise gpu_memory_utilization"
            )
        return max_num_seqs, min(int(left // block_bytes), -(-tokens_needed // cfg.kv_block_size)), checkpoints

    def kv_blocks_floor(self) -> int:
        """Fewest KV blocks worth running with: one full-length request."""
        return -(-self.max_model_len // self.config.kv_block_size)

    # ---- requests --------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | dict | None = None) -> None:
        """Queue a request; invalid input raises ValueError naming the field and changes nothing."""
        self.add_requests([(request_id, prompt, params)])

    def add_requests(self, requests: Sequence[tuple[str, str | list[int], SamplingParams | dict | None]]) -> None:
        """Queue several (request_id, prompt, params) requests all or nothing: every one is
        validated first, and if any is invalid a ValueError names it and none is queued."""
        self._check_alive()
        new: dict[str, Request] = {}
        seed_counter = self._seed_counter
        for request_id, prompt, params in requests:
            if not isinstance(request_id, str) or not request_id:
                raise ValueError("request_id must be a non-empty string")
            if request_id in self.requests or request_id in new:
                raise ValueError(f"request_id {request_id!r} is already in use")
            request = self._make_request(request_id, prompt, params, derive_seed(self.config.seed, seed_counter))
            seed_counter += request.params.seed is None
            new[request_id] = request
        self._seed_counter = seed_counter
        for request in new.values():
            self.requests[request.request_id] = request
            self.scheduler.add(request)

    def _make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | dict | None,
                      derived_seed: int) -> Request:
        """A validated request (nothing queued); `derived_seed` is its seed unless params set one."""
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif isinstance(params, SamplingParams):
            params = dataclasses.replace(params)  # re-validated, and the caller's later edits don't reach it
        else:
            raise ValueError(f"params must be SamplingParams or a dict, got {type(params).__name__}")
        ids = validate_request(prompt, params, self.limits, self.tokenizer)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                           stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        seed = derived_seed if params.seed is None else params.seed
        text = prompt if isinstance(prompt, str) else None
        return Request(request_id, text, ids, params, seed, self._stop_ids(params), detok,
                       grammar=self.start_grammar(params))

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The EOS ids that end a request (none with `ignore_eos`)."""
        return frozenset() if params.ignore_eos else self.eos_token_ids

    def start_grammar(self, params: SamplingParams) -> GrammarState | None:
        """A request's place in its grammar before its first token (structured outputs;
        None without). ParameterError naming the field where the grammar cannot be compiled
        or started on this model's vocabulary (the server checks this at admission)."""
        if params.structured_outputs is None:
            return None
        return self._grammar_compiler().start(params.structured_outputs, self._stop_ids(params))

    def _grammar_compiler(self) -> GrammarCompiler:
        """The compiler of structured-output grammars over this model's vocabulary, made at
        the first request that needs one (reading the vocabulary takes a moment)."""
        if self.tokenizer is None:
            raise ParameterError("structured_outputs", "structured_outputs: structured outputs need a tokenizer; "
                                                       "this model has none")
        if self._grammars is None:
            self._grammars = GrammarCompiler(TokenVocabulary.of_tokenizer(self.tokenizer, self.model_config.vocab_size,
                                                             self.eos_token_ids))
        return self._grammars

    def enqueue(self, request: Request) -> None:
        """Queue a request built by the caller, as it is: no validation, no detokenizer
        (a draft model's proposal, spec/draft_model.py: its tokens come from a validated
        request, and it may arrive with output already generated). Its id must be unused."""
        self._check_alive()
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> None:
        """Finish a request with reason 'abort' (its final output comes from the next step)."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return
        self.scheduler.finish(request, "abort")
        self._aborted.append(request)

    def has_unfinished_requests(self) -> bool:
        """Whether some accepted request has not had its final output yet."""
        return bool(self.requests or self._undelivered)

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batched step; returns the outputs of the requests that advanced or ended.

        If the step raises, the requests it touched end with finish_reason "error" (their
        final outputs are returned here), their resources return to the pools, and the
        engine keeps serving the others. An interrupt (KeyboardInterrupt: Ctrl-C in
        `LLM.generate`) leaves a step as half done as an error does: it ends them the same
        way, then goes on up; their outputs come with the next step's.
        """
        self._gc.busy()
        try:
            try:
                stepped = self._step()
            except BaseException as error:
                broken = self.group is not None and self.group.broken is not None
                stepped = self._fail_all(self.group.broken) if broken else self._fail_step(error)
                if not isinstance(error, Exception):
                    self._undelivered += stepped  # (aborted requests' outputs wait in `_aborted`)
                    raise
        except BaseException:
            self._gc.idle()
            raise
        outputs = self._undelivered + [self._emit(r) for r in self._aborted] + stepped
        self._undelivered = []
        self._aborted.clear()
        if not self.requests:
            self._gc.idle()
        return outputs

    def _step(self) -> list[RequestOutput]:
        """schedule -> launch -> (launch ahead) -> retire."""
        current = self._inflight
        if current is None:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return []
            current = self._inflight = self._launch(sched, prev=None)
        ahead = self._launch_ahead(current) if self.config.async_scheduling else None
        self._gc.collect_in_slack()  # the device has `current` (and `ahead`) queued
        retired = self._retire(current, self._samples(current))
        self._inflight = self._reconcile(ahead, retired) if ahead is not None else None
        return [self._emit(r) for r in retired.advanced]

    def _launch(self, sched: SchedulerOutput, prev: StepHandle | None) -> StepHandle:
        """Run a scheduled step on the device (samples come back asynchronously)."""
        self._unretired.append(sched)
        plan = self.runner.prepare(sched, prev)
        self._counters["steps"] += 1
        prefill_tokens = sum(c.num_tokens for c in sched.prefills)
        self._counters["decode_tokens"] += sched.num_tokens - prefill_tokens  # verify rows' drafts included
        self._counters["prefill_tokens"] += prefill_tokens
        try:
            return self.runner.launch(plan)
        except BaseException as error:  # (an interrupt too: the other ranks wait for the rest)
            if self.group is not None:  # the other ranks launched it: they are out of step now
                self.group.mark_broken(error)
            raise

    def _launch_ahead(self, current: StepHandle) -> StepHandle | None:
        """Schedule and launch step N+1 while step N (`current`) is in flight, as if every
        running request continues; `_reconcile` later drops what N's bookkeeping refutes.
        Nothing is evicted while a step is in flight: if no work fits, the next call
        schedules from retired state (where eviction is allowed)."""
        sched = self.scheduler.schedule(allow_evict=False)
        if sched.is_empty:
            return None
        self._counters["launch_ahead_steps"] += 1
        return self._launch(sched, prev=current)

    def _samples(self, handle: StepHandle) -> StepSamples:
        """Wait for a launched step's samples. Under tensor parallelism the group's health
        is checked after the wait: the samples of a step that ran beside a dead rank are
        garbage (parallel/group.py)."""
        samples = handle.wait()
        if self.group is not None:
            self.group.check_workers()
        return samples

    def _retire(self, handle: StepHandle, samples: StepSamples) -> RetiredStep:
        """Hand a step's samples (`_samples`) to the scheduler's bookkeeping."""
        hits = samples.dt_limit_hits
        if self._assume_dt_limit_hits:  # (tensor parallel: every row that computed a generated token)
            hits = [c.start + c.num_tokens > len(c.request.prompt_token_ids) for c in handle.chunks]
        retired = self.scheduler.retire(handle.chunks, handle.valid, samples.token_ids, samples.logprobs,
                                        samples.verified, hits)
        self._unretired.remove(handle.sched)
        if retired.num_dropped:
            self._counters["rejected_launches"] += 1
        if retired.num_proposed:
            self._counters["spec_steps"] += 1
            self._counters["spec_proposed_tokens"] += retired.num_proposed
            self._counters["spec_accepted_tokens"] += retired.num_accepted
        return retired

    def _reconcile(self, ahead: StepHandle, retired: RetiredStep) -> StepHandle | None:
        """After step N's bookkeeping, keep what is still valid of the launched step N+1.

        Row by row:
        - request finished at N (length, EOS, stop token, stop string, error): the row is
          dropped; its blocks and state are released when the row retires.
        - request whose verify row at N rejected a draft: the row was launched on top of
          the rejected drafts; it is rejected like an injected rejection (below).
        - request aborted or paused or evicted: cannot have a row here -- aborts happen
          between steps (an aborted request is never scheduled), pauses are decided before
          a launch, and eviction never touches a request in flight.
        - new arrivals: admitted by the next `schedule`, never discarding these rows.
        - injected rejection (`inject_rejection_rate`, a test knob): every row is rejected
          (`Scheduler.reject` rolls its launch cursors back; the state copy it wrote is
          never committed, so the committed state is restored exactly). The step is
          drained before its rows' resources can be reused.
        When every row is rejected, the next step is launched (from the rolled-back cursors)
        before the rejected one is drained, so the device never waits for the host there.
        """
        rate = self.config.inject_rejection_rate
        rejected = False
        chunks, valid = ahead.chunks, ahead.valid
        if rate > 0 and self._rejector.random() < rate:
            for i, chunk in enumerate(chunks):
                valid[i], rejected = False, True
                if not chunk.request.finished:
                    self.scheduler.reject(chunk)
                    self._counters["state_restores"] += 1
        else:
            for request in retired.finished + retired.mispredicted:
                row = request.launch_row
                if row < len(chunks) and chunks[row].request is request and valid[row]:
                    valid[row], rejected = False, True
                    if not request.finished:
                        self.scheduler.reject(chunks[row])
        if rejected:
            self._counters["rejected_launches"] += 1
        if not any(valid):
            following = self._launch_ahead(ahead)
            self._retire(ahead, self._samples(ahead))
            return following
        return ahead

    def _fail_step(self, error: BaseException) -> list[RequestOutput]:
        """The step raised: end every request with a row in an unretired step (or a launch
        under way) with reason "error", release their resources, and start afresh. An
        error that touched no request (e.g. in scheduling) is the engine's own: re-raised."""
        touched = [c.request for sched in self._unretired for c in sched.chunks]
        touched += [r for r in self.scheduler.running if r.inflight]
        if not touched:
            raise error
        logger.exception("engine step failed; ending the requests it touched")
        return self._end_with_error(touched, f"engine step failed: {type(error).__name__}: {error}")

    def _end_with_error(self, requests: list[Request], message: str) -> list[RequestOutput]:
        """End `requests` with reason "error" (resources released), drop the steps in
        flight, and return their outputs plus those of requests that finished earlier in
        this step (not out yet when it raised; aborted ones go out with the step's)."""
        failed = self.scheduler.fail(requests, message)
        self._unretired.clear()
        self._inflight = None
        aborted = set(map(id, self._aborted))
        done = [r for r in self.requests.values() if r.finished and id(r) not in aborted and r not in failed]
        return [self._emit(r) for r in failed + done]

    def _fail_all(self, reason: str) -> list[RequestOutput]:
        """The tensor-parallel group broke (a worker died, a collective failed): every
        request ends with reason "error", the workers are stopped, and the engine takes no
        more requests (`dead`)."""
        logger.error("tensor-parallel group broke: %s; ending every request", reason)
        self.dead = reason
        if self._finalizer is not None:
            self._finalizer()
        return self._end_with_error([r for r in self.requests.values() if not r.finished], f"engine failed: {reason}")

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise RuntimeError(f"the engine is dead and takes no requests: {self.dead}")

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and free the process group (idempotent; also
        done when the engine is garbage-collected). A single-process engine has nothing
        to stop."""
        if self._finalizer is not None:
            self._finalizer()
            self.dead = self.dead or "shut down"

    def device_op_targets(self) -> dict[str, Any]:
        """The objects a tensor-parallel worker replays the driver's device operations on
        (`parallel.channel.DeviceOpLog`), by the names the driver records them under."""
        return {"mamba": self.mamba, "kv": self.kv, "runner": self.runner}

    def _emit(self, request: Request) -> RequestOutput:
        """The request's output for the caller; a finished request leaves the engine."""
        if request.finished:
            self.requests.pop(request.request_id, None)
        return request.make_output()

    # ---- introspection ---------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters and pool occupancy: steps, launch_ahead_steps, rejected_launches, state_restores,
        pauses, evictions, prefill_tokens, decode_tokens, h2d_copies, queue and pool sizes.
        `free_mamba_slots` / `total_mamba_slots` count requests the Mamba pool can admit
        (each takes one row and its ring of state copies). Prefix caching:
        `prefix_cache_queries` (tokens looked up at admission: the prompt, plus the tokens
        generated before an eviction for a recomputed request), `prefix_cache_hits` (of
        those, tokens resumed from the cache), `prefix_cache_dt_limited_requests` (requests
        whose generated tokens the cache did not take, from the first one with a dt outside
        the model's prompt-only limit: docs/cache.md, "Exactness"), `prefix_cache_checkpoints`
        (state checkpoints held), `cached_kv_blocks` (blocks only the cache holds; counted free)."""
        s = self.scheduler
        return {
            **self._counters,
            "pauses": s.num_pauses,
            "evictions": s.num_evictions,
            "h2d_copies": self.runner.buffer.num_syncs,
            "running": sum(r.status is RequestStatus.RUNNING for r in s.running),
            "paused": len(s.paused),
            "waiting": len(s.waiting),
            "free_kv_blocks": self.kv.num_free,
            "total_kv_blocks": self.kv.num_blocks,
            "free_mamba_slots": self.mamba.num_free,
            "total_mamba_slots": self.mamba.max_num_seqs,
            "prefix_cache_queries": s.num_cache_queries,
            "prefix_cache_hits": s.num_cache_hits,
            "prefix_cache_dt_limited_requests": s.num_dt_limited,
            "prefix_cache_checkpoints": 0 if self.prefix_cache is None else self.prefix_cache.num_checkpoints,
            "cached_kv_blocks": self.kv.num_cached,
        }
