"""The reference workload must reproduce the totals PERFORMANCE.md quotes, or baselines are not comparable."""

from __future__ import annotations

import pytest

from services.bench.workload import Workload, reference_workload


def test_w1_totals_match_performance_md() -> None:
    w = reference_workload()
    assert w.num_requests == 48
    assert w.total_output_tokens == 3305
    assert w.total_prompt_tokens == 9443
    assert w.total_tokens == 3305 + 9443


def test_w1_bounds_and_determinism() -> None:
    w = reference_workload()
    assert all(32 <= len(p) <= 384 for p in w.prompts)
    assert all(8 <= n <= 128 for n in w.max_new_tokens)
    assert all(100 <= t <= 49052 for p in w.prompts for t in p)
    assert reference_workload() == w
    assert reference_workload(seed=1) != w


def test_prefix_of_requests_is_stable() -> None:
    # The drawing is sequential per request, so a smaller workload is the head of a larger one: a quick
    # run with --num-requests 4 measures the same first requests as the full W1.
    full, head = reference_workload(), reference_workload(num_requests=4)
    assert head.prompts == full.prompts[:4]
    assert head.max_new_tokens == full.max_new_tokens[:4]


def test_mismatched_lengths_rejected() -> None:
    with pytest.raises(ValueError):
        Workload(prompts=[[1, 2]], max_new_tokens=[])
