"""The engine core runs one step ahead of the device: step() issues step N+1 before it reads back step N, that read is
its only wait on the device, the next step's input tokens come from the device, and a request that ends at step N
never returns the token that step N+1 computed for it.

Traced on the shared hybrid engine by wrapping its runner's executor (issue) and fetch (read back).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax import SamplingParams
from qwen_jax.engine import step as programs
from qwen_jax.sampling_params import StructuredOutputsParams


@dataclasses.dataclass
class Issued:
    known: dict[str, int]  # request -> output tokens the host knew when the step was issued
    from_device: int  # input tokens taken from the previous step's samples, still on the device


class Trace:
    """What each EngineCore.step() call issued and read back, in order, and every other wait on the device."""

    def __init__(self, engine, monkeypatch):
        self.engine = engine
        runner = engine.replicas[0].runner
        execute, fetch = runner.executor, runner.fetch
        self.outs: list = []  # each issued step's SampleOutput (on the device), by step number
        self.issued: list[Issued] = []
        self.first_tokens: list[int] = []  # row 0's sampled token of each step read back
        self.events: list[tuple[str, int]] = []
        self.stray_reads = 0  # device arrays read on the host outside fetch (each one a hidden sync)
        self.waits = 0  # block_until_ready calls
        self._in_fetch = False

        def traced_execute(ops):
            out = execute(ops)
            forward = next(op for op in ops if isinstance(op, programs.Forward))
            source = programs.unpack(np.asarray(forward.inputs), forward.layout)["token_source"]
            self.issued.append(Issued({rid: len(seq.output_token_ids) for rid, seq in engine.seqs.items()},
                                      int((source >= 0).sum())))
            self.events.append(("issue", len(self.outs)))
            self.outs.append(out)
            return out

        def traced_fetch(out):
            self.events.append(("fetch", next(i for i, o in enumerate(self.outs) if o is out)))
            self._in_fetch = True
            try:
                host = fetch(out)
            finally:
                self._in_fetch = False
            self.first_tokens.append(int(host.tokens[0]))
            return host

        # Every host read of a jax.Array (np.asarray, int(), tolist, device_get) goes through its `_value`.
        array_type = type(jnp.zeros(1))
        value = array_type._value

        def read(array):
            self.stray_reads += not self._in_fetch
            return value.fget(array)

        def wait(x):
            self.waits += 1
            return block(x)

        block = jax.block_until_ready
        monkeypatch.setattr(runner, "executor", traced_execute)
        monkeypatch.setattr(runner, "fetch", traced_fetch)
        monkeypatch.setattr(array_type, "_value", property(read))
        monkeypatch.setattr(jax, "block_until_ready", wait)

    def run(self) -> tuple[list[list[tuple[str, int]]], list[list]]:
        """Step until nothing is left: each step() call's events and its outputs."""
        calls, outputs = [], []
        while self.engine.has_unfinished:
            start = len(self.events)
            outputs.append(self.engine.step())
            calls.append(self.events[start:])
        return calls, outputs


