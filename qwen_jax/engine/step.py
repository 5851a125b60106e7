"""The compiled programs of an engine step: the forward (embedding, every layer, final norm and LM head over the
step's flat ragged batch), the sampler, and the small copies around them (prefix-cache snapshots, penalty counts).

Pure functions of explicit pytrees, jitted with the caches donated; the host sends each step's inputs as one packed
int32 buffer (one transfer). Never decides who runs (the scheduler does) and never reads a device value back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen_jax.config import FULL_ATTENTION, ModelConfig
from qwen_jax.engine.sampler import (
    SampleOutput,
    SamplingTables,
    SamplingTensors,
    init_penalty_rows,
    next_step,
    sample,
    write_rows,
)
from qwen_jax.engine.speculative import VerifyOutput, verify
from qwen_jax.layers.batch import Ragged
from qwen_jax.models import decoder
from qwen_jax.models.mtp import mtp_forward, next_tokens_in_request
from sharding import rules
from sharding.partitioned_ops import ops_for_mesh

# Excess precision off: every rounding to bf16 that the layers write (where HF rounds) really happens.
EXACT = {"xla_allow_excess_precision": False}


# ---- packed host inputs ----------------------------------------------------------------------------------------------
class Layout(NamedTuple):
    """Where each array sits in a packed buffer: (name, dtype, shape, offset) each; hashable (a static argument)."""

    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]
    size: int


def pack(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, Layout]:
    """Host arrays (int32, uint32, float32 or bool) -> one int32 buffer and its layout: one host-to-device copy a
    step instead of one per array."""
    entries, parts, offset = [], [], 0
    for name, array in arrays.items():
        array = np.asarray(array)
        if array.dtype == np.bool_:
            flat = array.astype(np.int32).reshape(-1)
        elif array.dtype in (np.int32, np.uint32, np.float32):
            flat = array.reshape(-1).view(np.int32)
        else:
            raise TypeError(f"pack: {name} has dtype {array.dtype}")
        entries.append((name, array.dtype.str, array.shape, offset))
        parts.append(flat)
        offset += flat.size
    return np.concatenate(parts) if parts else np.zeros(0, np.int32), Layout(tuple(entries), offset)


def layout_shape(layout: Layout, name: str) -> tuple[int, ...]:
    return next(tuple(shape) for entry, _, shape, _ in layout.entries if entry == name)


def as_layout(layout) -> Layout:
    """A Layout again after a trip through a multi-host op list (JSON turns its tuples into lists: from_wire)."""
    entries, size = layout
    return Layout(tuple((name, dtype, tuple(shape), offset) for name, dtype, shape, offset in entries), size)


# ---- the ops of a step -----------------------------------------------------------------------------------------
# What ModelRunner.prepare writes and ModelRunner.execute runs, in order: host data only (numpy arrays and plain
# values). A multi-host leader sends them to the other hosts as `to_wire` tuples (kind, *fields).

@dataclasses.dataclass(frozen=True)
class _Batch:
    """The fields of an op that runs the model over a step's rows: the packed inputs and sampling tensors with their
    layouts, the sampler's cut path (sampler.cut_path) and top-logprobs width, and `behind`: some row catches up on
    the verify program before it (stage_behind)."""

    inputs: np.ndarray
    layout: Layout
    sampling: np.ndarray
    sampling_layout: Layout
    path: int
    top: int


@dataclasses.dataclass(frozen=True)
class Forward(_Batch):
    """One forward and the sampler; `head`: also the MTP head's pages and first drafts (StepPlan.head)."""

    head: bool
    behind: bool
    KIND: ClassVar[str] = "step"


@dataclasses.dataclass(frozen=True)
class DecodeSteps(_Batch):
    """`steps` decode steps of every row in one program."""

    steps: int
    behind: bool
    KIND: ClassVar[str] = "decode_steps"


@dataclasses.dataclass(frozen=True)
class Verify(_Batch):
    """Speculative decoding's `rounds` verify rounds of `draft_len` drafts a row in one program."""

    draft_len: int
    rounds: int
    behind: bool
    KIND: ClassVar[str] = "verify"


@dataclasses.dataclass(frozen=True)
class RestoreSnapshots:
    """Copy prefix-cache snapshots `src` into state slots `dst` (padding pairs copy into the sinks)."""

    src: np.ndarray
    dst: np.ndarray
    KIND: ClassVar[str] = "restore"


