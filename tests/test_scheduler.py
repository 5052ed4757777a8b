"""The Scheduler's policy core, driven against a real BlockManager (both are pure: no model needed)."""

from __future__ import annotations

import itertools

from services.cachemgr.block_manager import BlockManager
from services.cachemgr.cache_request import CacheState
from services.common.config import CBConfig
from services.common.kv_geometry import KVGeometry
from services.common.sampling_params import SamplingParams
from services.worker.request import PLACEHOLDER_ID, FinishReason, Request, RequestStatus
from services.worker.scheduler import Scheduler

GEOMETRY = KVGeometry(
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    page_size=4,
    dtype_bytes=4,
    layer_kinds=("full", "full"),
    sliding_window=None,
)


def make(config: CBConfig, blocks: int = 64) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(GEOMETRY, blocks + 2, safety_margin=config.effective_safety_margin)
    return Scheduler(config, eos_token_ids=[0]), bm


_prompt_starts = itertools.count(10, 1000)


def request(rid: str, prompt_len: int, priority: int = 0, max_new: int = 8) -> Request:
    """A prompt of its own: prompts that share pages would wait for each other's (BlockManager)."""
    start = next(_prompt_starts)
    prompt = list(range(start, start + prompt_len))
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new), 0, priority)


def step(sched: Scheduler, bm: BlockManager, token: int = 7) -> list[tuple[str, int, int]]:
    batch = sched.apply(bm.step(sched.plan()))
    sched.postprocess(batch, [token] * len(batch.sampling))
    return [(s.request.request_id, s.start, s.num_tokens) for s in batch.scheduled]


def test_long_prompt_is_chunked_and_decodes_interleave() -> None:
    sched, bm = make(CBConfig(max_batch_tokens=8))
    sched.add(request("a", 3))
    sched.add(request("b", 20))
    assert step(sched, bm) == [("a", 0, 3), ("b", 0, 5)]
    # fifo: the decode of "a" goes first, "b" continues with what is left of the budget.
    assert step(sched, bm) == [("a", 3, 1), ("b", 5, 7)]
    assert step(sched, bm) == [("a", 4, 1), ("b", 12, 7)]
    assert step(sched, bm) == [("a", 5, 1), ("b", 19, 1)]
    assert sched.requests["b"].status is RequestStatus.DECODING


def test_long_prefill_token_threshold_leaves_budget_to_later_prompts() -> None:
    sched, bm = make(CBConfig(max_batch_tokens=16, long_prefill_token_threshold=6))
    sched.add(request("long", 40))
    sched.add(request("short", 5))
    assert step(sched, bm) == [("long", 0, 6), ("short", 0, 5)]
    # The short one decodes; the long one still gets 6, not the 15 left of the budget.
    assert step(sched, bm) == [("short", 5, 1), ("long", 6, 6)]


def test_admissions_behind_a_prefix_hit_take_the_budget_it_spares() -> None:
    sched, bm = make(CBConfig(max_batch_tokens=12, page_size=GEOMETRY.page_size))
    head = list(range(10, 22))
    sched.add(Request("head", head, SamplingParams(max_new_tokens=8), 0))
    for i in range(3):
        sched.add(Request(f"f{i}", [*head[:8], *range(100 + 10 * i, 104 + 10 * i)], SamplingParams(), 0))
    assert step(sched, bm) == [("head", 0, 12)]
    # The head's pages are now cached: each follower computes the 4 tokens after its 8-token hit, so the
    # 11 tokens the head's decode leaves admit all three (the last one in part), not one of them.
    assert step(sched, bm) == [("head", 12, 1), ("f0", 8, 4), ("f1", 8, 4), ("f2", 8, 3)]
    assert step(sched, bm) == [("head", 13, 1), ("f0", 12, 1), ("f1", 12, 1), ("f2", 11, 1)]


