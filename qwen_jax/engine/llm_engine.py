"""LLMEngine: the synchronous engine loop (add requests, step, collect outputs) over scheduler + runner, with
model loading and memory sizing at start-up.

One thread drives it (the offline LLM directly, AsyncLLM from its loop thread); it is not thread-safe itself.
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from qwen_jax.config import ModelConfig, from_hf_dict
from qwen_jax.engine.detokenizer import IncrementalDetokenizer, StopChecker
from qwen_jax.engine.memory import BlockPool, SlotPool
from qwen_jax.engine.prefix_cache import PrefixCache
from qwen_jax.engine.runner import ModelRunner
from qwen_jax.engine.sampler import TokenHistory
from qwen_jax.engine.scheduler import Scheduler
from qwen_jax.engine.sequence import Sequence
from qwen_jax.outputs import RequestOutput, TokenLogprob
from qwen_jax.sampling_params import SamplingParams
from qwen_jax.weights import dummy_params, load_params, open_checkpoint
from sharding import distributed, mesh, rules

log = logging.getLogger("qwen_jax")

ENGINE_ARGS = dict(
    max_model_len=None,  # default: the model's max_position_embeddings, capped at 8192
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    gpu_memory_utilization=0.9,
    enable_prefix_caching=True,
    tensor_parallel_size=1,
    data_parallel_size=1,
    enable_expert_parallel=False,
    load_format="auto",  # "auto": read the checkpoint; "dummy": random weights with the real shapes
    dtype="auto",
    kernels="reference",  # "gpu": the Pallas kernels of pallas_kernels/ for the ops that have one (one device)
    seed=0,
    block_size=16,
    num_snapshots=None,  # recurrent-state snapshots for the prefix cache; default from memory
    cpu_cache_budget_gib=2.0,  # cache memory on a CPU backend (no device memory statistics there)
    num_kv_blocks=None,  # usable KV blocks, overriding the memory-derived count (tests, reproducible sizing)
)


def resolve_model(model: str | None) -> str:
    """A model directory (or llama2.c .bin); None means the small built-in default model."""
    if model is None:
        from qwen_jax.default_model import ensure_default_model

        return ensure_default_model()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model path {model!r} does not exist (no model hub access: give a local directory)")
    return model


def _read_config(model_path: str) -> dict:
    path = os.path.join(model_path, "config.json") if os.path.isdir(model_path) else model_path
    with open(path) as f:
        return json.load(f)


def read_model_config(model_path: str, dtype: str = "auto") -> ModelConfig:
    """The config the engine serves: a model directory's config.json (or a llama2.c header), in `dtype`."""
    config_dict = _read_config(model_path) if os.path.isdir(model_path) else open_checkpoint(model_path)[0]
    cfg = from_hf_dict(config_dict)
    return cfg if dtype == "auto" else cfg.with_dtype(dtype)


def resolve_max_model_len(cfg: ModelConfig, max_model_len: int | None) -> int:
    """The engine argument, or the model's max_position_embeddings capped at 8192."""
    return int(max_model_len or min(cfg.max_position_embeddings, 8192))