@dataclasses.dataclass(frozen=True)
class SaveSnapshots:
    """Copy state slots `src` into prefix-cache snapshots `dst`."""

    src: np.ndarray
    dst: np.ndarray
    KIND: ClassVar[str] = "save"


@dataclasses.dataclass(frozen=True)
class ResetPenalties:
    """The penalty counts of sequences entering the batch, from their tokens so far (padding rows name none)."""

    rows: np.ndarray
    ids: np.ndarray
    num_prompt: np.ndarray
    num_tokens: np.ndarray
    KIND: ClassVar[str] = "penalties"


@dataclasses.dataclass(frozen=True)
class WriteRows:
    """Rows `rows` of the sampling table `table` ("bias", "banned" or "masks": sampler.SamplingTables) set to `values`
    (padding rows name none): a request's logit bias and banned tokens as it enters the batch, a constrained
    request's grammar mask before each of its steps."""

    table: str
    rows: np.ndarray
    values: np.ndarray
    KIND: ClassVar[str] = "table"


@dataclasses.dataclass(frozen=True)
class CompileBuckets:
    """Compile every program of these token buckets (other hosts compile what host 0 does)."""

    sizes: list[int]
    KIND: ClassVar[str] = "compile"


Op = Forward | DecodeSteps | Verify | RestoreSnapshots | SaveSnapshots | ResetPenalties | WriteRows | CompileBuckets
_OPS = {cls.KIND: cls for cls in (Forward, DecodeSteps, Verify, RestoreSnapshots, SaveSnapshots, ResetPenalties,
                                  WriteRows, CompileBuckets)}


def to_wire(op: Op) -> tuple:
    """An op as the other hosts receive it: (kind, *fields in order)."""
    return (op.KIND, *(getattr(op, f.name) for f in dataclasses.fields(op)))


def from_wire(item: list | tuple) -> Op:
    """to_wire's inverse (after multihost.pack / unpack, which turn a Layout's tuples into lists)."""
    kind, *fields = item
    if kind not in _OPS:
        raise ValueError(f"unknown step op {kind!r}")
    op = _OPS[kind](*fields)
    if isinstance(op, _Batch):
        op = dataclasses.replace(op, layout=as_layout(op.layout), sampling_layout=as_layout(op.sampling_layout))
    return op


def unpack(buffer: jax.Array, layout: Layout) -> dict[str, jax.Array]:
    """pack's inverse inside a program (static slices and bitcasts: no copies of consequence)."""
    out = {}
    for name, dtype, shape, offset in layout.entries:
        flat = buffer[offset:offset + math.prod(shape)]
        dtype = np.dtype(dtype)
        if dtype == np.bool_:
            flat = flat != 0
        elif dtype != np.int32:
            flat = jax.lax.bitcast_convert_type(flat, dtype)
        out[name] = flat.reshape(shape)
    return out


RAGGED_KEYS = Ragged._fields


def sample_index(batch: Ragged) -> np.ndarray:
    """Each request's last token, whose logits the step computes (0 for padding requests)."""
    return np.maximum(np.asarray(batch.query_start) + np.asarray(batch.query_len) - 1, 0).astype(np.int32)


class Behind(NamedTuple):
    """For each request of a step planned while a verify program is still in flight (a model that speculates): how
    far the host's count of its tokens runs ahead of the truth. The host books every draft of that program as
    computed and each of its rounds as one sample; the program emits between the two. `stage_behind` corrects the
    step's positions and seeded counters on the device from what that program emitted (its `emitted` [S])."""

    row: np.ndarray  # [R] i32 the request's row in the verify program in flight; -1: none (its counts are exact)
    booked: np.ndarray  # [R] i32 tokens that program booked for it as computed: rounds x (drafts + 1)
    counted: np.ndarray  # [R] i32 of its output tokens, those the host counted: one a round

    @classmethod
    def none(cls, num_requests: int) -> Behind:
        return cls(np.full(num_requests, -1, np.int32), *np.zeros((2, num_requests), np.int32))