def test_prefill_first_finishes_chunked_prefills_before_decodes() -> None:
    sched, bm = make(CBConfig(max_batch_tokens=8, scheduler_type="prefill_first"))
    sched.add(request("a", 3))
    sched.add(request("b", 20))
    assert step(sched, bm) == [("a", 0, 3), ("b", 0, 5)]
    assert step(sched, bm) == [("b", 5, 8)]
    assert step(sched, bm) == [("b", 13, 7), ("a", 3, 1)]


def test_priority_orders_pending_requests_within_the_policy() -> None:
    sched, bm = make(CBConfig(max_batch_tokens=4))
    sched.add(request("low", 4))
    sched.add(request("high", 4, priority=5))
    assert step(sched, bm) == [("high", 0, 4)]


def test_max_requests_per_batch_bounds_sampling_rows_only() -> None:
    sched, bm = make(CBConfig(max_batch_tokens=64, max_requests_per_batch=2))
    for i in range(3):
        sched.add(request(f"r{i}", 4))
    sched.add(request("long", 80))
    # r0, r1 fill the two logits rows; r2 would sample, so it waits; the long prompt's first chunk
    # does not sample and still runs.
    assert step(sched, bm) == [("r0", 0, 4), ("r1", 0, 4), ("long", 0, 56)]


def test_prompt_logprobs_rows_bound_the_chunk() -> None:
    sched, bm = make(CBConfig(max_batch_tokens=64, max_requests_per_batch=4))
    sched.add(request("r0", 4))
    sched.add(Request("p", list(range(10, 40)), SamplingParams(prompt_logprobs=2), 0))
    sched.add(request("r1", 4))
    # r0 takes a logits row; every position "p" computes is a row (its prompt logprobs), so it gets
    # the three left, and r1, which would sample, waits.
    assert step(sched, bm) == [("r0", 0, 4), ("p", 0, 3)]


def test_stops_eos_stop_token_and_length() -> None:
    sched, bm = make(CBConfig())
    sched.add(request("eos", 2))
    sched.add(Request("stop", [5, 6], SamplingParams(stop_token_ids=(7,)), 0))
    sched.add(Request("ignore", [5, 6], SamplingParams(ignore_eos=True, max_new_tokens=2), 0))
    batch = sched.apply(bm.step(sched.plan()))
    done = sched.postprocess(batch, [0, 7, 0])
    assert [(r.request_id, r.finish_reason) for r in done if r.finished] == [
        ("eos", FinishReason.EOS),
        ("stop", FinishReason.STOP_TOKEN),
    ]
    step(sched, bm)
    assert not sched.requests and sched.has_releases
    bm.step(sched.plan())
    assert bm.stats_dict()["used_blocks"] == 0


def test_min_new_tokens_suppresses_stop_ids() -> None:
    sched, _ = make(CBConfig())
    req = Request("m", [5], SamplingParams(min_new_tokens=2, stop_token_ids=(9,)), 0)
    sched.add(req)
    assert set(sched.suppressed_ids(req)) == {0, 9}
    req.output_ids += [3, 4]
    assert sched.suppressed_ids(req) == ()


def test_abort_in_every_state_releases_everything() -> None:
    sched, bm = make(CBConfig(max_batch_tokens=8))
    sched.add(request("decoding", 3))
    sched.add(request("prefilling", 30))
    step(sched, bm)
    sched.add(request("pending", 5))
    sched.add(request("unsent", 5))
    sched.apply(bm.step(sched.plan()))  # granted, never computed: aborted with work in flight
    for rid in ("decoding", "prefilling", "pending", "unsent"):
        assert sched.abort(rid) is not None
    bm.step(sched.plan())
    stats = bm.stats_dict()
    assert stats["used_blocks"] == 0 and stats["requests_known"] == 0
    bm.check()


def test_a_request_sent_but_not_admitted_is_forgotten_when_aborted() -> None:
    sched, bm = make(CBConfig(max_batch_tokens=8, page_size=GEOMETRY.page_size))
    sched.add(request("a", 8))
    sched.add(request("b", 9))
    # "b" is planned too (a hit could have left it room); "a" takes the whole budget, so it waits.
    assert step(sched, bm) == [("a", 0, 8)]
    assert bm.requests["b"].state is CacheState.PENDING
    assert sched.abort("b") is not None
    assert step(sched, bm) == [("a", 8, 1)]
    assert "b" not in bm.requests
    bm.check()


