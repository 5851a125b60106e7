"""qwen_jax.bench.speculative on the tiny hybrid model with a head that drafts often right, on the CPU: greedy outputs
at k = 1 equal k = 0's for every prompt, in one batch and one prompt at a time; the acceptance counters add up; each
engine is freed before the next; the table is printed and one RESULTS entry appended.
"""

from __future__ import annotations

import json

import jax
import pytest

from qwen_jax.bench import speculative

# GSM8K test question 24 first: the tiny model's greedy answer to it ends in one token repeated, which the copy head
# drafts right; after the others it cycles through four tokens, where every draft is rejected.
QUESTIONS = ["A candle melts by 2 centimeters every hour that it burns. How many centimeters shorter will a candle be "
             "after burning from 1:00 PM to 5:00 PM?", "What is 2 + 3?", "Add 10 and 12."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gsm8k") / "test.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in QUESTIONS))
    return str(path)


@pytest.mark.parametrize("mode", [[], ["--one-at-a-time"]], ids=["batch", "one_at_a_time"])
def test_speculative_bench_reports_acceptance_and_exact_outputs(hybrid_mtp_dir, data, mode, tmp_path, capsys):
    results = tmp_path / "results.json"
    live_before = len(jax.live_arrays())
    report = speculative.main(["--model", hybrid_mtp_dir, "--drafts", "1,0", "--prompts", "3",
                               "--max-tokens", str(MAX_TOKENS),
                               "--data", data, "--max-num-seqs", "4", "--results", str(results), *mode])
    # every engine's weights and caches are gone once its level is measured
    assert len(jax.live_arrays()) == live_before
    plain, spec = report["levels"]
    assert (plain["drafts"], spec["drafts"]) == (0, 1)
    assert plain["prompts"] == spec["prompts"] == 3
    assert spec["outputs_differ_from_k0"] == 0 and spec["first_differences"] == []
    assert plain["output_tokens"] == spec["output_tokens"] == 3 * MAX_TOKENS  # the tiny model never ends them
    assert (plain["verified_rows"], plain["drafted_tokens"], plain["accepted_tokens"]) == (0, 0, 0)
    assert plain["acceptance_length"] is None
    rows, drafted, accepted = spec["verified_rows"], spec["drafted_tokens"], spec["accepted_tokens"]
    assert rows > 0 and drafted == 1 * rows and 0 < accepted <= drafted
    assert spec["acceptance_length"] == pytest.approx(1 + accepted / rows, abs=1e-4)
    assert spec["acceptance_rate"] == pytest.approx(accepted / drafted, abs=1e-4)
    assert spec["accepted_by_position"] == [accepted]
    # a verify step emits a row's accepted drafts too: one prompt at a time, each accepted draft saves at most a
    # step (none where it lands past max_tokens); in a batch the rows that accept nothing set the pace, and near
    # max_tokens the last rows wait once for their verify program's read-back (they may be done: a step that only
    # reads back)
    saved = plain["engine_steps"] - spec["engine_steps"]
    assert 0 < saved <= accepted if mode else -1 <= saved <= accepted
    assert all(level["output_tokens_per_s"] > 0 for level in report["levels"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert json.loads(lines[1]) == plain and json.loads(lines[2]) == spec
    table = lines[3:7]
    assert table[0].startswith("| k | prompts |") and table[1].startswith("|---|")
    assert table[2].startswith("| 0 | 3 | 72 |") and table[3].startswith("| 1 | 3 | 72 |")
    assert table[3].split(" | ")[4] == f"{spec['acceptance_length']:.3f}"
    entry = json.loads(results.read_text())[0]
    assert entry["benchmark"] == "speculative" and entry["levels"] == report["levels"]
    assert entry["mode"] == ("one_at_a_time" if mode else "batch") and entry["max_tokens"] == MAX_TOKENS


def test_a_bad_draft_count_fails_before_any_engine_is_built(hybrid_mtp_dir, data):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative.main(["--model", hybrid_mtp_dir, "--drafts", "0,7", "--data", data, "--results", "none"])