def pack_inputs(tokens: np.ndarray, batch: Ragged, token_source: np.ndarray | None = None,
                following: np.ndarray | None = None, draft_source: np.ndarray | None = None,
                behind: Behind | None = None) -> tuple[np.ndarray, Layout]:
    """A forward's packed inputs: the tokens [T], where each comes from (token_source, see `forward`; None: all from
    `tokens`), the Ragged fields and each request's sample index; for a model that speculates, `following` [R]
    (draft_step) after a plain step, or each request's row of the drafts array `draft_source` [R] (verify_step), and
    `behind` (None: no request is behind)."""
    if token_source is None:
        token_source = np.full(len(tokens), -1, np.int32)
    extra = {name: np.asarray(value, np.int32) for name, value in
             (("following", following), ("draft_source", draft_source)) if value is not None}
    if following is not None or draft_source is not None:
        behind = behind or Behind.none(len(batch.query_len))
        extra.update({f"behind_{name}": np.asarray(value, np.int32) for name, value in behind._asdict().items()})
    return pack(dict(tokens=np.asarray(tokens, np.int32), token_source=token_source, **batch._asdict(),
                     sample_index=sample_index(batch), **extra))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ---- the forward ----------------------------------------------------------------------------------------------------
def step_batch(buffer: jax.Array, layout: Layout, last_tokens: jax.Array) -> tuple[jax.Array, Ragged, jax.Array]:
    """A step's packed inputs: (tokens [T], each a row of the previous step's sampled tokens `last_tokens` where its
    token_source is >= 0; the Ragged; sample_index [R])."""
    a = unpack(buffer, layout)
    source = a["token_source"]
    tokens = jnp.where(source >= 0, last_tokens[jnp.maximum(source, 0)], a["tokens"])
    return tokens, Ragged(**{k: a[k] for k in RAGGED_KEYS}), a["sample_index"]


def sampling_tensors(buffer: jax.Array, layout: Layout) -> SamplingTensors:
    return SamplingTensors(**unpack(buffer, layout))


@functools.partial(jax.jit, static_argnames=("layout", "cfg", "mesh", "kernels", "with_hidden"),
                   donate_argnames=("cache",), compiler_options=EXACT)
def forward(params: dict, cache: dict, last_tokens: jax.Array, buffer: jax.Array, *, layout: Layout,
            cfg: ModelConfig, mesh: Mesh, kernels: str, with_hidden: bool = False) -> tuple:
    """One step's forward: (float32 logits [R, V] of each request's last token, the updated cache); `kernels`: the
    hot ops' implementation (qwen_jax/layers/hot_ops.py). with_hidden (a model that speculates): also every token's
    final hidden state [T, H] and the tokens [T], the MTP head's inputs (draft_step).
    buffer (packed): tokens [T] with token_source [T] (>= 0: the token is that row of the previous step's sampled
    tokens `last_tokens`, still on the device; -1: tokens[t]), the Ragged fields, sample_index [R]."""
    tokens, batch, sample_index = step_batch(buffer, layout, last_tokens)
    out = decoder.forward(params, cache, tokens, batch, cfg, ops_for_mesh(cfg, mesh, kernels), sample_index,
                          return_hidden=with_hidden)
    logits, cache = jax.lax.with_sharding_constraint(out[0], replicated(mesh)), rules.constrain_cache(cfg, mesh, out[1])
    if not with_hidden:
        return logits, cache
    return logits, cache, *jax.lax.with_sharding_constraint((out[2], tokens), replicated(mesh))


# ---- several decode steps in one program -----------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("layout", "sampling_layout", "cfg", "mesh", "kernels", "steps",
                                             "num_top_logprobs", "path"),
                   donate_argnames=("cache", "last_tokens", "tables"), compiler_options=EXACT)