def test_rejected_request_fails_with_the_reason() -> None:
    sched, bm = make(CBConfig(), blocks=4)
    sched.add(request("huge", 40, max_new=8))
    batch = sched.apply(bm.step(sched.plan()))
    assert [r.request_id for r in batch.failed] == ["huge"]
    assert batch.failed[0].finish_reason is FinishReason.ERROR
    assert "4" in batch.failed[0].error
    assert not sched.requests


def test_cache_budget_bounds_pages_read_per_step() -> None:
    sched = Scheduler(CBConfig(max_batch_tokens=64, page_size=4), cache_budget_pages=5)
    bm = BlockManager(GEOMETRY, 66)
    sched.add(request("a", 12))  # 3 pages
    sched.add(request("b", 12))  # 3 more would exceed 5
    sched.add(request("c", 8))  # 2 pages fit
    assert step(sched, bm) == [("a", 0, 12), ("c", 0, 8)]


# ------------------------------------------------------------------------------------ async batching


def test_a_plan_made_while_a_step_runs_carries_its_samples_as_placeholders() -> None:
    sched, bm = make(CBConfig(max_batch_tokens=8))
    sched.add(request("a", 3, max_new=2))
    sched.add(request("b", 10))
    first = sched.apply(bm.step(sched.plan()))
    assert [(s.request.request_id, s.start, s.num_tokens, s.sample) for s in first.scheduled] == [
        ("a", 0, 3, True),
        ("b", 0, 5, False),
    ]
    # Step 2 is planned before step 1's token exists: a computes a placeholder, b its next chunk.
    plan = sched.plan(running=first)
    assert plan.overlapped
    assert [(e.request_id, e.num_tokens, e.new_token_ids, e.num_placeholders) for e in plan.entries] == [
        ("a", 1, [], 1),
        ("b", 5, [], 0),
    ]
    second = sched.apply(bm.step(plan))
    bm.check()
    a = sched.requests["a"]
    assert (a.num_computed, a.num_placeholders, a.tokens(3, 4)) == (4, 2, [PLACEHOLDER_ID])
    assert sched.postprocess(first, [7]) == [a] and a.output_ids == [7] and a.num_placeholders == 1
    # a's second token is its last (max_new 2): nothing is planned past it; b decodes a placeholder.
    plan = sched.plan(running=second)
    assert [(e.request_id, e.num_tokens, e.new_token_ids) for e in plan.entries] == [("b", 1, [])]
    sched.postprocess(second, [8, 9])
    assert a.finish_reason is FinishReason.LENGTH and a.output_ids == [7, 8]
    assert sched.requests["b"].output_ids == [9]


def test_tokens_of_a_request_finished_while_its_step_ran_are_dropped() -> None:
    sched, bm = make(CBConfig())
    sched.add(request("stops", 3))
    sched.add(request("aborted", 3))
    first = sched.apply(bm.step(sched.plan()))
    second = sched.apply(bm.step(sched.plan(running=first)))
    assert len(second.sampling) == 2  # both planned again before the first step's tokens exist
    sched.postprocess(first, [0, 5])  # "stops" samples EOS
    sched.abort("aborted")
    assert sched.postprocess(second, [6, 6]) == []
    assert sched.requests == {}
    assert [r.output_ids for r in (first.scheduled[0].request, first.scheduled[1].request)] == [[0], [5]]
    bm.step(sched.plan())
    assert bm.stats_dict()["used_blocks"] == 0 and bm.stats_dict()["requests_known"] == 0


def test_prompt_logprobs_wait_for_the_step_that_takes_them() -> None:
    sched, bm = make(CBConfig(max_batch_tokens=8))
    sched.add(Request("p", list(range(10, 30)), SamplingParams(prompt_logprobs=1), 0))
    first = sched.apply(bm.step(sched.plan()))
    assert sched.plan(running=first).entries == []  # its next chunk's rows depend on what is taken
