"""The reference workload must reproduce its published totals, or baselines are not comparable."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.bench.workload import Workload, jsonl_workload, reference_workload


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


def test_jsonl_workload_takes_ids_and_needs_max_tokens(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"token_ids": [5, 6, 7], "max_tokens": 4}\n\n{"token_ids": [8], "max_tokens": 2}\n')
    workload = jsonl_workload(path, 10, tmp_path)
    assert workload.prompts == [[5, 6, 7], [8]] and workload.max_new_tokens == [4, 2]
    assert jsonl_workload(path, 1, tmp_path).num_requests == 1
    path.write_text('{"token_ids": [5, 6, 7]}\n')
    with pytest.raises(ValueError, match=r"requests \[0\] have no max_tokens"):
        jsonl_workload(path, 10, tmp_path)