def decode_steps(params: dict, cache: dict, last_tokens: jax.Array, tables: SamplingTables, buffer: jax.Array,
                 sampling: jax.Array, *, layout: Layout, sampling_layout: Layout, cfg: ModelConfig, mesh: Mesh,
                 kernels: str, steps: int, num_top_logprobs: int, path: int
                 ) -> tuple[SampleOutput, dict, jax.Array, SamplingTables]:
    """`steps` decode steps of a batch of one-token requests, each step's sampled tokens the next one's inputs, in
    one program: one call from the host for several tokens, where a small batch's step costs the host more to issue
    than the GPU to run. The forward and the sampler of a step are those of `forward` and `sample_step`, and a row
    draws as it would over that many single steps (sampler.next_step: its key, its min_tokens clock; its penalty
    counts updated every step). Returns (SampleOutput with a leading axis of steps, the cache, last_tokens holding
    the last step's tokens, the tables)."""
    tokens, batch, sample_index = step_batch(buffer, layout, last_tokens)
    tensors = sampling_tensors(sampling, sampling_layout)
    live = batch.query_len > 0
    # each request's one token sits at its sample index; a padding request's sample goes nowhere
    at = jnp.where(live, sample_index, tokens.shape[0])
    ops = ops_for_mesh(cfg, mesh, kernels)

    def one(j, carry):
        cache, tables, tokens, outs = carry
        moved = batch._replace(positions=batch.positions + j * batch.token_valid,
                               context_len=batch.context_len + j * live)
        logits, cache = decoder.forward(params, cache, tokens, moved, cfg, ops, sample_index)
        logits = jax.lax.with_sharding_constraint(logits, replicated(mesh))
        out, tables = sample(logits, next_step(tensors, j), tables, num_top_logprobs=num_top_logprobs, path=path)
        outs = jax.tree.map(lambda stacked, new: stacked.at[j].set(new), outs, out)
        return cache, tables, tokens.at[at].set(out.tokens, mode="drop"), outs

    requests = batch.query_len.shape[0]
    outs = SampleOutput(jnp.zeros((steps, requests), jnp.int32), jnp.zeros((steps, requests), jnp.float32),
                        jnp.zeros((steps, requests, num_top_logprobs), jnp.int32),
                        jnp.zeros((steps, requests, num_top_logprobs), jnp.float32))
    cache, tables, _, outs = jax.lax.fori_loop(0, steps, one, (cache, tables, tokens, outs))
    return (outs, rules.constrain_cache(cfg, mesh, cache), last_tokens.at[:requests].set(outs.tokens[steps - 1]),
            tables)


# ---- speculative decoding ------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("layout", "sampling_layout", "cfg", "mesh", "kernels", "draft_len",
                                             "rounds", "num_top_logprobs", "path"),
                   donate_argnames=("cache", "last_tokens", "drafts", "emitted", "tables"), compiler_options=EXACT)
