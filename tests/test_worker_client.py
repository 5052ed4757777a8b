"""The gateway's worker link, its pure parts: what a request of a lost worker is re-submitted as.
(tests/test_stack_lifecycle.py kills a real worker mid-stream.)"""

from __future__ import annotations

from services.common.gateway_messages import NewRequest
from services.common.sampling_params import SamplingParams
from services.gateway.worker_client import resubmission


def test_resubmission_continues_the_stream_and_asks_for_prompt_logprobs_once() -> None:
    params = SamplingParams(max_new_tokens=8, min_new_tokens=3, prompt_logprobs=2)
    request = NewRequest("r1", [5, 6, 7], params, priority=1, cache_salt="s")
    # Nothing streamed yet: the prompt logprobs have not reached the client either.
    assert resubmission(request, []) == request
    again = resubmission(request, [9, 10])
    assert again.prompt_ids == [5, 6, 7, 9, 10]
    assert (again.params.max_new_tokens, again.params.min_new_tokens) == (6, 1)
    # They came with the first token: the re-submitted prompt's would repeat them, on a longer prompt.
    assert again.params.prompt_logprobs is None
    # The streamed tokens are still output to the presence/frequency penalties, however often lost.
    assert again.params.generated_in_prompt == 2
    assert resubmission(again, [11]).params.generated_in_prompt == 3
    assert (again.request_id, again.priority, again.cache_salt) == ("r1", 1, "s")
