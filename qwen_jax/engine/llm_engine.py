"""LLMEngine: the synchronous engine loop (add requests, step, collect outputs) over one EngineCore (scheduler +
runner + cache pools, sized at start-up) per data-parallel replica, with model loading.

One thread drives it (the offline LLM directly, AsyncLLM from its loop thread); it is not thread-safe itself. With
several replicas it steps them on threads of its own, which touch only their own core.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax

from qwen_jax.config import ModelConfig, from_hf_dict
from qwen_jax.engine import multihost
from qwen_jax.engine.core import EngineCore
from qwen_jax.engine.detokenizer import IncrementalDetokenizer, StopChecker
from qwen_jax.engine.sampler import SampleOutput, TokenHistory
from qwen_jax.engine.sequence import Sequence
from qwen_jax.outputs import RequestOutput, TokenLogprob
from qwen_jax.sampling_params import SamplingParams
from qwen_jax.weights import dummy_params, load_params, open_checkpoint
from sharding import distributed, mesh, rules
from sharding.ops import ops_for_mesh

log = logging.getLogger("qwen_jax")

ENGINE_ARGS = dict(
    max_model_len=None,  # default: the model's max_position_embeddings, capped at 8192
    max_num_seqs=64,  # per data-parallel replica (as vLLM's is per DP rank)
    max_num_batched_tokens=2048,  # per replica and step
    gpu_memory_utilization=0.9,
    enable_prefix_caching=True,
    tensor_parallel_size=1,
    data_parallel_size=1,  # D independent replicas in this process, replica i on devices [i*tp, (i+1)*tp)
    enable_expert_parallel=False,
    load_format="auto",  # "auto": read the checkpoint; "dummy": random weights with the real shapes
    dtype="auto",
    kernels="reference",  # "gpu": the Pallas kernels of pallas_kernels/ for the ops that have one
    seed=0,
    layers_per_program=1,  # consecutive layers per compiled program (0: all); fewer programs, longer compiles
    # Decode batches of up to this many rows run every layer as one program, which XLA launches as CUDA graphs
    # (its command buffers): a small step is bound by launching ~1,300 kernels, not by the GPU. None: 8 on a GPU,
    # 0 (never) elsewhere. Each such batch size compiles for ~20 s instead of ~5.
    cuda_graph_max_batch=None,
    block_size=16,
    num_snapshots=None,  # recurrent-state snapshots for the prefix cache; default from memory
    cpu_cache_budget_gib=2.0,  # cache memory on a CPU backend (no device memory statistics there)
    num_kv_blocks=None,  # usable KV blocks, overriding the memory-derived count (tests, reproducible sizing)
    # Several hosts (sharding/README.md, "Several hosts"); None: sharding/distributed.py's environment variables.
    num_hosts=None,  # processes joined by jax.distributed ($JAX_NUM_PROCESSES; 1: this host alone)
    host_index=None,  # this process ($JAX_PROCESS_ID): 0 schedules, every other one follows (LLMEngine.follow)
    coordinator_address=None,  # "host:port" that host 0 serves the coordinator on ($JAX_COORDINATOR_ADDRESS)
)
"""The engine arguments (vLLM's names) and their defaults. With data_parallel_size D the engine runs D replicas,
each with its own weights and cache: max_num_seqs, max_num_batched_tokens, num_kv_blocks, num_snapshots and the
memory sizing apply to each replica (so D x max_num_seqs sequences run at once), as in vLLM, where they are per
DP rank."""


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
    """The front of the engine: tokenizer, detokenizers, stop rules, request bookkeeping and outputs, over one
    EngineCore per data-parallel replica (each its own model on its own devices; one core when
    data_parallel_size is 1). Requests go to the replica with the fewest unfinished requests and stay there; a step
    runs every replica that has work, concurrently on a thread per replica when there are several."""

    def __init__(self, model: str | None = None, **engine_args):
        unknown = set(engine_args) - set(ENGINE_ARGS)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        args = {**ENGINE_ARGS, **engine_args}
        if args["load_format"] not in ("auto", "dummy"):
            raise ValueError(f"unknown load_format {args['load_format']!r} (auto or dummy)")
        self.model_path = resolve_model(model)
        # Multi-host: join the other processes (a no-op on one host).
        distributed.initialize(args["num_hosts"], args["host_index"], args["coordinator_address"])
        dp = int(args["data_parallel_size"])
        # Replica i's weights, cache and batches are laid out over its own mesh (devices [i*tp, (i+1)*tp) in
        # host-major order) by sharding/rules.py; one device is a 1x1x1 mesh.
        replica_meshes = mesh.replica_meshes(int(args["tensor_parallel_size"]), dp,
                                             bool(args["enable_expert_parallel"]))
        self.replica_hosts = [sorted({d.process_index for d in m.devices.flat}) for m in replica_meshes]
        idle = set(range(jax.process_count())) - {h for hosts in self.replica_hosts for h in hosts}
        if idle:
            raise ValueError(f"with {jax.process_count()} hosts the replicas must use all of them: "
                             f"data_parallel_size {dp} x tensor_parallel_size {args['tensor_parallel_size']} leaves "
                             f"host(s) {sorted(idle)} without devices (each host has {jax.local_device_count()})")
        cfg = self.cfg = read_model_config(self.model_path, args["dtype"]).with_kernels(args["kernels"])
        ops_for_mesh(cfg, replica_meshes[0])  # a head layout the partitioned ops cannot split fails here, not mid-step
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = eos_ids(self.model_path, cfg, self.tokenizer)
        self.max_model_len = resolve_max_model_len(cfg, args["max_model_len"])
        t0 = time.perf_counter()
        replica_params = self._load_params(args, replica_meshes)
        jax.block_until_ready(replica_params)
        self.load_seconds = time.perf_counter() - t0
        # Distinct sampling seeds per replica (seed * dp + i): unseeded rows of two replicas draw different numbers.
        self.cores = [EngineCore(i, cfg, params, m, args, self.max_model_len, self.eos_token_ids,
                                 seed=int(args["seed"]) * dp + i)
                      for i, (params, m) in enumerate(zip(replica_params, replica_meshes, strict=True))]
        # Several hosts: host 0 alone schedules (every replica), and sends each step's ops (the runner's device work
        # as host data) to the other hosts of that replica; they run them in follow() (engine/multihost.py). A
        # replica on other hosts only sends its sampled outputs back. Every host makes the same channels in order.
        self.channels = {i: multihost.StepChannel(followers=hosts)
                         for i, hosts in enumerate(self.replica_hosts) if hosts != [0]}
        if self.is_leader:
            for i, channel in self.channels.items():
                runner = self.cores[i].runner
                runner.executor = (multihost.leader_executor(channel, runner.execute) if 0 in self.replica_hosts[i]
                                   else multihost.remote_executor(channel))
        # Replicas step concurrently (JAX releases the GIL while their devices compute); one replica needs no thread.
        self._pool = ThreadPoolExecutor(dp, thread_name_prefix="qwen-jax-replica") if dp > 1 else None
        self.seqs: dict[str, Sequence] = {}
        self._core: dict[str, EngineCore] = {}  # request -> the replica it runs on, for its whole life
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._stops: dict[str, StopChecker] = {}
        self._histories: dict[str, TokenHistory] = {}
        self._text: dict[str, str] = {}  # request -> text released so far (stop strings already cut)
        self._logprobs: dict[str, list[TokenLogprob] | None] = {}
        self._sent: dict[str, tuple[int, int]] = {}  # request -> (tokens, characters) already reported
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self.step_seconds = 0.0  # wall time of step(): scheduling, batches, dispatch, waiting, detokenizing
        log.info("loaded %s in %.1fs; %s; total over %d replica(s): %d sequences at once, %d KV cache tokens",
                 self.model_path, self.load_seconds, "; ".join(c.describe() for c in self.cores), dp,
                 sum(c.max_num_seqs for c in self.cores), sum(c.num_tokens for c in self.cores))

    def _load_params(self, args: dict, replica_meshes: list) -> list[dict]:
        """One params pytree per replica, each made straight in its replica's shards. A checkpoint is read once:
        each tensor is placed into every replica before the next is read. Dummy weights: every replica draws the
        same seed, so the replicas are identical. Only replicas with devices on this host get weights here (None for
        the others)."""
        cfg = self.cfg
        local = [i for i, hosts in enumerate(self.replica_hosts) if jax.process_index() in hosts]
        params: list[dict | None] = [None] * len(replica_meshes)  # None: a replica on other hosts only
        if args["load_format"] == "dummy":  # only config.json is needed (no weights on disk)
            for i in local:
                params[i] = dummy_params(cfg, seed=args["seed"], shardings=rules.param_shardings(cfg,
                                                                                                 replica_meshes[i]))
            return params
        places = [rules.make_place(cfg, replica_meshes[i]) for i in local]
        copies = load_params(cfg, open_checkpoint(self.model_path)[1],
                             place=lambda path, array: tuple(place(path, array) for place in places),
                             progress=os.environ.get("QWEN_JAX_PROGRESS", "1") == "1")
        for n, i in enumerate(local):
            params[i] = jax.tree.map(lambda leaf, n=n: leaf[n], copies, is_leaf=lambda x: isinstance(x, tuple))
        return params

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
        core = min(self.cores, key=lambda c: c.num_unfinished)  # the least busy replica (ties: the lowest index)
        core.add(seq)
        self.seqs[request_id] = seq
        self._core[request_id] = core
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
        self._core[request_id].finish(seq, "abort")
        return self._output(seq, finished=True)

    @property
    def has_unfinished(self) -> bool:
        return any(c.has_work for c in self.cores)

    def warmup(self, full: bool = False) -> None:
        """Compile the step programs before serving (EngineCore.warmup), every replica at once."""
        if self._pool is not None:
            list(self._pool.map(lambda c: c.warmup(full), self.cores))
        else:
            self.cores[0].warmup(full)

    # ---- the loop --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work (concurrently when several do), then the sampled tokens are
        applied here, on the calling thread (the only one that touches the engine's bookkeeping)."""
        start = time.perf_counter()
        busy = [c for c in self.cores if c.has_work]
        if len(busy) > 1:
            results = [r for rs in self._pool.map(lambda c: c.step(self._histories), busy) for r in rs]
        else:
            results = busy[0].step(self._histories) if busy else []
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
        if busy:
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - start
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
        core = self._core[rid]
        if stop_string is not None:
            core.finish(seq, "stop", stop_string)
        elif is_eos and enough:
            core.finish(seq, "stop", token)
        elif token in params.stop_token_ids and enough:
            core.finish(seq, "stop", token)
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            core.finish(seq, "length")
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
        for d in (self.seqs, self._core, self._detok, self._stops, self._histories, self._sent, self._text,
                  self._logprobs):
            d.pop(rid, None)

    # ---- several hosts ---------------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """Whether this process schedules (takes requests and steps): always on one host; host 0 of several."""
        return jax.process_index() == 0

    @property
    def steps(self) -> multihost.StepChannel | None:
        """Replica 0's channel to the other hosts (None on one host): its message counters."""
        return self.channels.get(0)

    def follow(self) -> int:
        """Host > 0 of a multi-host engine: run host 0's steps for every replica with devices here (a thread per
        replica when there are several) until its engine shuts down (or its process ends); returns how many steps
        ran. The first host of a replica without host 0 sends that replica's sampled outputs back."""
        if self.is_leader:
            raise RuntimeError("follow() is for hosts > 0 of a multi-host engine; host 0 takes the requests")
        me = jax.process_index()
        jobs = []
        for i, hosts in enumerate(self.replica_hosts):
            if me not in hosts:
                continue
            runner, reply = self.cores[i].runner, 0 not in hosts and me == hosts[0]
            execute = (lambda ops, r=runner: [SampleOutput(*jax.device_get(tuple(o))) for o in r.execute(ops)]
                       ) if reply else runner.execute
            jobs.append((self.channels[i], execute, reply))
        if len(jobs) == 1:
            return multihost.follow(*jobs[0])
        with ThreadPoolExecutor(len(jobs), thread_name_prefix="qwen-jax-follow") as pool:
            return sum(pool.map(lambda job: multihost.follow(*job), jobs))

    def shutdown(self) -> None:
        """Host 0 of several: release the followers (their follow() returns). A no-op on one host; idempotent."""
        if self.is_leader:
            for channel in self.channels.values():
                channel.stop()

    # ---- introspection ---------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters summed over the replicas (EngineCore.stats has each replica's own)."""
        totals: dict[str, int] = {}
        for core in self.cores:
            for key, value in core.stats().items():
                totals[key] = totals.get(key, 0) + value
        return {**totals, "steps_total": self.num_steps, "step_seconds_total": self.step_seconds,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total}