def verify_step(params: dict, cache: dict, last_tokens: jax.Array, drafts: jax.Array, emitted: jax.Array,
                tables: SamplingTables, buffer: jax.Array, sampling: jax.Array, *, layout: Layout,
                sampling_layout: Layout, cfg: ModelConfig, mesh: Mesh, kernels: str, draft_len: int, rounds: int,
                num_top_logprobs: int, path: int
                ) -> tuple[VerifyOutput, dict, jax.Array, jax.Array, jax.Array, SamplingTables]:
    """`rounds` rounds of speculative decoding over decoding requests in one program. In each, a request runs its
    last token (at first from the host or `last_tokens`, as in `forward`; then the last one it emitted) and
    draft_len drafts (at first the first draft_len of row draft_source[r] of `drafts` [S, D]; then the head's) as
    draft_len + 1 query tokens after every token it emitted before; the round verifies them
    (engine/speculative.py), sets every recurrent state to the request's last emitted token and has the head
    propose D drafts for the next. A round costs the host nothing: one call for several, where a small batch's
    step costs the host more to issue than the GPU to run (tokens past a request's end are computed and dropped).
    Returns (VerifyOutput with each request's emitted tokens first in its row [R, rounds * (draft_len + 1)] and
    num_emitted [R, rounds] each round's count, 0 for padding requests; the cache; last_tokens with row r the
    request's last emitted token; drafts with row r its next drafts; `emitted` [S] with row r its tokens emitted in
    all rounds, which the next step, planned before this one is read back, catches up by: stage_behind; the tables
    with the emitted tokens counted)."""
    tokens, batch, _ = step_batch(buffer, layout, last_tokens)
    draft_source = unpack(buffer, layout)["draft_source"]
    requests, size = batch.query_len.shape[0], tokens.shape[0]
    live = batch.query_len > 0
    rows = jnp.arange(requests)
    within = jnp.arange(draft_len + 1)[None, :]
    at = batch.query_start[:, None] + within  # [R, draft_len + 1]: each request's tokens on the token axis
    to = jnp.where(live[:, None], at, size)  # the same, padding requests' dropped
    tensors = sampling_tensors(sampling, sampling_layout)
    ops = ops_for_mesh(cfg, mesh, kernels)
    width = rounds * (draft_len + 1)

    def one(i, carry):
        cache, tables, last, proposed, emitted_before, out = carry
        step_tokens = tokens.at[to[:, 0]].set(last, mode="drop").at[to[:, 1:]].set(proposed[:, :draft_len],
                                                                                    mode="drop")
        moved = batch._replace(positions=batch.positions + emitted_before[batch.token_request] * batch.token_valid,
                               context_len=batch.context_len + emitted_before)
        logits, cache, hidden, pending = decoder.forward(params, cache, step_tokens, moved, cfg, ops,
                                                         return_hidden=True, draft_len=draft_len)
        logits = jax.lax.with_sharding_constraint(logits[jnp.where(live[:, None], at, 0)], replicated(mesh))
        # each position draws as the output token it is: the row's count so far, as plain decoding
        verified, counts = verify(logits, proposed[:, :draft_len], next_step(tensors, emitted_before), tables,
                                  num_top_logprobs=num_top_logprobs, path=path)
        tables = tables._replace(counts=counts)
        emitted = jnp.where(live, verified.num_emitted, 0)
        cache = decoder.commit_verified_layers(cache, pending, moved, emitted, ops)
        last = verified.tokens[rows, jnp.maximum(emitted - 1, 0)]
        # the head's tokens: each verified token's successor, the token emitted after it (0 past the emitted ones)
        following = jnp.zeros(size, jnp.int32).at[to].set(jnp.maximum(verified.tokens, 0), mode="drop")
        proposed, cache = draft(params, cache, hidden, following, jnp.where(live, batch.query_start + emitted - 1, 0),
                                live, moved, cfg, ops, drafts.shape[1], draft_len)
        place = jnp.where(within < emitted[:, None], emitted_before[:, None] + within, width)  # after earlier rounds'
        out = VerifyOutput(
            out.tokens.at[rows[:, None], place].set(verified.tokens, mode="drop"),
            out.num_emitted.at[:, i].set(emitted),
            out.logprobs.at[rows[:, None], place].set(verified.logprobs, mode="drop"),
            out.top_ids.at[rows[:, None], place].set(verified.top_ids, mode="drop"),
            out.top_logprobs.at[rows[:, None], place].set(verified.top_logprobs, mode="drop"))
        return cache, tables, last, proposed, emitted_before + emitted, out

    out = VerifyOutput(jnp.full((requests, width), -1, jnp.int32), jnp.zeros((requests, rounds), jnp.int32),
                       jnp.zeros((requests, width), jnp.float32),
                       jnp.zeros((requests, width, num_top_logprobs), jnp.int32),
                       jnp.zeros((requests, width, num_top_logprobs), jnp.float32))
    carry = (cache, tables, tokens[batch.query_start], drafts[draft_source], jnp.zeros(requests, jnp.int32), out)
    cache, tables, last, proposed, total, out = jax.lax.fori_loop(0, rounds, one, carry)
    return (out, rules.constrain_cache(cfg, mesh, cache), last_tokens.at[:requests].set(last),
            drafts.at[:requests].set(proposed), emitted.at[:requests].set(total), tables)


@functools.partial(jax.jit, static_argnames=("layout", "cfg", "mesh", "kernels", "draft_len"),
                   donate_argnames=("cache", "drafts"), compiler_options=EXACT)
