"""Compilation, kept apart from execution: every program one replica's serving can run, compiled ahead several at
once (each bucket run once on padding as soon as its programs are compiled) and checked against the memory plan.

It never schedules a request and never runs a request's step: the runner (engine/runner.py) only looks its programs
up. Once `warm_up(full=True)` has returned, serving compiles nothing (tests/engine/test_engine_compile.py counts).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING

import jax
import numpy as np

from qwen_jax.engine import step
from qwen_jax.engine.sampler import SamplingTensors
from qwen_jax.layers.batch import ragged

if TYPE_CHECKING:
    from qwen_jax.engine.runner import ModelRunner

log = logging.getLogger("qwen_jax")

# Programs compiled at once. XLA's compiler releases the GIL, so threads scale with the host's cores; an engine core
# of several on one host (data-parallel replicas as processes) gets its share from the front
# ($QWEN_JAX_COMPILE_THREADS).
COMPILE_THREADS = int(os.environ.get("QWEN_JAX_COMPILE_THREADS", "0")) or max(2, (os.cpu_count() or 2))
# Sampler variants compiled ahead for every request count: the top-k / top-p path (sampler.cut_path), top logprobs
# (none or the API maximum) and penalties. Batches with logit_bias, min_tokens bans or grammar masks have layouts of
# their own, jitted on first use.
SAMPLER_PATHS = (0, 1, 2)
# Share of the memory held back from the caches that the two largest programs' working memory may take together
# (the allocator keeps one program's peak while the other runs); the rest is for the compiled programs themselves.
WORKING_MEMORY_SHARE = 0.9


@dataclasses.dataclass
class Job:
    """One program to compile: `build` stores it in the runner. Jobs of a group run once together (`run`)."""

    name: str
    group: tuple
    build: Callable[[], object]


class Compiler:
    """The compile and warm-up side of one ModelRunner."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.working_bytes: dict[str, int] = {}  # program name -> its working (temp) memory, from XLA
        self.held_back: float | None = None  # device memory left beside the caches (None: not known)
        self.memory_checked = False
        self._lock = threading.Lock()

    # ---- abstract inputs ---------------------------------------------------------------------------------------
    def packed(self, size: int) -> jax.ShapeDtypeStruct:
        """A packed int32 buffer of `size` as the step programs take it (replicated), for lowering them."""
        return jax.ShapeDtypeStruct((size,), np.int32, sharding=step.replicated(self.runner.mesh))

    @staticmethod
    def abstract(tree):
        """Shapes, dtypes and shardings of device arrays: what lowering needs, safe to read from another thread
        while the arrays themselves are donated and replaced by steps."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)

    def step_inputs(self, size: int) -> tuple[np.ndarray, step.Layout]:
        """The packed inputs of a step of `size` padding tokens (no request: every write goes to the sinks)."""
        r = self.runner
        requests = step.request_bucket(size, r.max_num_seqs)
        batch = ragged([], [], [], [], size, requests, r.table_width)
        return step.pack_inputs(np.zeros(size, np.int32), batch, following=r.following([], requests))

    def verify_inputs(self, size: int) -> tuple[np.ndarray, step.Layout]:
        """The packed inputs of a verify step of `size` padding tokens."""
        r = self.runner
        requests = step.request_bucket(size, r.max_num_seqs)
        batch = ragged([], [], [], [], size, requests, r.table_width)
        return step.pack_inputs(np.zeros(size, np.int32), batch, draft_source=np.zeros(requests, np.int32))

    def padding_sampling(self, requests: int) -> tuple[np.ndarray, step.Layout]:
        """The packed sampling tensors of `requests` padding rows (every row greedy): the common sampling layout."""
        r = self.runner
        tensors = SamplingTensors.build_host([], [], vocab_size=r.vocab_size, batch_size=requests,
                                             num_penalty_rows=r.num_slots)
        return step.pack(tensors._asdict())

    def requests(self, size: int) -> int:
        return step.request_bucket(size, self.runner.max_num_seqs)

    # ---- the programs ------------------------------------------------------------------------------------------
    def verify_variants(self, size: int) -> list[tuple[int, int]]:
        """The verify programs of token bucket `size`: (drafts a row, rounds) of every row count whose verify step
        pads to that bucket; several rounds (max_verify_rounds) where decode steps run several a program."""
        r = self.runner
        variants = set()
        for rows in range(1, r.max_num_seqs + 1):
            k = r.drafts_at(rows)
            if not k or rows * (k + 1) > r.token_buckets[-1] or step.bucket_for(rows * (k + 1),
                                                                              r.token_buckets) != size:
                continue
            variants.add((k, 1))
            if rows <= r.decode_steps_max_rows:
                variants.add((k, r.max_verify_rounds))
        return sorted(variants)

    def jobs(self, sizes: list[int]) -> list[Job]:
        """Every program not compiled yet that steps of the token buckets `sizes` can run: per bucket its forward
        (and input staging), several-step decode, the MTP head's program, verify steps and their staging; per
        request count its samplers. Largest buckets first: they take longest to compile."""
        r = self.runner
        jobs = []
        for requests in sorted({self.requests(size) for size in sizes}):
            layout = self.padding_sampling(requests)[1]
            for path in SAMPLER_PATHS:
                for top in (0, r.top_logprobs_width):
                    for penalties in (False, True):
                        if (layout, path, top, penalties) not in r.samplers:
                            jobs.append(Job(f"sampler[{requests} rows, path {path}, top {top}, penalties {penalties}]",
                                            ("sampler", requests),
                                            lambda a=(layout, path, top, penalties): self._sampler(*a)))
        for size in sorted(sizes, reverse=True):
            group = ("bucket", size)
            if size not in r.forwards:
                jobs.append(Job(f"forward[{size}]", group, lambda s=size: self.forward(s)))
            if size in r.decode_buckets and size not in r.decoders:
                jobs.append(Job(f"decode_steps[{size} x {r.decode_steps}]", group, lambda s=size: self._decoder(s)))
            if r.num_speculative_tokens:
                if size not in r.drafters:
                    jobs.append(Job(f"draft[{size}]", group, lambda s=size: self._drafter(s)))
                for k, rounds in self.verify_variants(size):
                    if (size, k, rounds) not in r.verifiers:
                        jobs.append(Job(f"verify[{size}, k={k}, rounds={rounds}]", group,
                                        lambda a=(size, k, rounds): self._verifier(*a)))
        return jobs

    def _record(self, name: str, compiled: jax.stages.Compiled) -> jax.stages.Compiled:
        analysis = compiled.memory_analysis()
        if analysis is not None:
            with self._lock:
                self.working_bytes[name] = int(analysis.temp_size_in_bytes)
        return compiled

    def forward(self, size: int) -> None:
        r = self.runner
        layout = self.step_inputs(size)[1]
        r.forwards[size] = self._record(f"forward[{size}]", step.forward.lower(
            self.abstract(r.params), self.abstract(r.cache), self.abstract(r.last_tokens), self.packed(layout.size),
            layout=layout, cfg=r.cfg, mesh=r.mesh, kernels=r.kernels,
            with_hidden=bool(r.num_speculative_tokens)).compile())
        self.stager(layout.size)

    def stager(self, size: int) -> jax.stages.Compiled:
        """The program that copies packed inputs of `size` into their input buffer."""
        r = self.runner
        program = r.stagers.get(size)
        if program is None:
            buffer = self.packed(size)
            program = r.stagers[size] = step.stage_inputs.lower(buffer, buffer).compile()
        return program

    def _sampler(self, layout: step.Layout, path: int, top: int, penalties: bool) -> None:
        r = self.runner
        requests = step.layout_shape(layout, "temperature")[0]
        logits = jax.ShapeDtypeStruct((requests, r.vocab_size), np.float32, sharding=step.replicated(r.mesh))
        counts = self.abstract(r.penalty_counts) if penalties else None
        r.samplers[layout, path, top, penalties] = step.sample_step.lower(
            logits, self.packed(layout.size), self.abstract(r.last_tokens), counts, layout=layout,
            num_top_logprobs=top, path=path).compile()

    def _decoder(self, size: int) -> None:
        r = self.runner
        layout = self.step_inputs(size)[1]
        sampling_layout = self.padding_sampling(self.requests(size))[1]
        try:
            r.decoders[size] = sampling_layout, self._record(f"decode_steps[{size}]", step.decode_steps.lower(
                self.abstract(r.params), self.abstract(r.cache), self.abstract(r.last_tokens),
                self.packed(layout.size), self.packed(sampling_layout.size), layout=layout,
                sampling_layout=sampling_layout, cfg=r.cfg, mesh=r.mesh, kernels=r.kernels, steps=r.decode_steps,
                num_top_logprobs=0, path=0).compile())
        except Exception:  # serving goes on one decode step a program
            log.exception("the %d-step decode program of %d tokens failed to compile; decode steps run one a program",
                          r.decode_steps, size)
            r.decode_steps_max_rows = 0

    def _drafter(self, size: int) -> None:
        """The MTP head's program after a plain step of `size` tokens, and the stage_behind program of that step's
        inputs (any step may follow a verify program still in flight)."""
        r = self.runner
        replicated = step.replicated(r.mesh)
        layout = self.step_inputs(size)[1]
        hidden = jax.ShapeDtypeStruct((size, r.cfg.hidden_size), r.cfg.jnp_dtype, sharding=replicated)
        tokens = jax.ShapeDtypeStruct((size,), np.int32, sharding=replicated)
        r.drafters[size] = layout, self._record(f"draft[{size}]", step.draft_step.lower(
            self.abstract(r.params), self.abstract(r.cache), hidden, tokens, self.abstract(r.last_tokens),
            self.abstract(r.drafts), self.packed(layout.size), layout=layout, cfg=r.cfg, mesh=r.mesh,
            kernels=r.kernels, draft_len=r.num_speculative_tokens).compile())
        self._behind_stager(layout, self.padding_sampling(self.requests(size))[1])

    def _verifier(self, size: int, k: int, rounds: int) -> None:
        """The verify step of `size` tokens, k drafts a row and `rounds` rounds (greedy and temperature-only
        sampling without logprobs: on an accelerator only such rows speculate), and its stage_behind program."""
        r = self.runner
        layout = self.verify_inputs(size)[1]
        sampling_layout = self.padding_sampling(self.requests(size))[1]
        r.verifiers[size, k, rounds] = sampling_layout, self._record(
            f"verify[{size}, k={k}, rounds={rounds}]", step.verify_step.lower(
                self.abstract(r.params), self.abstract(r.cache), self.abstract(r.last_tokens),
                self.abstract(r.drafts), self.abstract(r.emitted), self.packed(layout.size),
                self.packed(sampling_layout.size), layout=layout, sampling_layout=sampling_layout, cfg=r.cfg,
                mesh=r.mesh, kernels=r.kernels, draft_len=k, rounds=rounds, num_top_logprobs=0, path=0).compile())
        self.stager(layout.size)
        self._behind_stager(layout, sampling_layout)

    def _behind_stager(self, layout: step.Layout, sampling_layout: step.Layout) -> None:
        r = self.runner
        if (layout, sampling_layout) not in r.behind_stagers:
            buffer, sampling = self.packed(layout.size), self.packed(sampling_layout.size)
            r.behind_stagers[layout, sampling_layout] = step.stage_behind.lower(
                buffer, buffer, sampling, self.abstract(r.emitted), layout=layout,
                sampling_layout=sampling_layout).compile()

    # ---- compiling and first runs ------------------------------------------------------------------------------
    def compile(self, sizes: list[int] | None = None, threads: int | None = None, run: bool = False,
                part: tuple[int, int] = (0, 1)) -> None:
        """Compile every program of the token buckets `sizes` (default: all) not compiled yet, `threads` at a time,
        one log line per program. `run`: check the memory plan once the programs that need the most working memory
        (verify steps, the largest forward) are compiled, then run each bucket's programs once on padding
        (run_padding, on this thread) as soon as they are compiled, while the others compile. `part` (i, n): only
        every n-th program from the i-th, for n processes that share a persistent compilation cache and each compile
        a part first."""
        r = self.runner
        sizes = list(r.token_buckets if sizes is None else sizes)
        jobs = self.jobs(sizes)[part[0]::part[1]]
        threads = max(1, min(len(jobs), threads or COMPILE_THREADS))
        start = time.perf_counter()
        done = 0
        pending: dict[tuple, int] = {}
        for job in jobs:
            pending[job.group] = pending.get(job.group, 0) + 1
        critical = {job.name for job in jobs if job.name.startswith("verify") or job.name == f"forward[{max(sizes)}]"}
        to_run = sorted(sizes) if run else []

        def timed(job: Job) -> float:
            began = time.perf_counter()
            job.build()
            return time.perf_counter() - began

        with ThreadPoolExecutor(threads, thread_name_prefix="qwen-jax-compile") as pool:
            futures: dict[Future, Job] = {pool.submit(timed, job): job for job in jobs}
            for future in as_completed(futures):
                job, seconds = futures[future], future.result()
                done += 1
                pending[job.group] -= 1
                critical.discard(job.name)
                log.info("compiled %s in %.1fs (%d of %d, %.1fs in all)", job.name, seconds, done, len(jobs),
                         time.perf_counter() - start)
                if to_run and not critical:
                    if self.memory_checked is False:
                        self.check_memory()
                    to_run = self._run_ready(to_run, pending)
        if to_run:
            self.check_memory()
            self._run_ready(to_run, {})
        if jobs:
            log.info("compiled %d programs in %.1fs on %d threads", len(jobs), time.perf_counter() - start, threads)

    def _run_ready(self, sizes: list[int], pending: dict[tuple, int]) -> list[int]:
        """Run once each bucket of `sizes` whose programs (and samplers) are all compiled; the others, to run later."""
        later = []
        for size in sizes:
            if pending.get(("bucket", size)) or pending.get(("sampler", self.requests(size))):
                later.append(size)
            else:
                self.run_padding(size)
        return later

    def run_padding(self, size: int) -> None:
        """Run the programs of token bucket `size` once on padding only (no request: every write goes to the sinks,
        KV block 0, state slot 0) and wait for them: a program's first run costs the host far more than later ones
        (on a GPU: loading it, recording its CUDA graphs). Overwrites last_tokens: only while no sequence runs."""
        r = self.runner
        buffer, layout = self.step_inputs(size)
        sampling, sampling_layout = self.padding_sampling(self.requests(size))
        execute = r.executor
        jax.block_until_ready(execute([("step", buffer, layout, sampling, sampling_layout, 0, 0, False,
                                        bool(r.num_speculative_tokens), False)]))
        if size in r.decoders:
            jax.block_until_ready(execute([("decode_steps", buffer, layout, sampling, sampling_layout, 0, 0,
                                            r.decode_steps, False)]))
        # a model that speculates: its verify programs, and each kind of step caught up on one (padding: no row is
        # behind, so nothing moves)
        for k, rounds in self.verify_variants(size) if r.num_speculative_tokens else ():
            jax.block_until_ready(execute([("verify", *self.verify_inputs(size), sampling, sampling_layout, 0, 0, k,
                                            rounds, True)]))
        if r.num_speculative_tokens:
            jax.block_until_ready(execute([("step", buffer, layout, sampling, sampling_layout, 0, 0, False, True,
                                            True)]))
        if size == min(s for s in r.token_buckets if self.requests(s) == self.requests(size)):
            self._run_samplers(self.requests(size))

    def _run_samplers(self, requests: int) -> None:
        """Every sampler variant of `requests` rows once, on zero logits."""
        r = self.runner
        sampling, layout = self.padding_sampling(requests)
        sampling = r.put(sampling)
        logits = r.put(np.zeros((requests, r.vocab_size), np.float32))
        for (program_layout, *_, penalties), program in list(r.samplers.items()):
            if program_layout != layout or not isinstance(program, jax.stages.Compiled):
                continue
            out, r.last_tokens, counts = program(logits, sampling, r.last_tokens,
                                                 r.penalty_counts if penalties else None)
            if penalties:
                r.penalty_counts = counts
            jax.block_until_ready(out)

    def check_memory(self) -> None:
        """The memory plan at start-up, before any program runs: the two largest programs' working memory must fit
        in what is held back from the caches (the allocator may keep one's peak while the other runs). Raises
        ValueError saying what to lower."""
        self.memory_checked = True
        held_back = self.held_back
        if held_back is None or not self.working_bytes:
            return
        largest = sorted(self.working_bytes.items(), key=lambda item: -item[1])[:2]
        need = sum(b for _, b in largest)
        log.info("working memory: %s; %.2f GiB held back from the caches",
                 ", ".join(f"{name} {b / 2**30:.2f} GiB" for name, b in largest), held_back / 2**30)
        if need > WORKING_MEMORY_SHARE * held_back:
            raise ValueError(
                f"the step programs need {need / 2**30:.2f} GiB of working memory ({largest[0][0]} "
                f"{largest[0][1] / 2**30:.2f} GiB), more than the {WORKING_MEMORY_SHARE * held_back / 2**30:.2f} GiB "
                f"left to them: lower --max-num-batched-tokens, --max-num-seqs or --speculative-config's "
                f"num_speculative_tokens, or lower --gpu-memory-utilization")

    def warm_up(self, full: bool, max_pairs: int, part: tuple[int, int] | None = None) -> None:
        """Compile (several at once) and run once every program serving can run (`full`), or only those of the
        smallest and the largest token bucket (the rest are jitted when a step first needs them), and the snapshot
        copies of up to `max_pairs` pairs. Through the executor, so other hosts compile and run them too. `part`: as
        in `compile`, this process's share of a compile shared through the persistent cache (compiled, not run)."""
        r = self.runner
        sizes = list(r.token_buckets) if full else sorted({r.token_buckets[0], r.token_buckets[-1]})
        if part is not None:
            self.compile(sizes, part=part)
            return
        if r.executor == r.execute:  # one host: first runs while the rest compiles
            self.compile(sizes, run=True)
        else:  # other hosts compile too, then every host runs each program in the same order
            r.executor([("compile", sizes)])
            self.check_memory()
            for size in sizes:
                self.run_padding(size)
        # the small programs of sequences entering a batch: snapshot copies and penalty-count resets (nothing real:
        # padding entries copy into the sinks, and reset no row)
        longest = r.table_width * r.block_size
        for n in sorted({1 << (k - 1).bit_length() for k in range(1, max_pairs + 1)}):
            if r.has_snapshots:
                r.executor([("restore", *r.pairs([(0, 0)] * n)), ("save", *r.pairs([(0, 0)] * n))])
            r.executor([("penalties", np.full(n, r.num_slots, np.int32), np.zeros((n, longest), np.int32),
                         np.zeros(n, np.int32), np.zeros(n, np.int32))])
        jax.block_until_ready((r.cache, r.penalty_counts))
