"""EngineCore: the engine's device side. It builds one Replica (scheduler + runner on its own devices) per
data-parallel replica, takes requests, and runs the step loop one step ahead of the device: it plans and issues step
N+1, then reads back step N's tokens, which the replica's scheduler applies (Scheduler.update_from_output: tokens,
stops, counters); the core keeps only its maps of the requests it runs. Step N+1 may follow a verify program N whose
outcome (how many drafts each row accepted) is not known yet: the host books every draft and the device moves N+1's
positions back by what N rejected (runner.step_inputs, step.stage_behind).

It emits per-request token outputs (CoreOutput) and never detokenizes: text, stop strings and RequestOutputs are the
front's (engine/output_processor.py). It runs in its own process under the server (engine/core_client.py) or in the
caller's process for the offline LLM.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax

from qwen_jax.engine import grammar, multihost
from qwen_jax.engine.model_files import eos_ids, read_model_config, resolve_max_model_len, tokenizer_json
from qwen_jax.engine.replica import Replica
from qwen_jax.engine.sampler import SampleOutput
from qwen_jax.engine.scheduler import Row
from qwen_jax.engine.sequence import CoreOutput, Sequence
from qwen_jax.engine.speculative import parse_speculative_config
from qwen_jax.layers.hot_ops import resolve_kernels
from qwen_jax.sampling_params import SamplingParams
from qwen_jax.weights import TensorSource, dummy_params, echo_params, load_params, open_checkpoint, resolve_mtp
from sharding import distributed, mesh, rules
from sharding.partitioned_ops import ops_for_mesh

log = logging.getLogger("qwen_jax")

# The load formats that make weights instead of reading them (only config.json is needed).
RANDOM_LOAD_FORMATS = ("dummy", "dummy_echo")
LOAD_FORMATS = ("auto", *RANDOM_LOAD_FORMATS)
ENGINE_ARGS = dict(
    max_model_len=None,  # default: the model's max_position_embeddings, capped at 8192
    # Per data-parallel replica (as vLLM's is per DP rank); None: the most, up to 64, that fit with KV for each at
    # max_model_len (engine/memory_plan.py; 64 where the device reports no memory).
    max_num_seqs=None,
    # Tokens per replica and step; None: 8192 on a GPU (vLLM's server default on H100/H200-class GPUs: fewer, fuller
    # prefill steps; H200, 35B-A3B: 64k prefill tokens/s at 8192 against 48k at 2048), 2048 elsewhere.
    max_num_batched_tokens=None,
    gpu_memory_utilization=0.9,
    enable_prefix_caching=True,
    tensor_parallel_size=1,
    data_parallel_size=1,  # D independent replicas, replica i on devices [i*tp, (i+1)*tp)
    # This engine is data-parallel replica `rank` of data_parallel_size alone, on every device it sees (the server
    # runs each replica of one host in a process of its own that sees only its devices: llm.AsyncLLM); None: all D.
    data_parallel_rank=None,
    enable_expert_parallel=False,
    # "auto": read the checkpoint; "dummy": random weights with the real shapes; "dummy_echo" (a benchmarking aid for
    # speculative decoding): those weights with the main layers' residual writers zero and the MTP head set to
    # draft what the main model will emit, so every draft is accepted at random weights' cost (weights.echo_params)
    load_format="auto",
    dtype="auto",
    tokenizer=None,  # a tokenizer directory (or hub id in the local cache) other than the model's
    hf_overrides=None,  # a dict put over config.json's entries (vLLM's --hf-overrides)
    # The sampling defaults of requests that do not set them (vLLM's --generation-config; read by the front, llm.py):
    # "auto", the model's generation_config.json; "vllm", none; or a directory holding one. The override (a dict of
    # the same entries) goes over them.
    generation_config="auto",
    override_generation_config=None,
    kernels="auto",  # "gpu": the kernels of pallas_kernels/ for the ops that have one; "reference": the jnp ops;
    # "auto": the kernels on a GPU, the references elsewhere
    seed=0,
    # Decode steps per program for batches of a few requests (vLLM's multi-step scheduling); None: 4 on a GPU, 1
    # elsewhere (engine/replica.py says why).
    num_scheduler_steps=None,
    # Speculative decoding with the model's MTP head (vLLM's flag; engine/speculative.py parse_speculative_config):
    # None (or {"method": "mtp"}): where it pays, k drafts by batch size (DraftPolicy), when the checkpoint has the
    # head; {"method": "mtp", "num_speculative_tokens": k}: k drafts on every step that can verify; "off": none.
    speculative_config=None,
    block_size=16,
    num_snapshots=None,  # recurrent-state snapshots for the prefix cache; default from memory
    cpu_cache_budget_gib=2.0,  # cache memory on a CPU backend (no device memory statistics there)
    num_kv_blocks=None,  # usable KV blocks, overriding the memory-derived count (tests, reproducible sizing)
    # Several hosts (sharding/README.md, "Several hosts"); None: sharding/distributed.py's environment variables.
    num_hosts=None,  # processes joined by jax.distributed ($JAX_NUM_PROCESSES; 1: this host alone)
    host_index=None,  # this process ($JAX_PROCESS_ID): 0 schedules, every other one follows (EngineCore.follow)
    coordinator_address=None,  # "host:port" that host 0 serves the coordinator on ($JAX_COORDINATOR_ADDRESS)
)
"""The engine arguments (vLLM's names) and their defaults. With data_parallel_size D the engine runs D replicas,
each with its own weights and cache: max_num_seqs, max_num_batched_tokens, num_kv_blocks, num_snapshots and the
memory sizing apply to each replica (so D x max_num_seqs sequences run at once), as in vLLM, where they are per
DP rank."""


def engine_args(given: dict) -> dict:
    """ENGINE_ARGS with the given values (None: the default); unknown names are an error."""
    unknown = set(given) - set(ENGINE_ARGS)
    if unknown:
        raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
    return {**ENGINE_ARGS, **{k: v for k, v in given.items() if v is not None}}


@dataclasses.dataclass
class _InFlight:
    """A step issued to a replica's devices and not read back yet."""

    replica: Replica
    rows: list[Row]
    out: SampleOutput

    @property
    def read_first(self) -> bool:
        """The next step cannot be planned before this one is read back: it samples for a request under a grammar
        (whose next mask needs this step's token)."""
        return any(row.samples and row.seq.grammar is not None for row in self.rows)

    @property
    def verifies(self) -> bool:
        return bool(self.rows and self.rows[0].drafts)


class EngineCore:
    """One model on this host's devices (and, on several hosts, the others'), as D data-parallel replicas."""

    def __init__(self, model_path: str, compile_ahead: tuple[int, int] | None = None, **given):
        """`compile_ahead`: (i, n), core i of n sharing one host's compile (None: one core): start compiling every
        program serving can run (its share) before the weights are read, for a full warm-up (`warmup(full=True)`)
        to finish; where programs compile in worker processes, they compile while the weights load."""
        args = self.args = engine_args(given)
        distributed.initialize(args["num_hosts"], args["host_index"], args["coordinator_address"])
        self.model_path = model_path
        dp = int(args["data_parallel_size"])
        rank = args["data_parallel_rank"]
        if rank is not None and not 0 <= int(rank) < dp:
            raise ValueError(f"data_parallel_rank {rank} is outside 0..{dp - 1}")
        replica_meshes = mesh.replica_meshes(args["tensor_parallel_size"], 1 if rank is not None else dp,
                                             bool(args["enable_expert_parallel"]))
        self.replica_hosts = [sorted({d.process_index for d in m.devices.flat}) for m in replica_meshes]
        idle = set(range(jax.process_count())) - {h for hosts in self.replica_hosts for h in hosts}
        if idle:
            raise ValueError(f"with {jax.process_count()} hosts the replicas must use all of them: "
                             f"data_parallel_size {dp} x tensor_parallel_size {args['tensor_parallel_size']} leaves "
                             f"host(s) {sorted(idle)} without devices (each host has {jax.local_device_count()})")
        kernels = resolve_kernels(args["kernels"])
        log.info("hot ops: %s (kernels=%s)", "the GPU kernels of pallas_kernels/" if kernels == "gpu" else
                 "the jnp references", args["kernels"])
        args["kernels"] = kernels  # what every replica compiles
        cfg = read_model_config(model_path, args["dtype"], args["hf_overrides"])
        if args["load_format"] not in LOAD_FORMATS:
            raise ValueError(f"load_format {args['load_format']!r}: expected one of {', '.join(LOAD_FORMATS)}")
        source = None if args["load_format"] in RANDOM_LOAD_FORMATS else open_checkpoint(model_path)[1]
        cfg = self.cfg = cfg if source is None else resolve_mtp(cfg, source)
        parse_speculative_config(args["speculative_config"], cfg.has_mtp)  # a config the model cannot serve fails here
        # a head layout the partitioned ops cannot split fails here, not mid-step
        ops_for_mesh(cfg, replica_meshes[0], kernels)
        tokenizer_path = args["tokenizer"] or model_path
        self.eos_token_ids = eos_ids(model_path, cfg, tokenizer_path)
        self.grammars = grammar.GrammarCompiler(lambda: tokenizer_json(tokenizer_path), cfg.vocab_size,
                                                self.eos_token_ids)
        self.max_model_len = resolve_max_model_len(cfg, args["max_model_len"])
        # The replicas are built on the weights' shapes (only replicas with devices on this host get them), so that
        # their programs can compile while the weights are read; then each gets its weights.
        # Distinct sampling seeds per replica (seed * dp + i): unseeded rows of two replicas draw different numbers.
        ranks = [int(rank)] if rank is not None else range(dp)
        local = [jax.process_index() in hosts for hosts in self.replica_hosts]
        self.replicas = [Replica(i, cfg, rules.abstract_params(cfg, m) if here else None, m, args,
                                 self.max_model_len, self.eos_token_ids, seed=int(args["seed"]) * dp + i)
                         for i, m, here in zip(ranks, replica_meshes, local, strict=True)]
        if compile_ahead is not None:
            for replica in self.replicas:
                replica.compiler.begin(compile_ahead)
            for replica in self.replicas:  # too little room for the weights beside the workers: they come after
                if replica.compile_before_weights:
                    log.info("replica %d: its programs compile before the weights load (the weights would leave the "
                             "compile workers too little device memory)", replica.index)
                    replica.compiler.compile(part=compile_ahead)
        t0 = time.perf_counter()
        replica_params = self._load_params(source, args, replica_meshes)
        jax.block_until_ready(replica_params)
        self.load_seconds = time.perf_counter() - t0
        for replica, params in zip(self.replicas, replica_params, strict=True):
            if params is not None:
                replica.runner.place_params(params)
        # Several hosts: host 0 alone schedules (every replica), and sends each step's ops (the runner's device work
        # as host data) to the other hosts of that replica; they run them in follow() (engine/multihost.py). A
        # replica on other hosts only sends its sampled outputs back. Every host makes the same channels in order.
        self.channels = {i: multihost.StepChannel(followers=hosts)
                         for i, hosts in enumerate(self.replica_hosts) if hosts != [0]}
        if self.is_leader:
            for i, channel in self.channels.items():
                runner = self.replicas[i].runner
                runner.executor = (multihost.leader_executor(channel, runner.execute) if 0 in self.replica_hosts[i]
                                   else multihost.remote_executor(channel))
        self.seqs: dict[str, Sequence] = {}
        self._replica_of: dict[str, Replica] = {}  # request -> the replica it runs on, for its whole life
        self._in_flight: list[_InFlight] = []
        self.prompt_tokens_total = 0
        self.num_steps = 0
        self.step_seconds = 0.0  # wall time of step(): planning, issuing, waiting, applying tokens
        self.plan_seconds = 0.0  # of which scheduling, building and issuing the next step
        self.dispatch_seconds = 0.0  # of which the calls that issue its programs
        # $QWEN_JAX_STEP_TRACE: a file that gets one JSON line per step (its plan, host times and device wait), to
        # see where a served workload's time goes step by step.
        trace = os.environ.get("QWEN_JAX_STEP_TRACE")
        self._trace = open(trace, "a", buffering=1) if trace else None
        log.info("loaded %s in %.1fs; %s; total over %d replica(s): %d sequences at once, %d KV cache tokens",
                 model_path, self.load_seconds, "; ".join(r.describe() for r in self.replicas), len(self.replicas),
                 sum(r.max_num_seqs for r in self.replicas), sum(r.num_tokens for r in self.replicas))

    def _load_params(self, source: TensorSource | None, args: dict, replica_meshes: list) -> list[dict | None]:
        """One params pytree per replica, each made straight in its replica's shards, from `source` (None: dummy
        weights). A checkpoint is read once: each tensor is placed into every replica before the next is read. Dummy
        weights: every replica draws the same seed, so the replicas are identical. Only replicas with devices on this
        host get weights here (None for the others)."""
        cfg = self.cfg
        local = [i for i, hosts in enumerate(self.replica_hosts) if jax.process_index() in hosts]
        params: list[dict | None] = [None] * len(replica_meshes)
        if source is None:  # dummy weights: only config.json is needed (no weights on disk)
            for i in local:
                params[i] = dummy_params(cfg, seed=args["seed"],
                                         shardings=rules.param_shardings(cfg, replica_meshes[i]))
                if args["load_format"] == "dummy_echo":
                    params[i] = echo_params(cfg, params[i])
            return params
        places = [rules.make_place(cfg, replica_meshes[i]) for i in local]
        copies = load_params(cfg, source,
                             place=lambda path, array: tuple(place(path, array) for place in places),
                             progress=os.environ.get("QWEN_JAX_PROGRESS", "1") == "1")
        for n, i in enumerate(local):
            params[i] = jax.tree.map(lambda leaf, n=n: leaf[n], copies, is_leaf=lambda x: isinstance(x, tuple))
        return params

    # ---- requests --------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the problem when the engine cannot serve this request (nothing is changed)."""
        check_request(prompt_token_ids, params, self.cfg.vocab_size, self.max_model_len)
        replica = self.replicas[0]
        needed = replica.blocks.blocks_for(len(prompt_token_ids) + params.max_tokens)
        if needed > replica.blocks.num_usable:
            raise ValueError(f"the request needs {needed} KV blocks at its longest, the cache has "
                             f"{replica.blocks.num_usable}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate(prompt_token_ids, params)
        # a structured output's grammar is compiled here (cached): a schema seen before takes no time
        matcher = self.grammars.matcher(params.structured_outputs) if params.structured_outputs is not None else None
        seq = Sequence(request_id, prompt_token_ids, params, matcher)
        replica = min(self.replicas, key=lambda r: r.num_unfinished)  # the least busy (ties: the lowest index)
        replica.add(seq)
        self.seqs[request_id] = seq
        self._replica_of[request_id] = replica
        self.prompt_tokens_total += len(prompt_token_ids)

    def abort(self, request_ids: list[str]) -> list[CoreOutput]:
        """End these requests now (unknown or finished ones are skipped); their memory is free at once."""
        outputs = []
        for rid in request_ids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self._replica_of.pop(rid).finish(seq, "abort")
                outputs.append(CoreOutput(rid, [], finish_reason="abort", num_cached_tokens=seq.num_cached_tokens))
        return outputs

    @property
    def on_accelerator(self) -> bool:
        return jax.default_backend() != "cpu"

    @property
    def has_unfinished(self) -> bool:
        return bool(self._in_flight) or any(r.has_work for r in self.replicas)

    def warmup(self, full: bool = False, part: tuple[int, int] = (0, 1)) -> None:
        """Compile the step programs and run each once before serving (Replica.warmup): full, every program serving
        can run, so no step ever waits on a compile. Replicas compile concurrently. `part`: this core's share of a
        compile shared with the other cores of one host (core_client). A full warm-up also builds the grammar
        engine's vocabulary (seconds the first constrained request would otherwise stall every row for)."""
        if full:
            self.grammars.prepare()
        if len(self.replicas) == 1:
            self.replicas[0].warmup(full, part)
            return
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(lambda r: r.warmup(full, part), self.replicas))

    # ---- the loop --------------------------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Plan and issue the next step of every replica that has work, then read back the step issued before it
        and have the scheduler apply its tokens: the device always has the next step queued while the host works on
        the last one. A request that ends at step N has one more token computed in step N+1, which is dropped.
        Anything that raises while one request's share of a step is built or applied fails that request alone
        (Scheduler.fail).
        A replica whose last step sampled for a request under a grammar reads it back before planning the next (the
        request's next mask needs that token), as vLLM does; other batches keep the step ahead, verify programs
        included (the next step catches up on the device on what the one before it accepted)."""
        start = time.perf_counter()
        issued, outputs = [], []
        ahead = []
        waited = sum(r.runner.device_wait_seconds for r in self.replicas) if self._trace else 0.0
        for step in self._in_flight:
            if step.read_first:
                outputs += self._apply(step)
            else:
                ahead.append(step)
        for replica in self.replicas:
            plan = replica.scheduler.schedule()
            if plan.empty:
                continue
            verifying = next((s.rows for s in ahead if s.replica is replica and s.verifies), [])
            rows, ops, failed = self._prepare(replica, plan.rows, plan.head, verifying)
            outputs += failed
            if rows:
                dispatch = time.perf_counter()
                out = replica.runner.executor(ops)
                self.dispatch_seconds += time.perf_counter() - dispatch
                issued.append(_InFlight(replica, rows, out))
        planned = time.perf_counter()
        self.plan_seconds += planned - start
        for step in ahead:
            outputs += self._apply(step)
        self._in_flight = issued
        if issued or outputs:
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - start
            if self._trace:
                self._trace_step(issued, start, planned, waited)
        return outputs

    def _trace_step(self, issued: list[_InFlight], start: float, planned: float, waited: float) -> None:
        rows = [row for step in issued for row in step.rows]
        waited = sum(r.runner.device_wait_seconds for r in self.replicas) - waited
        self._trace.write(json.dumps({
            "time": round(time.time() - (time.perf_counter() - start), 4), "plan_ms": round(1e3 * (planned - start), 3),
            "wall_ms": round(1e3 * (time.perf_counter() - start), 3), "wait_ms": round(1e3 * waited, 3),
            "rows": len(rows), "tokens": sum(r.num_tokens for r in rows), "steps": rows[0].steps if rows else 0,
            "drafts": rows[0].drafts if rows else 0,
            "prefill_rows": sum(r.num_tokens > 1 for r in rows),
            "waiting": sum(len(r.scheduler.waiting) for r in self.replicas),
            "running": sum(len(r.scheduler.running) for r in self.replicas)}) + "\n")

    def _prepare(self, replica: Replica, rows: list[Row], head: bool, verifying: list[Row]
                 ) -> tuple[list[Row], list | None, list[CoreOutput]]:
        """A planned step's ops (`verifying`: the rows of the replica's verify program in flight); when building
        them raises, the requests whose rows fail alone are failed and the step is built without them: (the rows
        issued, their ops, the failed requests' outputs). A failure that no single row explains is the engine's and
        propagates."""
        try:
            return rows, replica.runner.prepare(rows, head, verifying), []
        except Exception:
            culprits = replica.runner.failing_rows(rows, verifying)
            if not culprits:
                raise
        failed = self._forget([replica.scheduler.fail(row.seq, exc) for row, exc in culprits])
        rows = [row for row in rows if row.seq.request_id not in {out.request_id for out in failed}]
        return rows, replica.runner.prepare(rows, head, verifying) if rows else None, failed

    def _apply(self, step: _InFlight) -> list[CoreOutput]:
        """Read an issued step back and have its replica's scheduler apply it."""
        return self._forget(step.replica.scheduler.update_from_output(step.rows, step.replica.runner.fetch(step.out)))

    def _forget(self, outputs: list[CoreOutput]) -> list[CoreOutput]:
        """Drop the requests these outputs end (the scheduler has finished them) from the core's maps."""
        for out in outputs:
            if out.finish_reason is not None:
                self.seqs.pop(out.request_id, None)
                self._replica_of.pop(out.request_id, None)
        return outputs

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
            runner, reply = self.replicas[i].runner, 0 not in hosts and me == hosts[0]
            execute = (lambda ops, r=runner: _host_output(r, r.execute(ops))) if reply else runner.execute
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
        """Counters summed over the replicas (Replica.stats has each replica's own; a list, position by position)."""
        totals: dict = {}
        for replica in self.replicas:
            for key, value in replica.stats().items():
                if isinstance(value, list):
                    totals[key] = [a + b for a, b in zip(totals.get(key, [0] * len(value)), value, strict=True)]
                else:
                    totals[key] = totals.get(key, 0) + value
        return {**totals, "steps_total": self.num_steps, "step_seconds_total": self.step_seconds,
                "step_plan_seconds_total": self.plan_seconds, "step_dispatch_seconds_total": self.dispatch_seconds,
                "prompt_tokens_total": self.prompt_tokens_total}


def _host_output(runner, out: SampleOutput | None) -> list | None:
    """A step's sampled outputs as host data for a reply to host 0 (None for ops without a step)."""
    return None if out is None else list(runner.fetch(out))


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError naming the problem when a request cannot be served by a model of this vocabulary and
    context: every token id field is checked against the vocabulary here, at the edge. (A structured output's
    grammar is checked where it is compiled, EngineCore.add_request.)"""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    for field, ids in (("prompt token id", prompt_token_ids), ("stop_token_ids:", params.stop_token_ids),
                       ("logit_bias: token id", params.logit_bias or ())):
        bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field} {bad} is outside the vocabulary [0, {vocab_size})")
    if len(prompt_token_ids) + params.max_tokens > max_model_len:
        raise ValueError(f"this model's maximum context length is {max_model_len} tokens; the request has "
                         f"{len(prompt_token_ids)} prompt tokens and asks for {params.max_tokens} more")