def draft_step(params: dict, cache: dict, hidden: jax.Array, tokens: jax.Array, last_tokens: jax.Array,
               drafts: jax.Array, buffer: jax.Array, *, layout: Layout, cfg: ModelConfig, mesh: Mesh, kernels: str,
               draft_len: int) -> tuple[dict, jax.Array]:
    """After a plain step of a model that speculates (forward with_hidden, then the sampler): the MTP head over the
    step's tokens, so its KV pages cover every position a later draft attends to, and the first drafts of each
    request that sampled (into its row of `drafts`). `buffer`: the forward's, with `following` [R] (the prompt's
    next token after a chunk that ends inside it; -1 after a sampled token, the sampler's row of last_tokens).
    Returns (the cache with the head's pages written, drafts)."""
    a = unpack(buffer, layout)
    batch = Ragged(**{k: a[k] for k in RAGGED_KEYS})
    requests = batch.query_len.shape[0]
    live = batch.query_len > 0
    after = jnp.where(a["following"] < 0, last_tokens[:requests], a["following"])
    new, cache = draft(params, cache, hidden, next_tokens_in_request(tokens, batch, after), a["sample_index"], live,
                       batch, cfg, ops_for_mesh(cfg, mesh, kernels), draft_len)
    rows = jnp.where(live & (a["following"] < 0), jnp.arange(requests), drafts.shape[0])
    return rules.constrain_cache(cfg, mesh, cache), drafts.at[rows].set(new, mode="drop")


def draft(params: dict, cache: dict, hidden: jax.Array, following: jax.Array, last: jax.Array, live: jax.Array,
          batch: Ragged, cfg: ModelConfig, ops, num_drafts: int, draft_len: int = 0) -> tuple[jax.Array, dict]:
    """The MTP head's next num_drafts drafts for each request (models/mtp.py), greedy (its argmax: the one-hot
    proposals engine/speculative.py verifies against). First over every token of the step (draft_len > 0: verify
    rows of draft_len + 1 tokens), each paired with the token that followed it (`following` [T]; the head's KV
    pages are then those of the sequence, a rejected position's overwritten later), the first draft read at each
    request's last token `last` [R]; then one token a request at the next positions, each fed the draft before it
    and the head's own output. Returns (drafts [R, num_drafts], the cache with the head's pages written)."""
    requests = last.shape[0]
    logits, out, cache = mtp_forward(params, cache, hidden, following, batch, cfg, ops, last, draft_len)
    drafts = [jnp.argmax(logits, axis=-1).astype(jnp.int32)]
    hidden = out[last]
    position = batch.positions[last]  # the position of the hidden state the first draft was read at
    rows = jnp.arange(requests, dtype=jnp.int32)
    for _ in range(num_drafts - 1):
        position = position + 1
        one = Ragged(positions=jnp.where(live, position, 0), token_request=rows, token_valid=live, query_start=rows,
                     query_len=live.astype(jnp.int32), context_len=jnp.where(live, position + 1, 0),
                     state_slot=batch.state_slot, fresh=jnp.zeros_like(live), block_table=batch.block_table)
        logits, hidden, cache = mtp_forward(params, cache, hidden, drafts[-1], one, cfg, ops)
        drafts.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return jnp.stack(drafts, axis=1), cache


# ---- the sampler ----------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("layout", "num_top_logprobs", "path"),
                   donate_argnames=("last_tokens", "tables"))
def sample_step(logits: jax.Array, buffer: jax.Array, last_tokens: jax.Array, tables: SamplingTables, *,
                layout: Layout, num_top_logprobs: int, path: int
                ) -> tuple[SampleOutput, jax.Array, SamplingTables]:
    """Sample each request's next token (engine/sampler.py) from the forward's logits, with the SamplingTensors
    packed in `buffer`. Returns (SampleOutput [R], last_tokens with its first R rows these tokens, for the next
    step's forward, the tables with the penalised rows' tokens counted). last_tokens is written in place."""
    tensors = sampling_tensors(buffer, layout)
    out, tables = sample(logits, tensors, tables, num_top_logprobs=num_top_logprobs, path=path)
    return out, last_tokens.at[:out.tokens.shape[0]].set(out.tokens), tables


@functools.partial(jax.jit, donate_argnames=("tables",))
def reset_penalties(tables: SamplingTables, rows: jax.Array, token_ids: jax.Array, num_prompt: jax.Array,
                    num_tokens: jax.Array) -> SamplingTables:
    """The penalty counts of sequences entering the batch (sampler.init_penalty_rows)."""
    return tables._replace(counts=init_penalty_rows(tables.counts, rows, token_ids, num_prompt, num_tokens))


@functools.partial(jax.jit, static_argnames=("table",), donate_argnames=("tables",))
def write_table(tables: SamplingTables, rows: jax.Array, values: jax.Array, *, table: str) -> SamplingTables:
    """Rows `rows` of one table ("bias", "banned" or "masks") set to `values` (padding rows name none)."""
    return tables._replace(**{table: write_rows(getattr(tables, table), rows, values)})