def load_tokenizer(model_path: str):
    """The HF tokenizer of a model directory, or None when it ships none (then only token ids are served)."""
    if os.path.isdir(model_path) and any(os.path.exists(os.path.join(model_path, f))
                                         for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    return None


def eos_ids(model_path: str, cfg: ModelConfig, tokenizer) -> list[int]:
    ids = set(cfg.eos_token_ids)
    gen = os.path.join(model_path, "generation_config.json") if os.path.isdir(model_path) else ""
    if gen and os.path.exists(gen):
        with open(gen) as f:
            value = json.load(f).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else (value or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class LLMEngine:
    def __init__(self, model: str | None = None, **engine_args):
        unknown = set(engine_args) - set(ENGINE_ARGS)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        args = {**ENGINE_ARGS, **engine_args}
        if int(args["data_parallel_size"]) != 1:
            raise NotImplementedError("data_parallel_size > 1 is not wired into the engine yet: it needs per-replica "
                                      "block/slot pools and batch rows in the scheduler and runner (sharding/ has "
                                      "the layout); use tensor_parallel_size and enable_expert_parallel")
        if args["load_format"] not in ("auto", "dummy"):
            raise ValueError(f"unknown load_format {args['load_format']!r} (auto or dummy)")
        self.model_path = resolve_model(model)
        distributed.initialize()  # multi-host: join the other processes (a no-op on one host)
        # Weights, cache and batches are laid out over this mesh by sharding/rules.py; one device is a 1x1x1 mesh.
        self.mesh = mesh.make_mesh(int(args["tensor_parallel_size"]), 1, bool(args["enable_expert_parallel"]))
        cfg = self.cfg = read_model_config(self.model_path, args["dtype"]).with_kernels(args["kernels"])
        if cfg.kernels == "gpu" and self.mesh.size > 1:
            raise NotImplementedError("kernels='gpu' runs on one device only so far (Pallas calls are not partitioned)")
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = eos_ids(self.model_path, cfg, self.tokenizer)
        self.max_model_len = resolve_max_model_len(cfg, args["max_model_len"])
        self.max_num_seqs = int(args["max_num_seqs"])
        self.max_num_batched_tokens = int(args["max_num_batched_tokens"])
        t0 = time.perf_counter()
        if args["load_format"] == "dummy":  # only config.json is needed (no weights on disk)
            params = dummy_params(cfg, seed=args["seed"], shardings=rules.param_shardings(cfg, self.mesh))
        else:  # each tensor goes straight into its shards
            params = load_params(cfg, open_checkpoint(self.model_path)[1], place=rules.make_place(cfg, self.mesh),
                                 progress=os.environ.get("QWEN_JAX_PROGRESS", "1") == "1")
        jax.block_until_ready(params)
        self.load_seconds = time.perf_counter() - t0
        self._size_memory(args, params)
        block_size = int(args["block_size"])
        self.blocks = BlockPool(self.num_blocks, block_size)
        self.slots = SlotPool(self.max_num_seqs + 1) if cfg.is_hybrid else None
        prefix = PrefixCache(self.blocks, self.num_snapshots, cfg.is_hybrid) if args["enable_prefix_caching"] else None
        self.prefix_cache = prefix
        self.scheduler = Scheduler(self.blocks, self.slots, self.max_num_seqs, self.max_num_batched_tokens, prefix)
        vocab = cfg.vocab_size
        self.runner = ModelRunner(cfg, params, self.num_blocks, block_size, self.max_num_seqs + 1,
                                  self.num_snapshots if prefix else 0, self.max_model_len, vocab,
                                  self.eos_token_ids, seed=args["seed"], mesh=self.mesh)
        self.seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._stops: dict[str, StopChecker] = {}
        self._histories: dict[str, TokenHistory] = {}
        self._text: dict[str, str] = {}  # request -> text released so far (stop strings already cut)
        self._logprobs: dict[str, list[TokenLogprob] | None] = {}
        self._sent: dict[str, tuple[int, int]] = {}  # request -> (tokens, characters) already reported
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        log.info("loaded %s in %.1fs on %s; KV cache %d blocks x %d tokens (%d tokens), %d sequences at once, "
                 "%d state snapshots", self.model_path, self.load_seconds, mesh.describe(self.mesh),
                 self.num_blocks - 1, block_size,
                 (self.num_blocks - 1) * block_size, self.max_num_seqs, self.num_snapshots)

    # ---- memory sizing ---------------------------------------------------------------------------------------
    def _size_memory(self, args: dict, params: dict) -> None:
        """Cache sizes from the tightest device of the mesh: its free memory and its shard of a block / slot."""
        cfg = self.cfg
        block_size = int(args["block_size"])
        per_block = rules.cache_bytes_per_device(cfg, self.mesh, 1, block_size, 0)  # KV pages of every layer
        per_slot = rules.cache_bytes_per_device(cfg, self.mesh, 0, block_size, 1)  # GDN state of every layer
        local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        stats = [d.memory_stats() or {} for d in local]
        if all("bytes_limit" in s for s in stats):
            # 5% of each device held back for activations and compiled programs
            budget = min(s["bytes_limit"] * (float(args["gpu_memory_utilization"]) - 0.05) - s["bytes_in_use"]
                         for s in stats)
        else:
            budget = float(args["cpu_cache_budget_gib"]) * 2**30
        if jax.process_count() > 1:  # every host must build the same cache shapes
            budget = float(np.min(multihost_utils.process_allgather(np.float64(budget))))
        blocks_per_seq = -(-self.max_model_len // block_size)
        state_bytes = (self.max_num_seqs + 1) * per_slot
        snapshots = args["num_snapshots"]
        if snapshots is None:
            snapshots = (2 * self.max_num_seqs + 1) if per_slot else 0
            snapshots = int(min(snapshots, 0.2 * max(budget - state_bytes, 0) // max(per_slot, 1)))
        self.num_snapshots = int(snapshots) if (cfg.is_hybrid and args["enable_prefix_caching"]) else 0
        left = budget - state_bytes - self.num_snapshots * per_slot
        wanted = 2 * self.max_num_seqs * blocks_per_seq + 1  # room for every sequence at full length, plus cache
        fits = int(left // per_block) if per_block else wanted
        self.num_blocks = max(2, min(wanted, fits))
        if args["num_kv_blocks"] is not None:
            self.num_blocks = int(args["num_kv_blocks"]) + 1  # + the reserved padding sink
        if self.num_blocks - 1 < blocks_per_seq:
            raise ValueError(f"only {self.num_blocks - 1} KV blocks fit in memory, one sequence of max_model_len "
                             f"{self.max_model_len} needs {blocks_per_seq}: lower max_model_len or raise "
                             f"gpu_memory_utilization")
        if state_bytes > budget:
            raise ValueError(f"recurrent state for {self.max_num_seqs} sequences needs {state_bytes / 2**30:.1f} GiB, "
                             f"{budget / 2**30:.1f} GiB are free: lower max_num_seqs")

    # ---- requests --------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                             f"{len(prompt_token_ids)} prompt tokens and asks for {params.max_tokens} more")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params)
        self.scheduler.add(seq)
        self.seqs[request_id] = seq
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                             params.skip_special_tokens)
        self._stops[request_id] = StopChecker(params.stop)
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            self._histories[request_id] = TokenHistory(prompt_token_ids)
        self._sent[request_id] = (0, 0)
        self._text[request_id] = ""
        self._logprobs[request_id] = [] if params.logprobs is not None else None
        self.prompt_tokens_total += len(prompt_token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self._output(seq, finished=True)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- the loop --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        results = self.runner.run(plan.decode, plan.prefill, self._histories, self.max_num_batched_tokens)
        self.scheduler.complete(plan)
        outputs = []
        now = time.time()
        for row, out, i in results:
            if not row.samples or row.seq.is_finished:
                continue
            seq = row.seq
            token = int(out.tokens[i])
            seq.output_token_ids.append(token)
            self.generation_tokens_total += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.request_id in self._histories:
                self._histories[seq.request_id].append([token])
            if self._logprobs[seq.request_id] is not None:
                n = seq.params.logprobs
                top = [(int(a), float(b)) for a, b in zip(out.top_ids[i][:n], out.top_logprobs[i][:n])]
                self._logprobs[seq.request_id].append(TokenLogprob(token, float(out.logprobs[i]), top))
            outputs.append(self._advance(seq, token))
        return outputs

    def _advance(self, seq: Sequence, token: int) -> RequestOutput:
        """Detokenize the new token, apply the stop rules, and build this request's output."""
        rid, params = seq.request_id, seq.params
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        enough = len(seq.output_token_ids) >= params.min_tokens
        delta = ""
        if not (is_eos and enough) and rid in self._detok:
            delta = self._detok[rid].add([token])
        if enough:
            text, stop_string = self._stops[rid].feed(delta)
        else:  # as in vLLM, stop strings count only once min_tokens tokens exist
            text, stop_string = delta, None
        self._text[rid] += text
        if stop_string is not None:
            self.scheduler.finish(seq, "stop", stop_string)
        elif is_eos and enough:
            self.scheduler.finish(seq, "stop", token)
        elif token in params.stop_token_ids and enough:
            self.scheduler.finish(seq, "stop", token)
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self.scheduler.finish(seq, "length")
        if seq.is_finished and stop_string is None:  # release held-back text (a matched stop string cut it already)
            tail = self._detok[rid].flush() if rid in self._detok else ""
            text2, _ = self._stops[rid].feed(tail)
            self._text[rid] += text2 + self._stops[rid].flush()
        return self._output(seq, finished=seq.is_finished)

    def _output(self, seq: Sequence, finished: bool) -> RequestOutput:
        rid = seq.request_id
        sent_tokens, sent_chars = self._sent[rid]
        text = self._text[rid]
        out = RequestOutput(
            request_id=rid, prompt_token_ids=seq.prompt_token_ids, token_ids=list(seq.output_token_ids), text=text,
            delta_token_ids=seq.output_token_ids[sent_tokens:], delta_text=text[sent_chars:],
            finished=finished, finish_reason=seq.finish_reason if finished else None,
            stop_reason=seq.stop_reason if finished else None, logprobs=self._logprobs.get(rid),
            num_cached_tokens=seq.num_cached_tokens, arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time, finish_time=time.time() if finished else None)
        self._sent[rid] = (len(seq.output_token_ids), len(text))
        if finished:
            self._forget(rid)
        return out

    def _forget(self, rid: str) -> None:
        for d in (self.seqs, self._detok, self._stops, self._histories, self._sent, self._text, self._logprobs):
            d.pop(rid, None)

    # ---- introspection ---------------------------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.scheduler
        return {
            "num_running": len(s.running), "num_waiting": len(s.waiting),
            "kv_blocks_used": self.blocks.num_usable - self.blocks.num_free, "kv_blocks_total": self.blocks.num_usable,
            "state_slots_used": (self.slots.num_slots - 1 - self.slots.num_free) if self.slots else 0,
            "state_slots_total": (self.slots.num_slots - 1) if self.slots else 0,
            "prefix_cache_queries": self.prefix_cache.queries if self.prefix_cache else 0,
            "prefix_cache_hits": self.prefix_cache.hits if self.prefix_cache else 0,
            "prompt_tokens_total": self.prompt_tokens_total, "generation_tokens_total": self.generation_tokens_total,
        }
