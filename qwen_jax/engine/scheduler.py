"""Scheduler: decides which sequences run in the next step and how many of their tokens (continuous batching,
chunked prefill under a token budget, recompute preemption, prefix-cache admission), and applies a step's output
once it is read back (tokens, stops, counters): the one writer of sequence state.

Host-side only: it hands out KV blocks and state slots, returns a plan and takes back sampled tokens as host data; it
never touches device arrays. A planned step counts as done at once (its tokens computed, its samples pending), so the
next step can be planned while the device still runs this one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterable

from qwen_jax.engine.memory import BlockPool, SlotPool
from qwen_jax.engine.prefix_cache import PrefixCache, block_hashes, snapshot_boundary
from qwen_jax.engine.programs import Shapes
from qwen_jax.engine.sampler import SampleOutput
from qwen_jax.engine.sequence import CoreOutput, Sequence, Status
from qwen_jax.engine.speculative import MAX_DRAFTS, DraftPolicy, VerifyOutput
from qwen_jax.outputs import TokenLogprob

log = logging.getLogger("qwen_jax")


@dataclasses.dataclass
class Row:
    """One sequence's share of a step: run tokens [start, start + num_tokens) of seq.token_ids."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool = False  # the row's last token produces the sequence's next token
    steps: int = 1  # decode steps (or verify rounds) this row runs in the step's program, each after the one before
    drafts: int = 0  # speculative decoding: the row is its last token and this many drafts, verified in the step
    admitted: bool = False  # the sequence (re)enters the running set in this step
    restore_snapshot: int | None = None  # copy this snapshot into the seq's slot before the step
    save_snapshot: int | None = None  # copy the seq's slot into this snapshot after the step


@dataclasses.dataclass
class StepPlan:
    rows: list[Row]
    preempted: list[Sequence]
    head: bool = False  # a plain step of a model that speculates: the MTP head runs after it (drafts, its KV pages)

    @property
    def empty(self) -> bool:
        return not self.rows