@functools.partial(jax.jit, donate_argnames=("inputs",))
def stage_inputs(inputs: jax.Array, new: jax.Array) -> jax.Array:
    """A step's inputs copied into the bucket's input buffer, in place. XLA runs a program's kernels as CUDA graphs
    and re-records a graph whenever a buffer it reads has moved; every layer reads the inputs, so a fresh input
    buffer each step re-recorded them all (H200, one-token step of 35B-A3B: 5.4 ms of host time a step instead of
    about 9 ms)."""
    return inputs.at[:].set(new)


@functools.partial(jax.jit, static_argnames=("layout", "sampling_layout"), donate_argnames=("inputs",))
def stage_behind(inputs: jax.Array, new: jax.Array, sampling: jax.Array, emitted: jax.Array, *, layout: Layout,
                 sampling_layout: Layout) -> tuple[jax.Array, jax.Array]:
    """stage_inputs for a step planned while a verify program was still in flight, which therefore counted each
    request of it as `Behind` says: (the inputs buffer with each such request's positions and context length moved
    back by the drafts that program rejected, the sampling buffer with a seeded request's counter moved on, and its
    min_tokens clock run down, by the tokens it emitted past one a round). `emitted` [S]: each row's tokens emitted
    by that program (verify_step's)."""
    a = unpack(new, layout)
    behind = a["behind_row"] >= 0
    made = emitted[jnp.maximum(a["behind_row"], 0)]
    over = jnp.where(behind, a["behind_booked"] - made, 0)  # positions booked past the request's real next one
    new = _replace(new, layout, "positions", a["positions"] - over[a["token_request"]] * a["token_valid"])
    new = _replace(new, layout, "context_len", a["context_len"] - over)
    s = unpack(sampling, sampling_layout)
    late = jnp.where(behind, made - a["behind_counted"], 0)  # output tokens not counted yet
    rng = s["rng"].at[:, 2].add(late.astype(jnp.uint32) * s["rng_step"][:, 2])  # a seeded row's counter (unseeded:
    # step 0 there)
    sampling = _replace(sampling, sampling_layout, "rng", rng)
    return inputs.at[:].set(new), _replace(sampling, sampling_layout, "ban_until", s["ban_until"] - late)


def _replace(buffer: jax.Array, layout: Layout, name: str, value: jax.Array) -> jax.Array:
    """`buffer` (packed) with its array `name` set to `value`, inside a program."""
    _, _, shape, offset = next(entry for entry in layout.entries if entry[0] == name)
    flat = value.reshape(-1)
    if flat.dtype != jnp.int32:
        flat = jax.lax.bitcast_convert_type(flat, jnp.int32)
    return buffer.at[offset:offset + math.prod(shape)].set(flat)


# ---- prefix-cache snapshots -----------------------------------------------------------------------------------------
def gdn_indices(cfg: ModelConfig) -> list[int]:
    return [i for i, kind in enumerate(cfg.layer_types) if kind != FULL_ATTENTION]


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), donate_argnames=("cache",))
def restore_snapshots(cache: dict, snapshots: list, src: jax.Array, dst: jax.Array, *, cfg: ModelConfig,
                      mesh: Mesh) -> dict:
    """cache slots[dst] <- snapshots[src] for every recurrent layer (padding pairs write slot 0, the sink)."""
    layers = list(cache["layers"])
    for i, snap in zip(gdn_indices(cfg), snapshots, strict=True):
        layers[i] = rules.constrain_cache_layer(
            cfg, mesh, i, {k: v.at[dst].set(snap[k][src]) for k, v in layers[i].items()})
    return {**cache, "layers": layers}


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), donate_argnames=("snapshots",))
def save_snapshots(cache: dict, snapshots: list, src: jax.Array, dst: jax.Array, *, cfg: ModelConfig,
                   mesh: Mesh) -> list:
    """snapshots[dst] <- cache slots[src] (padding pairs write snapshot 0, the sink)."""
    return [rules.constrain_cache_layer(cfg, mesh, i, {k: v.at[dst].set(cache["layers"][i][k][src])
                                                       for k, v in snap.items()})
            for i, snap in zip(gdn_indices(cfg), snapshots, strict=True)]
