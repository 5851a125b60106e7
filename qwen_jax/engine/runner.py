"""ModelRunner: one replica's device state (params, cache, snapshots, penalty counts, the last sampled tokens) and the
turning of a scheduled step into device work: the step's host data (an op list of numpy arrays), then the programs
of engine/step.py issued without waiting for them.

It never decides who runs (the scheduler does) and never blocks on the device except in `fetch`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import Mesh

from qwen_jax.config import ModelConfig
from qwen_jax.engine import grammar, step
from qwen_jax.engine.sampler import SampleOutput, SamplingTensors, cut_path
from qwen_jax.engine.scheduler import Row
from qwen_jax.engine.speculative import VerifyOutput
from qwen_jax.layers.batch import ragged
from qwen_jax.sampling_params import SamplingParams
from sharding import rules
from sharding.mesh import make_mesh

log = logging.getLogger("qwen_jax")

# Every step with a row asking for logprobs computes the API maximum of top-n (one compiled width, not 21).
TOP_LOGPROBS_WIDTH = SamplingParams.MAX_LOGPROBS
_GREEDY = SamplingParams(temperature=0.0)
# Steps compiled at once at warm-up, and later in the background while serving (XLA's compiler releases the GIL;
# each compile also keeps a few cores busy).
COMPILE_THREADS = int(os.environ.get("QWEN_JAX_COMPILE_THREADS", "4"))
BACKGROUND_COMPILE_THREADS = 2


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= n (at least `minimum`)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


# A verify program of a few rows runs this many rounds per decode step a decode program runs: a program's ~6 ms of
# host time is shared by more tokens. Rows that end inside a program compute the rest of its rounds for nothing.
VERIFY_ROUNDS_PER_DECODE_STEP = 2


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: dict | None, num_blocks: int, block_size: int, num_slots: int,
                 num_snapshots: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: list[int], seed: int = 0, mesh: Mesh | None = None, decode_steps: int = 1,
                 decode_steps_max_rows: int = 0, kernels: str = "reference", num_speculative_tokens: int = 0,
                 drafts_at: Callable[[int], int] | None = None):
        """`params` must already be laid out over `mesh` (default: the first device) by sharding.rules. None: the
        mesh is on other hosts (a data-parallel replica there); this runner only writes its steps down, and its
        executor sends them where they run (engine/multihost.py). `kernels`: the hot ops' implementation
        (qwen_jax/layers/ops.py). A model that speculates: the MTP head proposes num_speculative_tokens drafts a
        row, and a verify step of r rows verifies drafts_at(r) of them (0: such a step does not verify; the verify
        programs compiled ahead are those)."""
        self.cfg = cfg
        self.kernels = kernels
        self.params = params
        self.mesh = mesh if mesh is not None else make_mesh(1)
        self.block_size = block_size
        self.table_width = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.num_slots = num_slots
        # Decode steps of up to decode_steps_max_rows requests run decode_steps at a time in one program.
        self.num_speculative_tokens = num_speculative_tokens  # drafts the head proposes a row (0: no speculation)
        self.drafts_at = drafts_at or (lambda rows: num_speculative_tokens)
        self.decode_steps = decode_steps
        self.decode_steps_max_rows = decode_steps_max_rows if decode_steps > 1 else 0
        self.max_verify_rounds = VERIFY_ROUNDS_PER_DECODE_STEP * decode_steps if self.decode_steps_max_rows else 1
        self.decode_buckets = [size for size in step.token_buckets(max_num_batched_tokens, max_num_seqs)
                               if size <= self.decode_steps_max_rows]
        self.token_buckets = step.token_buckets(max_num_batched_tokens, max_num_seqs)
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.step_seed = seed * 1_000_003
        self.has_snapshots = bool(num_snapshots and cfg.is_hybrid)
        self.cache = self.snapshots = self.penalty_counts = self.last_tokens = self.drafts = self.emitted = None
        if params is not None:
            self.cache = rules.init_cache(cfg, self.mesh, num_blocks, block_size, num_slots)
            put = self._put
            self.penalty_counts = put(np.zeros((num_slots, cfg.vocab_size), np.int32))
            self.last_tokens = put(np.zeros(max_num_seqs, np.int32))
            # speculative decoding: the drafts proposed for each row of the last step (row r: sample row r's)
            self.drafts = put(np.zeros((max_num_seqs, num_speculative_tokens), np.int32))
            # each row's tokens emitted by the last verify program (the next step's catch-up: step.stage_behind)
            self.emitted = put(np.zeros(max_num_seqs, np.int32))
        if params is not None and self.has_snapshots:  # GDN state only (+ the sink at 0), split like the cache
            snapshot_cache = rules.init_cache(cfg, self.mesh, 1, block_size, num_snapshots + 1)["layers"]
            self.snapshots = [snapshot_cache[i] for i in step.gdn_indices(cfg)]
        # The compiled forward of each token bucket and the samplers beside them, compiled ahead (several at once:
        # XLA's compiler releases the GIL) or when a step first needs them. While buckets still compile in the
        # background a step takes the smallest compiled bucket that holds it (`ready`), never waiting for one.
        self._forwards: dict[int, jax.stages.Compiled] = {}
        # several decode steps a program (decode_steps), each with the sampling layout it was compiled for
        self._decoders: dict[int, tuple[step.Layout, jax.stages.Compiled]] = {}
        # speculative decoding: the MTP head's program after a plain step of each bucket, and the verify steps of
        # each (bucket, drafts a row, rounds)
        self._drafters: dict[int, tuple[step.Layout, jax.stages.Compiled]] = {}
        self._verifiers: dict[tuple[int, int, int], tuple[step.Layout, jax.stages.Compiled]] = {}
        self._inputs: dict[int, jax.Array] = {}  # packed-input size -> the device buffer a step's inputs go to
        self._stagers: dict[int, jax.stages.Compiled] = {}  # packed-input size -> its stage_inputs program
        # (inputs layout, sampling layout) -> its stage_behind program, compiled ahead for the common sampling layout
        self._behind_stagers: dict[tuple[step.Layout, step.Layout], jax.stages.Compiled] = {}
        self._samplers: dict[tuple, jax.stages.Compiled] = {}
        # None: every bucket, compiled when first needed. Else (compiling in the background) the buckets that are
        # compiled and have run once: a program's first run costs the host 0.4-1.3 s (H200, 35B-A3B: loading it and
        # recording its CUDA graphs), which must not fall on a request.
        self._ready: list[int] | None = None
        self._to_run: list[int] = []  # compiled in the background, waiting for their first run (run_compiled)
        self._compiling: threading.Thread | None = None
        # What runs a step's op list (see prepare): `execute` here; a multi-host leader's engine puts the broadcast to
        # the other hosts in front of it (engine/multihost.py).
        self.executor: Callable[[list], SampleOutput | None] = self.execute
        # Time spent blocked on the devices' sampled tokens; the rest of a step is host work (engine stats).
        self.device_wait_seconds = 0.0

    def _put(self, tree):
        """Host arrays -> replicated on the mesh (several hosts: each copies only its own devices' part)."""
        sharding = step.replicated(self.mesh)
        if sharding.is_fully_addressable:
            return jax.device_put(tree, sharding)
        return jax.tree.map(lambda a: rules.put(a, sharding), tree)

    # ---- a step's host data ----------------------------------------------------------------------------------
    def step_inputs(self, rows: list[Row], verifying: dict | None = None) -> tuple[np.ndarray, step.Layout]:
        """The forward's packed inputs for `rows` (padded to a token bucket and its request count); also records,
        for each sampling row, where its token will be (seq.sample_row). `verifying`: the rows of the verify
        program issued before this step and not read back yet, by sequence (`_verifying`; their counts are ahead:
        step.Behind)."""
        num_tokens = sum(r.num_tokens for r in rows)
        padded = step.bucket_for(max(num_tokens, 1), self._ready or self.token_buckets)
        num_requests = step.request_bucket(padded, self.max_num_seqs)
        tokens = np.zeros(padded, np.int32)
        source = np.full(padded, -1, np.int32)
        at = 0
        for r in rows:
            seq, end = r.seq, r.start + r.num_tokens
            known = min(end, seq.num_known_tokens)
            ids = seq.token_ids(r.start, known)
            tokens[at:at + len(ids)] = ids
            # A token the previous step sampled is still on the device: a row's last (a verify row's first, its
            # drafts following it come from the device in the program).
            if end > known and not r.drafts:
                source[at + r.num_tokens - 1] = seq.sample_row
            elif end > known and known <= r.start:
                source[at] = seq.sample_row
            at += r.num_tokens
        batch = ragged([r.start for r in rows], [r.num_tokens for r in rows], [r.seq.slot for r in rows],
                       [r.seq.block_table for r in rows], padded, num_requests, self.table_width)
        draft_source = np.zeros(num_requests, np.int32)
        draft_source[:len(rows)] = [r.seq.sample_row for r in rows]  # where the last step left each one's drafts
        for i, r in enumerate(rows):
            if r.samples:
                r.seq.sample_row = i
        behind = self._behind(rows, verifying or {}, num_requests) if self.num_speculative_tokens else None
        if rows and rows[0].drafts:
            return step.pack_inputs(tokens, batch, source, draft_source=draft_source, behind=behind)
        return step.pack_inputs(tokens, batch, source, self._following(rows, num_requests), behind=behind)

    @staticmethod
    def _verifying(in_flight: list[Row]) -> dict[int, tuple[int, Row]]:
        """The rows of a verify program in flight by sequence (id): (the row's index in that program, the row)."""
        return {id(row.seq): (j, row) for j, row in enumerate(in_flight)}

    @staticmethod
    def _behind(rows: list[Row], verifying: dict[int, tuple[int, Row]], num_requests: int) -> step.Behind:
        """How far each row's counts run ahead of the truth while the verify program of `verifying` runs (which
        booked every draft as computed and one sample a round: Scheduler._book)."""
        behind = step.Behind.none(num_requests)
        for i, r in enumerate(rows):
            if id(r.seq) in verifying:
                j, earlier = verifying[id(r.seq)]
                behind.row[i], behind.counted[i] = j, earlier.steps
                behind.booked[i] = earlier.steps * (earlier.drafts + 1)
        return behind

    def _following(self, rows: list[Row], num_requests: int) -> np.ndarray | None:
        """A model that speculates: each row's token after its last (the prompt's next one after a chunk that ends
        inside it; -1 after a sampled one, which the device has), for the MTP head (step.draft_step); else None."""
        if not self.num_speculative_tokens:
            return None
        following = np.full(num_requests, -1, np.int32)
        for i, r in enumerate(rows):
            if not r.samples:
                end = r.start + r.num_tokens
                following[i] = r.seq.token_ids(end, end + 1)[0]
        return following

    def prepare(self, rows: list[Row], head: bool = False, in_flight: list[Row] = ()) -> list:
        """The device work of one planned step as host data, an op list run in order by the executor:
        ("restore", src, dst) copies snapshots into state slots; ("penalties", rows, ids, num_prompt, num_tokens)
        resets the penalty counts of sequences entering the batch; ("step", inputs, input layout, sampling,
        sampling layout, cut path, top logprobs, penalties on, head, behind) runs the forward and the sampler (and,
        `head`, the MTP head: StepPlan.head; `behind`: some row catches up on the verify program `in_flight`,
        step.stage_behind); ("decode_steps", ..., steps, behind) several decode steps; ("verify", ..., drafts a
        row, rounds, behind) speculative decoding's rounds; ("save", src, dst) copies state slots into snapshots.
        Numpy arrays and plain values only, so a multi-host leader can send the list to the other hosts. Also
        records, for each sampling row, where its token will be (seq.sample_row)."""
        verifying = self._verifying(in_flight)
        buffer, layout = self.step_inputs(rows, verifying)
        behind = any(id(r.seq) in verifying for r in rows)
        num_requests = step.layout_shape(layout, "query_len")[0]
        sampling = [r.seq.params if r.samples else _GREEDY for r in rows]
        steps = rows[0].steps if rows else 1
        # the tokens a row had before this step's first: its planned samples are already counted as pending
        constrained = [i for i, r in enumerate(rows) if r.samples and r.seq.grammar is not None]
        tensors = SamplingTensors.build_host(
            sampling, [r.seq.num_requested - r.steps if r.samples else 0 for r in rows], [r.seq.slot for r in rows],
            vocab_size=self.vocab_size, batch_size=num_requests, eos_token_ids=self.eos_token_ids,
            step_seed=self.step_seed + 1, num_penalty_rows=self.num_slots, constrained_rows=constrained,
            token_masks=self._token_masks([rows[i] for i in constrained]) if constrained else None)
        # an unseeded row's key advances once per token a row may emit (a verify row: rounds x (its drafts + 1))
        self.step_seed += steps * (rows[0].drafts + 1) if rows else 1
        sampling_buffer, sampling_layout = step.pack(tensors._asdict())
        penalties = any(p.has_penalties for p in sampling)
        top = TOP_LOGPROBS_WIDTH if any(p.logprobs is not None for p in sampling) else 0
        ops = []
        restore = [(r.restore_snapshot, r.seq.slot) for r in rows if r.restore_snapshot is not None]
        if restore and self.has_snapshots:
            ops.append(("restore", *self._pairs(restore)))
        entering = [r.seq for r in rows if r.admitted and r.seq.params.has_penalties]
        if entering:
            ops.append(("penalties", *self._penalty_rows(entering)))
        if rows and rows[0].drafts:  # verify rows only (Scheduler._speculate): no penalties, admissions, snapshots
            return [("verify", buffer, layout, sampling_buffer, sampling_layout, cut_path(sampling, self.vocab_size),
                     top, rows[0].drafts, steps, behind)]
        if steps > 1:  # decoding rows only (Scheduler._multi_step): no penalties, admissions or snapshots
            ops.append(("decode_steps", buffer, layout, sampling_buffer, sampling_layout,
                        cut_path(sampling, self.vocab_size), top, steps, behind))
            return ops
        ops.append(("step", buffer, layout, sampling_buffer, sampling_layout, cut_path(sampling, self.vocab_size), top,
                    penalties, head and bool(self.num_speculative_tokens), behind))
        save = [(r.seq.slot, r.save_snapshot) for r in rows if r.save_snapshot is not None]
        if save and self.has_snapshots:
            ops.append(("save", *self._pairs(save)))
        return ops

    def _token_masks(self, rows: list[Row]) -> np.ndarray:
        """The grammar masks of constrained sampling rows [len(rows), W]: each from its matcher, which has seen
        every output token before this step's (the core reads a constrained request's last step back before it
        plans the next)."""
        masks = np.zeros((len(rows), grammar.mask_words(self.vocab_size)), np.int32)
        for i, row in enumerate(rows):
            if row.seq.num_pending != row.steps:
                raise RuntimeError(f"request {row.seq.request_id}: its grammar mask needs its last token, which "
                                   "is still on the device")
            row.seq.grammar.fill_mask(masks, i)
        return masks

    def failing_rows(self, rows: list[Row], in_flight: list[Row] = ()) -> list[tuple[Row, Exception]]:
        """The rows whose step cannot be built even alone, each with its error (after `prepare` of them all
        raised). Nothing is issued and no counter moves: the engine fails those requests and builds the step
        again without them."""
        seed, sample_rows = self.step_seed, [r.seq.sample_row for r in rows]
        failing = []
        for row in rows:
            try:
                self.prepare([row], in_flight=in_flight)
            except Exception as exc:
                failing.append((row, exc))
            self.step_seed = seed
        for row, sample_row in zip(rows, sample_rows, strict=True):
            row.seq.sample_row = sample_row
        return failing

    def _penalty_rows(self, seqs: list) -> tuple[np.ndarray, ...]:
        """The penalty-count rows of sequences entering the batch, from their prompt and output so far (padding
        entries name row num_slots, dropped)."""
        count, longest = bucket(len(seqs)), bucket(max(s.num_known_tokens for s in seqs), 16)
        rows = np.full(count, self.num_slots, np.int32)
        ids = np.zeros((count, longest), np.int32)
        num_prompt, num_tokens = np.zeros(count, np.int32), np.zeros(count, np.int32)
        for i, s in enumerate(seqs):
            known = s.token_ids(0, s.num_known_tokens)
            rows[i], ids[i, :len(known)] = s.slot, known
            num_prompt[i], num_tokens[i] = len(s.prompt_token_ids), len(known)
        return rows, ids, num_prompt, num_tokens

    @staticmethod
    def _pairs(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) index arrays padded to a power of two with (0, 0): padding copies into the sink entry."""
        src, dst = np.zeros((2, bucket(len(pairs))), np.int32)
        for i, (a, b) in enumerate(pairs):
            src[i], dst[i] = a, b
        return src, dst

    # ---- device work -----------------------------------------------------------------------------------------
    def execute(self, ops: list) -> SampleOutput:
        """Issue one step's ops (see prepare) in order, without waiting for them: the step's SampleOutput, on the
        devices, its copy to the host started. The only place a step touches the devices; on several hosts every
        host runs the same list."""
        out = None
        for kind, *args in ops:
            if kind == "restore":
                self.cache = step.restore_snapshots(self.cache, self.snapshots, *self._put(tuple(args)),
                                                    cfg=self.cfg, mesh=self.mesh)
            elif kind == "save":
                self.snapshots = step.save_snapshots(self.cache, self.snapshots, *self._put(tuple(args)),
                                                     cfg=self.cfg, mesh=self.mesh)
            elif kind == "penalties":
                self.penalty_counts = step.init_penalties(self.penalty_counts, *self._put(tuple(args)))
            elif kind == "step":
                buffer, layout, sampling, sampling_layout, path, top, penalties, head, behind = args
                layout, sampling_layout = step.as_layout(layout), step.as_layout(sampling_layout)
                forward = self._forward(layout)
                sample = self._sampler(sampling_layout, path, top, penalties)
                inputs, sampling = self._stage(layout, buffer, sampling, sampling_layout, behind)
                logits, self.cache, *head_inputs = forward(self.params, self.cache, self.last_tokens, inputs)
                out, self.last_tokens, counts = sample(logits, sampling, self.last_tokens,
                                                       self.penalty_counts if penalties else None)
                if penalties:
                    self.penalty_counts = counts
                if head:  # a model that speculates: the MTP head's pages and first drafts
                    self.cache, self.drafts = self._drafter(layout)(self.params, self.cache, *head_inputs,
                                                                    self.last_tokens, self.drafts, inputs)
            elif kind == "decode_steps":
                buffer, layout, sampling, sampling_layout, path, top, steps, behind = args
                layout, sampling_layout = step.as_layout(layout), step.as_layout(sampling_layout)
                program = self._decode_program(layout, sampling_layout, path, top, steps)
                inputs, sampling = self._stage(layout, buffer, sampling, sampling_layout, behind)
                out, self.cache, self.last_tokens = program(self.params, self.cache, self.last_tokens, inputs, sampling)
            elif kind == "verify":
                buffer, layout, sampling, sampling_layout, path, top, draft_len, rounds, behind = args
                layout, sampling_layout = step.as_layout(layout), step.as_layout(sampling_layout)
                inputs, sampling = self._stage(layout, buffer, sampling, sampling_layout, behind)
                program = self._verifier(layout, sampling_layout, path, top, draft_len, rounds)
                out, self.cache, self.last_tokens, self.drafts, self.emitted = program(
                    self.params, self.cache, self.last_tokens, self.drafts, self.emitted, inputs, sampling)
            elif kind == "compile":
                self.compile(args[0])
            else:
                raise ValueError(f"unknown step op {kind!r}")
        if out is not None:
            for array in out:
                array.copy_to_host_async()
        return out

    def _stage(self, layout: step.Layout, buffer, sampling, sampling_layout: step.Layout,
               behind: bool) -> tuple[jax.Array, jax.Array]:
        """A step's packed inputs on the devices: the forward's copied into its bucket's input buffer (in place),
        the sampler's as they come; `behind`: both caught up on the verify program before (step.stage_behind)."""
        buffer, sampling = self._put((np.asarray(buffer), np.asarray(sampling)))
        inputs = self._input_buffer(layout.size)
        if behind:
            self._inputs[layout.size], sampling = self._behind_stager(layout, sampling_layout)(
                inputs, buffer, sampling, self.emitted)
        else:
            self._inputs[layout.size] = self._stager(layout.size)(inputs, buffer)
        return self._inputs[layout.size], sampling

    def _behind_stager(self, layout: step.Layout, sampling_layout: step.Layout):
        """The stage_behind program of these layouts: compiled with its bucket for the common sampling layout
        (_compile_speculation), jitted on first use for the others."""
        program = self._behind_stagers.get((layout, sampling_layout))
        if program is None:
            return functools.partial(step.stage_behind, layout=layout, sampling_layout=sampling_layout)
        return program

    def _stager(self, size: int) -> jax.stages.Compiled:
        """The program that copies packed inputs of `size` into their input buffer; compiled with its bucket, so a
        bucket's first step while serving compiles nothing."""
        program = self._stagers.get(size)
        if program is None:
            buffer = self._packed(size)
            program = self._stagers[size] = step.stage_inputs.lower(buffer, buffer).compile()
        return program

    # ---- compiled programs -----------------------------------------------------------------------------------
    @property
    def num_forwards(self) -> int:
        """Forwards compiled so far (one per token bucket)."""
        return len(self._forwards)

    @property
    def num_stagers(self) -> int:
        """Input-staging programs compiled so far (one per token bucket)."""
        return len(self._stagers)

    def _packed(self, size: int) -> jax.ShapeDtypeStruct:
        """A packed int32 buffer of `size` as the step programs take it (replicated), for lowering them."""
        return jax.ShapeDtypeStruct((size,), np.int32, sharding=step.replicated(self.mesh))

    def _abstract(self, tree):
        """Shapes, dtypes and shardings of device arrays: what lowering needs, safe to read from another thread
        while the arrays themselves are donated and replaced by steps."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)

    def _forward(self, layout: step.Layout) -> jax.stages.Compiled:
        size = step.layout_shape(layout, "tokens")[0]
        program = self._forwards.get(size)
        if program is None:
            program = self._forwards[size] = self._compile_forward(layout)
        return program

    def _compile_forward(self, layout: step.Layout) -> jax.stages.Compiled:
        buffer = self._packed(layout.size)
        return step.forward.lower(self._abstract(self.params), self._abstract(self.cache),
                                  self._abstract(self.last_tokens), buffer, layout=layout, cfg=self.cfg,
                                  mesh=self.mesh, kernels=self.kernels,
                                  with_hidden=bool(self.num_speculative_tokens)).compile()

    def max_decode_steps(self, seqs: list) -> int:
        """Decode steps the running sequences `seqs` may run in one program: decode_steps when they are few enough
        and that program is compiled (it compiles beside its bucket's forward; a step never waits for it), else 1.
        On a GPU only the greedy / temperature-only sampler without logprobs is compiled into it ahead: other
        samplers take single steps rather than compile a whole forward on a request's path."""
        if not 0 < len(seqs) <= self.decode_steps_max_rows:
            return 1
        if self.mesh.devices.flat[0].platform != "cpu" and any(
                s.params.logprobs is not None or s.params.logit_bias or cut_path([s.params], self.vocab_size)
                for s in seqs):
            return 1
        size = step.bucket_for(len(seqs), self._ready or self.token_buckets)
        return self.decode_steps if size in self._decoders or self._ready is None else 1

    def _decode_program(self, layout: step.Layout, sampling_layout: step.Layout, path: int, top: int, steps: int):
        size = step.layout_shape(layout, "tokens")[0]
        compiled = self._decoders.get(size)
        if compiled is not None and (sampling_layout, path, top, steps) == (compiled[0], 0, 0, self.decode_steps):
            return compiled[1]
        return functools.partial(step.decode_steps, layout=layout, sampling_layout=sampling_layout, cfg=self.cfg,
                                 mesh=self.mesh, kernels=self.kernels, steps=steps, num_top_logprobs=top, path=path)

    def _compile_decoder(self, size: int) -> None:
        layout = self.step_inputs_for(size)[1]
        sampling_layout = self._padding_sampling(size)[1]
        buffer = self._packed(layout.size)
        sampling = self._packed(sampling_layout.size)
        self._decoders[size] = sampling_layout, step.decode_steps.lower(
            self._abstract(self.params), self._abstract(self.cache), self._abstract(self.last_tokens), buffer,
            sampling, layout=layout, sampling_layout=sampling_layout, cfg=self.cfg, mesh=self.mesh,
            kernels=self.kernels, steps=self.decode_steps, num_top_logprobs=0, path=0).compile()

    # ---- speculative decoding's programs --------------------------------------------------------------------
    def verify_inputs_for(self, size: int) -> tuple[np.ndarray, step.Layout]:
        """The packed inputs of a verify step of `size` padding tokens (no request: every write goes to the sinks)."""
        requests = step.request_bucket(size, self.max_num_seqs)
        batch = ragged([], [], [], [], size, requests, self.table_width)
        return step.pack_inputs(np.zeros(size, np.int32), batch, draft_source=np.zeros(requests, np.int32))

    def _verify_variants(self, size: int) -> list[tuple[int, int]]:
        """The verify programs of token bucket `size` compiled ahead: (drafts a row, rounds) of every row count whose
        verify step pads to that bucket; several rounds (max_verify_rounds) where decode steps run several a
        program."""
        variants = set()
        for rows in range(1, self.max_num_seqs + 1):
            k = self.drafts_at(rows)
            if not k or rows * (k + 1) > self.token_buckets[-1] or step.bucket_for(rows * (k + 1),
                                                                                 self.token_buckets) != size:
                continue
            variants.add((k, 1))
            if rows <= self.decode_steps_max_rows:
                variants.add((k, self.max_verify_rounds))
        return sorted(variants)

    def verify_rounds(self, rows: int, k: int) -> int:
        """The most rounds one verify program runs for `rows` rows of k drafts (max_verify_rounds where decode steps
        run several a program); 0 while its program is still compiling in the background (a step never waits for
        one)."""
        size = step.bucket_for(rows * (k + 1), self._ready or self.token_buckets)
        rounds = self.max_verify_rounds if 0 < rows <= self.decode_steps_max_rows else 1
        if self._ready is None:
            return rounds
        return next((r for r in (rounds, 1) if (size, k, r) in self._verifiers), 0)

    def _compile_speculation(self, size: int) -> None:
        """A model that speculates: the MTP head's program after a plain step of `size` tokens and the verify steps
        of that bucket (_verify_variants; greedy and temperature-only sampling, no logprobs: the common case; other
        samplers are jitted when first needed)."""
        replicated = step.replicated(self.mesh)
        params, cache = self._abstract(self.params), self._abstract(self.cache)
        last_tokens, drafts = self._abstract(self.last_tokens), self._abstract(self.drafts)
        layout = self.step_inputs_for(size)[1]
        hidden = jax.ShapeDtypeStruct((size, self.cfg.hidden_size), self.cfg.jnp_dtype, sharding=replicated)
        tokens = jax.ShapeDtypeStruct((size,), np.int32, sharding=replicated)
        self._drafters[size] = layout, step.draft_step.lower(
            params, cache, hidden, tokens, last_tokens, drafts, self._packed(layout.size), layout=layout,
            cfg=self.cfg, mesh=self.mesh, kernels=self.kernels, draft_len=self.num_speculative_tokens).compile()
        step_layout, layout = layout, self.verify_inputs_for(size)[1]
        sampling_layout = self._padding_sampling(size)[1]
        emitted = self._abstract(self.emitted)
        for k, rounds in self._verify_variants(size):
            self._verifiers[size, k, rounds] = sampling_layout, step.verify_step.lower(
                params, cache, last_tokens, drafts, emitted, self._packed(layout.size),
                self._packed(sampling_layout.size), layout=layout, sampling_layout=sampling_layout, cfg=self.cfg,
                mesh=self.mesh, kernels=self.kernels, draft_len=k, rounds=rounds, num_top_logprobs=0,
                path=0).compile()
            self._stager(layout.size)
        for inputs_layout in {step_layout, layout}:  # any step may follow a verify program still in flight
            buffer, sampling = self._packed(inputs_layout.size), self._packed(sampling_layout.size)
            self._behind_stagers[inputs_layout, sampling_layout] = step.stage_behind.lower(
                buffer, buffer, sampling, emitted, layout=inputs_layout, sampling_layout=sampling_layout).compile()

    def _drafter(self, layout: step.Layout):
        size = step.layout_shape(layout, "tokens")[0]
        compiled = self._drafters.get(size)
        if compiled is not None and compiled[0] == layout:
            return compiled[1]
        return functools.partial(step.draft_step, layout=layout, cfg=self.cfg, mesh=self.mesh, kernels=self.kernels,
                                 draft_len=self.num_speculative_tokens)

    def _verifier(self, layout: step.Layout, sampling_layout: step.Layout, path: int, top: int, draft_len: int,
                  rounds: int):
        size = step.layout_shape(layout, "tokens")[0]
        compiled = self._verifiers.get((size, draft_len, rounds))
        if compiled is not None and (sampling_layout, path, top) == (compiled[0], 0, 0):
            return compiled[1]
        return functools.partial(step.verify_step, layout=layout, sampling_layout=sampling_layout, cfg=self.cfg,
                                 mesh=self.mesh, kernels=self.kernels, draft_len=draft_len, rounds=rounds,
                                 num_top_logprobs=top, path=path)

    def _input_buffer(self, size: int) -> jax.Array:
        buffer = self._inputs.get(size)
        if buffer is None:
            buffer = self._inputs[size] = self._put(np.zeros(size, np.int32))
        return buffer

    def _sampler(self, layout: step.Layout, path: int, top: int, penalties: bool):
        """The sampler program of a batch: compiled ahead for the common variants (no penalties, bans or logprobs),
        jitted on first use for the others."""
        program = self._samplers.get((layout, path, top, penalties))
        if program is not None:
            return program
        return lambda logits, sampling, last_tokens, counts: step.sample_step(
            logits, sampling, last_tokens, counts, layout=layout, num_top_logprobs=top, path=path)

    def _compile_sampler(self, layout: step.Layout, path: int) -> None:
        requests = step.layout_shape(layout, "temperature")[0]
        logits = jax.ShapeDtypeStruct((requests, self.vocab_size), np.float32, sharding=step.replicated(self.mesh))
        sampling = self._packed(layout.size)
        self._samplers[layout, path, 0, False] = step.sample_step.lower(
            logits, sampling, self._abstract(self.last_tokens), None, layout=layout, num_top_logprobs=0,
            path=path).compile()

    def _padding_sampling(self, size: int) -> tuple[np.ndarray, step.Layout]:
        """The packed sampling tensors of a step of `size` padding tokens (every row greedy)."""
        tensors = SamplingTensors.build_host([], [], vocab_size=self.vocab_size,
                                             batch_size=step.request_bucket(size, self.max_num_seqs),
                                             num_penalty_rows=self.num_slots)
        return step.pack(tensors._asdict())

    def compile(self, sizes: list[int], threads: int | None = None) -> None:
        """Compile the forwards of the token buckets `sizes` not compiled yet and the greedy and top-k samplers of
        their request counts, `threads` at a time, logging each bucket as it is done."""
        todo = [size for size in sizes if size not in self._forwards]
        threads = threads or COMPILE_THREADS
        start = time.perf_counter()

        def compile_one(size: int) -> None:
            began = time.perf_counter()
            inputs_layout = self.step_inputs_for(size)[1]
            self._forwards[size] = self._compile_forward(inputs_layout)
            self._stager(inputs_layout.size)
            layout = self._padding_sampling(size)[1]
            for path in (0, 1):
                if (layout, path, 0, False) not in self._samplers:
                    self._compile_sampler(layout, path)
            if self.num_speculative_tokens and size not in self._drafters:
                self._compile_speculation(size)
            if size in self.decode_buckets and size not in self._decoders:
                try:
                    self._compile_decoder(size)
                except Exception:  # serving goes on one decode step a program
                    log.exception("the %d-step decode program of %d tokens failed to compile; decode steps run one "
                                  "a program", self.decode_steps, size)
                    self.decode_steps_max_rows = 0
            if self._ready is not None:
                self._to_run.append(size)
            log.info("compiled the step of %d tokens in %.1fs (%d of %d, %.1fs in all)", size,
                     time.perf_counter() - began, sum(s in self._forwards for s in todo), len(todo),
                     time.perf_counter() - start)

        if todo:
            with ThreadPoolExecutor(max(1, min(len(todo), threads))) as pool:
                list(pool.map(compile_one, todo))

    def fetch(self, out: SampleOutput) -> SampleOutput:
        """A step's sampled tokens and logprobs on the host: the one place the engine waits for the device."""
        waited = time.perf_counter()
        values = jax.device_get(tuple(out))
        # a replica on other hosts sends a plain list back: its length tells a verify step's output from a step's
        kind = type(out) if hasattr(out, "_fields") else (
            VerifyOutput if len(values) == len(VerifyOutput._fields) else SampleOutput)
        host = kind(*values)
        self.device_wait_seconds += time.perf_counter() - waited
        return host

    def step_inputs_for(self, size: int) -> tuple[np.ndarray, step.Layout]:
        """The packed inputs of a step of `size` padding tokens (no request: every write goes to the sinks)."""
        requests = step.request_bucket(size, self.max_num_seqs)
        batch = ragged([], [], [], [], size, requests, self.table_width)
        return step.pack_inputs(np.zeros(size, np.int32), batch, following=self._following([], requests))

    def warmup(self, first: list[int], max_pairs: int, background: list[int] = ()) -> None:
        """Compile the steps of the token buckets `first` (several at once), run each once on padding (run_padding),
        and the snapshot copies of up to `max_pairs` pairs; then compile the buckets `background` on a thread of
        their own while the engine serves with those compiled and run so far (each runs once in run_compiled,
        when the engine is idle). Through the executor, so other hosts compile and run them too."""
        self.executor([("compile", list(first))])
        for size in first:
            self.run_padding(size)
        if self.has_snapshots:
            for n in sorted({bucket(k) for k in range(1, max_pairs + 1)}):
                self.executor([("restore", *self._pairs([(0, 0)] * n)), ("save", *self._pairs([(0, 0)] * n))])
        jax.block_until_ready(self.cache)
        rest = [size for size in background if size not in self._forwards]
        if rest:
            self._ready = sorted(self._forwards)
            self._compile_start = time.perf_counter()
            self._compiling = threading.Thread(target=self._compile_rest, args=(rest,), daemon=True,
                                               name="qwen-jax-compile")
            self._compiling.start()

    def run_padding(self, size: int) -> None:
        """Run the compiled programs of token bucket `size` once on padding only (no request: every write goes to
        the sinks, KV block 0, state slot 0) and wait for them. Overwrites last_tokens: only while no sequence
        runs."""
        buffer, layout = self.step_inputs_for(size)
        sampling, sampling_layout = self._padding_sampling(size)
        for path in (0, 1):
            jax.block_until_ready(self.executor([("step", buffer, layout, sampling, sampling_layout, path, 0, False,
                                                  bool(self.num_speculative_tokens), False)]))
        if size in self._decoders:
            jax.block_until_ready(self.executor([("decode_steps", buffer, layout, sampling, sampling_layout, 0, 0,
                                                  self.decode_steps, False)]))
        # a model that speculates: its verify programs, and each kind of step caught up on one (padding: no row is
        # behind, so nothing moves)
        for k, rounds in self._verify_variants(size) if self.num_speculative_tokens else ():
            jax.block_until_ready(self.executor([("verify", *self.verify_inputs_for(size), sampling, sampling_layout,
                                                  0, 0, k, rounds, True)]))
        if self.num_speculative_tokens:
            jax.block_until_ready(self.executor([("step", buffer, layout, sampling, sampling_layout, 0, 0, False,
                                                  True, True)]))

    def run_compiled(self) -> bool:
        """Give one bucket compiled in the background its first run (run_padding), then let steps use it; the
        engine calls this only while no sequence runs. Whether one ran."""
        if self._ready is None:
            return False
        ran = bool(self._to_run)
        if ran:
            size = self._to_run.pop(0)
            self.run_padding(size)
            self._ready = sorted({*self._ready, size})
        if not self._to_run and not self._compiling.is_alive():
            self._ready = None
            log.info("every step bucket is compiled and has run once (%.1fs after the warm-up)",
                     time.perf_counter() - self._compile_start)
        return ran

    def _compile_rest(self, sizes: list[int]) -> None:
        self.compile(sizes, threads=BACKGROUND_COMPILE_THREADS)
        log.info("the background compile is done (%.1fs)", time.perf_counter() - self._compile_start)
