"""The one bucket rule: the sizes a step's tokens, requests and rows are padded to, so that a few compiled programs
serve every batch. Pure integer functions, no device."""

from __future__ import annotations


def token_buckets(max_num_batched_tokens: int, max_num_seqs: int) -> list[int]:
    """The token counts a step is padded to (one compiled forward each): powers of two up to 512, steps of 512 up
    to 2048, then steps of 2048, and the token budget itself. Small steps (decode at low concurrency) pad little;
    large ones are prefill steps, which mostly fill the budget (the scheduler fills it whenever a prompt waits), so
    few buckets serve them and a cold start compiles few programs."""
    budget = int(max_num_batched_tokens)
    sizes = ({1 << i for i in range(10) if 1 << i < budget} | set(range(512, min(budget, 2048), 512))
             | set(range(2048, budget, 2048)) | {budget})
    return sorted(sizes)


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= n (at least `minimum`): the padded count of rows, sequences or table entries."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def bucket_for(num_tokens: int, buckets: list[int]) -> int:
    """The smallest of `buckets` (token_buckets) that holds num_tokens."""
    for size in buckets:
        if size >= num_tokens:
            return size
    raise ValueError(f"{num_tokens} tokens exceed the largest step bucket {buckets[-1]}")


def request_bucket(num_tokens: int, max_num_seqs: int) -> int:
    """Requests of a step of num_tokens tokens: each has at least one token, and at most max_num_seqs run."""
    return min(num_tokens, max_num_seqs)