def test_next_step_is_issued_before_the_last_is_read_back_and_that_read_is_the_only_wait(engines, kit, monkeypatch):
    llm = engines("hybrid")
    trace = Trace(llm.engine, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # One-step prefills (at most a block), so every step after the first is a decode step of both rows.
    llm.engine.add_request("a", kit.prompt(9, seed=901), params)
    llm.engine.add_request("b", kit.prompt(13, seed=902), params)
    calls, outputs = trace.run()

    # step() call k issues step k, then reads back step k-1 (the only read); the last call only reads back.
    assert calls == [[("issue", 0)]] + [[("issue", k), ("fetch", k - 1)] for k in range(1, 6)] + [[("fetch", 5)]]
    assert [sum(kind == "fetch" for kind, _ in call) for call in calls] == [0, 1, 1, 1, 1, 1, 1]
    assert (trace.stray_reads, trace.waits) == (0, 0)
    # When step k was issued the host knew k-1 tokens of each request: each decode row's input token (step k-1's
    # sample) was taken on the device.
    assert [i.known for i in trace.issued] == [{"a": n, "b": n} for n in (0, 0, 1, 2, 3, 4)]
    assert [i.from_device for i in trace.issued] == [0, 2, 2, 2, 2, 2]
    # Step k-1's tokens come out of step() call k, one per request.
    assert [sorted(o.request_id for o in out) for out in outputs] == [[]] + [["a", "b"]] * 6
    assert [o.finish_reason for o in outputs[-1]] == ["length", "length"]
    kit.assert_idle(llm)


def test_request_ending_at_step_n_drops_the_token_step_n_plus_1_computed(engines, kit, monkeypatch):
    engine = engines("hybrid").engine
    greedy = dict(temperature=0.0, max_tokens=6)

    def run(rid: str, params: SamplingParams) -> tuple[Trace, list[int], list[list]]:
        with monkeypatch.context() as patch:
            trace = Trace(engine, patch)
            engine.add_request(rid, kit.EOS_PROMPT, params)
            calls, outputs = trace.run()
        tokens = [t for out in outputs for o in out for t in o.new_token_ids]
        assert calls[-1] == [("fetch", len(trace.outs) - 1)]  # every issued step is read back
        return trace, tokens, outputs

    # The full continuation (a, b, EOS, c, ...): the reference for what each step samples.
    _, full, _ = run("ignore", SamplingParams(**greedy, ignore_eos=True))
    assert full[kit.EOS_STEP] == kit.EOS and len(full) == 6
    a, b = full[:kit.EOS_STEP]

    # EOS at step 2: step 3 was issued before step 2 came back and computed c; c is read back and dropped.
    trace, tokens, outputs = run("eos", SamplingParams(**greedy))
    assert tokens == [a, b, kit.EOS]
    assert len(trace.outs) == 4 and trace.first_tokens == full[:4]
    assert outputs[-1] == [] and outputs[-2][0].finish_reason == "stop"

    # A stop token id at step 1: step 2 computed the EOS after it, dropped.
    trace, tokens, outputs = run("stop", SamplingParams(**greedy, stop_token_ids=[b]))
    assert tokens == [a, b]
    assert len(trace.outs) == 3 and trace.first_tokens == full[:3]
    assert outputs[-1] == [] and (outputs[-2][0].finish_reason, outputs[-2][0].stop_reason) == ("stop", b)

    # max_tokens is known ahead: no step is issued past the last token.
    trace, tokens, outputs = run("length", SamplingParams(**{**greedy, "max_tokens": 2}))
    assert tokens == [a, b]
    assert len(trace.outs) == 2 and trace.first_tokens == full[:2]
    assert outputs[-1][0].finish_reason == "length"
    assert not engine.seqs and not engine.has_unfinished


def test_a_step_with_a_constrained_row_is_read_back_before_the_next_is_issued(engines, kit, monkeypatch):
    """A grammar's next mask needs the token just sampled: with a constrained request in the batch each step() reads
    the last step back first, and every input token is then known on the host. The free batch above keeps its step
    ahead."""
    llm = engines("hybrid")
    trace = Trace(llm.engine, monkeypatch)
    params = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.engine.add_request("free", kit.prompt(9, seed=901), SamplingParams(**params))
    llm.engine.add_request("regex", kit.prompt(13, seed=902), SamplingParams(
        **params, structured_outputs=StructuredOutputsParams(regex="[a-z]{40}")))
    calls, outputs = trace.run()

    assert calls == [[("issue", 0)]] + [[("fetch", k - 1), ("issue", k)] for k in range(1, 6)] + [[("fetch", 5)]]
    assert (trace.stray_reads, trace.waits) == (0, 0)
    assert [i.known for i in trace.issued] == [{"free": n, "regex": n} for n in range(6)]
    assert [i.from_device for i in trace.issued] == [0] * 6
    text = llm.tokenizer.decode([t for out in outputs for o in out if o.request_id == "regex" for t in o.new_token_ids])
    assert len(text) >= 6 and text.isalpha() and text.islower()
    kit.assert_idle(llm)