class Scheduler:
    def __init__(self, blocks: BlockPool, slots: SlotPool, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_cache: PrefixCache | None = None, max_model_len: int | None = None,
                 speculation: DraftPolicy | None = None, programs: Shapes | None = None,
                 eos_token_ids: Iterable[int] = ()):
        """`slots`: one per running sequence (its recurrent state, its rows of the sampling tables); `speculation`:
        the policy that picks the drafts decoding rows verify (None: the model does not speculate); `programs`: the
        shapes of the replica's programs, which say how many decode steps or verify rounds one program runs (None:
        one); `eos_token_ids`: the tokens that end a request (once its min_tokens are out, unless it ignores EOS)."""
        self.blocks = blocks
        self.slots = slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.max_model_len = max_model_len
        self.speculation = speculation
        self.programs = programs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # counters since the start, for the metrics: preemptions, output tokens; speculative decoding: rows verified,
        # drafts proposed to them, drafts accepted (acceptance length: 1 + accepted / verified rows tokens a row a
        # step), and of the accepted, how many were a row's j-th draft
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.spec_rows = self.spec_drafted = self.spec_accepted = 0
        self.spec_accepted_at = [0] * MAX_DRAFTS

    # ---- queue -----------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        needed = self.blocks.blocks_for(seq.num_tokens + seq.params.max_tokens)
        if needed > self.blocks.num_usable:
            raise ValueError(f"request {seq.request_id} needs {needed} KV blocks at its longest, the cache has "
                             f"{self.blocks.num_usable}")
        if self.prefix_cache is not None:
            seq.block_hashes = block_hashes(seq.prompt_token_ids, self.blocks.block_size)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished (or aborted) and free its memory at once."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.grammar = None
        self._free(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- memory ----------------------------------------------------------------------------------------------
    def _allocate(self, count: int) -> list[int]:
        blocks = self.blocks.allocate(count)
        if self.prefix_cache is not None:
            for b in blocks:
                self.prefix_cache.forget_block(b)
        return blocks

    def _free(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        if seq.slot is not None:
            self.slots.release(seq.slot)
            seq.slot = None

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room in seq's block table for num_tokens more computed tokens."""
        need = self.blocks.blocks_for(seq.num_computed_tokens + num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        seq.block_table += self._allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the cached state; the sequence re-enters the queue front with its tokens."""
        self.running.remove(seq)
        self._free(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- one step ----------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step: every running sequence's next tokens (oldest first; one for a decoding sequence, a chunk of
        its prompt for a prefilling one) under the token budget, preempting the newest when blocks run out, then
        waiting sequences while the budget, a slot and blocks allow. The plan's progress is booked at once.
        When the step holds only decoding sequences that may speculate and the policy wants drafts verified, each
        row becomes its last token and k drafts, verified in the step (`_speculate`; every draft is booked, and the
        next step, planned before this one is read back, starts after them: the device moves it back by the drafts
        rejected). Else, when the step holds only decoding sequences, nothing waits and each has room for them, it runs
        as many decode steps in one program as the programs do for that many rows (`_multi_step`)."""
        budget = self.max_num_batched_tokens
        rows: list[Row] = []
        preempted: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            if budget <= 0:
                break
            if seq.num_requested + seq.num_unverified >= seq.params.max_tokens:
                # its last token may be on its way: it waits for that (so it never needs more blocks than add checked)
                continue
            n = min(seq.num_uncomputed, budget, self._chunk_limit(seq))
            if n <= 0:
                continue
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                if victim in queue:
                    queue.remove(victim)
            if seq.status != Status.RUNNING:
                continue
            rows.append(self._row(seq, n))
            budget -= n
        # Then admit waiting sequences while there is budget, a free slot and blocks.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if self.slots.num_free == 0:
                break
            if seq.num_pending:
                raise RuntimeError(f"request {seq.request_id} re-admitted with tokens in flight")
            restore = self._admit_prefix(seq)
            n = min(seq.num_uncomputed, budget, self._chunk_limit(seq))
            if not self._grow(seq, n):
                self._free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.slot = self.slots.allocate()
            seq.status = Status.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.time()
            self.running.append(seq)
            row = self._row(seq, n)
            row.admitted, row.restore_snapshot = True, restore
            rows.append(row)
            budget -= n
        if not preempted and self._speculate(rows):
            for row in rows:
                self._book(row)
            return StepPlan(rows, preempted)
        # the MTP head after a plain step: over prompt chunks always (its KV pages of the prompt), and after decode
        # tokens when the next step may verify (it needs their drafts)
        head = self.speculation is not None and bool(rows) and (
            any(not r.samples or r.num_tokens > 1 for r in rows) or self.speculation.wants_drafts(len(rows)))
        steps = self._multi_step(rows) if not preempted and not head else 1
        for row in rows:
            row.steps = steps
            self._book(row)
        return StepPlan(rows, preempted, head)

    def _speculate(self, rows: list[Row]) -> bool:
        """Whether `rows` verify drafts, and if so turn each into its last token and k drafts (k from the policy),
        verified in several rounds of one program (as many as the programs run for that many rows when nothing waits
        and there is room, else 1). Only when every row may run several tokens a program (`_runs_ahead`), the tokens
        fit the budget and max_model_len, and every sequence has the blocks (allocated here) for every round's tokens
        and the positions its last drafts are made at (k - 1 past the last verified token)."""
        if self.speculation is None or not self._runs_ahead(rows):
            return False
        k = self.speculation.drafts_for(len(rows))
        if not k or len(rows) * (1 + k) > self.max_num_batched_tokens:
            return False
        most = self.programs.verify_rounds_for(len(rows)) if self.programs else 1
        for rounds in sorted({1 if self.waiting else most, 1}, reverse=True):
            reach = rounds * (k + 1) + k - 1  # tokens past num_computed_tokens the program writes KV pages for
            if self.max_model_len is not None and any(
                    r.seq.num_computed_tokens + reach > self.max_model_len for r in rows):
                continue
            if all(self._grow(r.seq, reach) for r in rows):  # blocks grown for some rows stay with them
                for r in rows:
                    r.num_tokens, r.drafts, r.steps = 1 + k, k, rounds
                return True
        return False

    def _multi_step(self, rows: list[Row]) -> int:
        """How many decode steps `rows` run at once: as many as the programs run for that many rows when every row
        may run several tokens a program (`_runs_ahead`), no request waits, and every sequence has the blocks for
        them (allocated here); else 1. Tokens past a request's end (EOS, a stop, max_tokens) are computed and
        dropped."""
        max_steps = self.programs.decode_steps_for(len(rows)) if self.programs else 1
        if max_steps == 1 or self.waiting or not self._runs_ahead(rows):
            return 1
        if self.max_model_len is not None and any(
                r.seq.num_computed_tokens + max_steps > self.max_model_len for r in rows):
            return 1
        if not all(self._grow(r.seq, max_steps) for r in rows):
            return 1  # the blocks grown for some rows stay with them: they will fill them
        return max_steps

    @staticmethod
    def _runs_ahead(rows: list[Row]) -> bool:
        """The one rule for which rows run several tokens a program, as decode steps or as drafts verified: decoding
        rows (one sampled token, not entering the batch) of any sampling setting (every one is compiled into those
        programs: programs.MODEL_SAMPLER_VARIANTS; penalties and min_tokens follow each token on the device), except
        under a grammar, whose mask for each token the host makes from the token before it."""
        return bool(rows) and all(r.samples and r.num_tokens == 1 and not r.admitted and r.seq.grammar is None
                                  for r in rows)

    def _book(self, row: Row) -> None:
        """Count a planned row as computed: its tokens' KV and state are in the cache for every later step (the
        device runs steps in order), its sample is pending, its full prompt blocks are indexed for prefix hits."""
        seq = row.seq
        # a verify row's rounds book every draft, the emitted ones as one sample a round and the rest unverified
        # (update_from_output takes the rejected ones back)
        seq.num_computed_tokens += row.steps * row.num_tokens if row.drafts else row.num_tokens + row.steps - 1
        if row.samples:
            seq.num_pending += row.steps
        seq.num_unverified += row.steps * row.drafts
        if self.prefix_cache is not None:
            self.prefix_cache.register_blocks(seq.block_hashes, seq.block_table, seq.num_computed_tokens)

    def _chunk_limit(self, seq: Sequence) -> int:
        """A prefill chunk ends at the prompt's snapshot boundary (the last full block that leaves a token to compute),
        for every model and whether or not prefix caching is on: a prefix-cache hit resumes exactly there, so runs
        with a hit, with a miss and with caching off all compute the tail in the same chunk and give identical logits.
        Hybrid models with caching on also save their recurrent state at that boundary."""
        boundary = snapshot_boundary(len(seq.prompt_token_ids), self.blocks.block_size)
        if seq.num_computed_tokens < boundary:
            return boundary - seq.num_computed_tokens
        return 1 << 30

    def _admit_prefix(self, seq: Sequence) -> int | None:
        """Attach the cached prefix blocks of a sequence being admitted; returns the snapshot to restore."""
        if self.prefix_cache is None or seq.num_computed_tokens:
            return None
        blocks, snapshot = self.prefix_cache.match(seq.block_hashes, len(seq.prompt_token_ids))
        for b in blocks:
            self.blocks.retain(b)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.blocks.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self.prefix_cache.record_lookup(len(seq.prompt_token_ids), seq.num_cached_tokens)
        return snapshot

    def _row(self, seq: Sequence, n: int) -> Row:
        row = Row(seq, seq.num_computed_tokens, n, samples=seq.num_computed_tokens + n == seq.num_tokens)
        cache = self.prefix_cache
        if cache is not None and cache.hybrid:
            boundary = snapshot_boundary(len(seq.prompt_token_ids), self.blocks.block_size)
            if boundary and row.start + n == boundary and seq.block_hashes:
                row.save_snapshot = cache.claim_snapshot(seq.block_hashes[boundary // self.blocks.block_size - 1])
        return row

    # ---- a step's output ---------------------------------------------------------------------------------------
    def update_from_output(self, rows: list[Row], output: SampleOutput | VerifyOutput) -> list[CoreOutput]:
        """Apply a step read back (`rows`: the step's, `output`: what it sampled, on the host): each sampling row's
        pending (and unverified) tokens are settled, its tokens appended and the stop rules applied (`_check_stop`;
        a request that ends is finished, its memory free). Returns each request's output, none for one that had ended
        before; when applying a request's tokens raises, that request alone fails (`fail`)."""
        emitted = None
        if isinstance(output, VerifyOutput):  # [requests, positions] -> [positions, requests], as several steps give
            emitted = output.num_emitted  # [requests, rounds]
            output = SampleOutput(output.tokens.T, output.logprobs.T, output.top_ids.transpose(1, 0, 2),
                                  output.top_logprobs.transpose(1, 0, 2))
        elif output.tokens.ndim == 1:  # one step; several in one program give [steps, requests]
            output = SampleOutput(*(a[None] for a in output))
        outputs = []
        for i, row in enumerate(rows):
            if not row.samples:
                continue
            row.seq.num_pending -= row.steps
            count = row.steps
            if emitted is not None:  # the step booked every draft as computed; the rejected ones were not
                rounds = [int(n) for n in emitted[i]]
                count = sum(rounds)
                row.seq.num_unverified -= row.steps * row.drafts
                if row.seq.status == Status.RUNNING:  # not preempted since (that set its count to 0)
                    row.seq.num_computed_tokens -= row.steps * (row.drafts + 1) - count
                self.spec_rows += row.steps
                self.spec_drafted += row.steps * row.drafts
                self.spec_accepted += count - row.steps
                for n in rounds:  # a round's accepted drafts are its first n - 1
                    for j in range(n - 1):
                        self.spec_accepted_at[j] += 1
                self.speculation.record(row.drafts, rounds)
            try:
                out = self._apply_row(row, output, i, count)
            except Exception as exc:
                out = self.fail(row.seq, exc)
            if out is not None:
                outputs.append(out)
        return outputs

    def fail(self, seq: Sequence, exc: Exception) -> CoreOutput:
        """End one request because handling it raised (building its share of a step, or applying its tokens): its
        client gets the error, every other request goes on."""
        log.error("request %s failed in the engine core", seq.request_id, exc_info=exc)
        if not seq.is_finished:
            self.finish(seq, "error")
        return CoreOutput(seq.request_id, [], finish_reason="error", num_cached_tokens=seq.num_cached_tokens,
                          error=f"the engine failed on this request: {type(exc).__name__}: {exc}")

    def _apply_row(self, row: Row, output: SampleOutput, i: int, count: int) -> CoreOutput | None:
        """Append row i's `count` sampled tokens ([steps, requests] in `output`) to its sequence and apply the stop
        rules; its output (None when it had ended before this step came back)."""
        seq = row.seq
        tokens, logprobs = [], [] if seq.params.logprobs is not None else None
        out = None
        for j in range(count):
            if seq.is_finished:  # finished or aborted since this step was issued: the rest is dropped
                break
            token = int(output.tokens[j, i])
            if seq.grammar is not None:
                seq.grammar.accept(token)
            seq.output_token_ids.append(token)
            self.num_generated_tokens += 1
            tokens.append(token)
            if logprobs is not None:
                n = seq.params.logprobs
                top = [(int(a), float(b)) for a, b in zip(output.top_ids[j, i][:n], output.top_logprobs[j, i][:n],
                                                          strict=True)]
                logprobs.append(TokenLogprob(token, float(output.logprobs[j, i]), top))
            out = self._check_stop(seq)
        if out is not None:
            out.new_token_ids, out.new_logprobs = tokens, logprobs
        return out

    def _check_stop(self, seq: Sequence) -> CoreOutput:
        """The token-level stop rules for the sequence's last token (stop strings are the front's): EOS and stop
        token ids once min_tokens are out, its grammar's end, max_tokens, max_model_len; a request that ends is
        finished here. The output's tokens are the caller's."""
        params, token = seq.params, seq.output_token_ids[-1]
        enough = len(seq.output_token_ids) >= params.min_tokens
        eos = token in self.eos_token_ids and not params.ignore_eos and enough
        out = CoreOutput(seq.request_id, [], num_cached_tokens=seq.num_cached_tokens, queue_seconds=seq.queue_seconds)
        if eos or (token in params.stop_token_ids and enough):
            out.finish_reason, out.stop_reason, out.eos = "stop", token, eos
        elif seq.grammar is not None and seq.grammar.is_terminated:  # its stop token: nothing more may follow
            out.finish_reason, out.stop_reason, out.eos = "stop", token, token in self.eos_token_ids
        elif len(seq.output_token_ids) >= params.max_tokens or (
                self.max_model_len is not None and seq.num_known_tokens >= self.max_model_len):
            out.finish_reason = "length"
        if out.finish_reason is not None:
            self.finish(seq, out.finish_reason, out.stop_reason)
        return out
