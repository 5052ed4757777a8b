"""Peer runner: OpenVINO GenAI's `ContinuousBatchingPipeline` on the CPU, stepped by hand.

`--model` is an OpenVINO IR exported from the safetensors directory (the harness exports it once,
fp32 weights). This CPU has AVX-512 BF16, where OpenVINO would compute in bf16 and keep a u8 KV
cache: f32 is asked for both, so the comparison is fp32 against fp32. Settings otherwise are the
best found on this machine (../shared/peers/README.md): 512 tokens a step with dynamic split-fuse.
"""

from __future__ import annotations

import argparse
from typing import Any

from protocol import closed_loop, serve


class OpenVinoPeer:
    def __init__(self, args: argparse.Namespace) -> None:
        import openvino_genai as ov_genai

        self._genai = ov_genai
        scheduler = ov_genai.SchedulerConfig()
        scheduler.max_num_batched_tokens = 512
        scheduler.max_num_seqs = 256
        scheduler.cache_size = 4  # GB
        scheduler.dynamic_split_fuse = True
        scheduler.enable_prefix_caching = False  # the warm-up must not help a timed run
        self.properties: dict[str, Any] = {
            "INFERENCE_PRECISION_HINT": "f32",
            "KV_CACHE_PRECISION": "f32",
            "KEY_CACHE_PRECISION": "f32",
            "VALUE_CACHE_PRECISION": "f32",
            "INFERENCE_NUM_THREADS": args.threads,
        }
        self.scheduler = scheduler
        self.pipe = ov_genai.ContinuousBatchingPipeline(args.model, scheduler, "CPU", self.properties)
        self._ids = 0

    def _config(self, n: int) -> Any:
        config = self._genai.GenerationConfig()
        config.max_new_tokens = n
        config.min_new_tokens = n
        config.ignore_eos = True
        config.do_sample = False
        config.num_beams = 1
        config.stop_token_ids = set()
        config.stop_strings = set()
        config.apply_chat_template = False
        return config

    def run(self, prompts: list[list[int]], max_new_tokens: list[int], max_in_flight: int) -> list[list[int]]:
        import numpy as np
        import openvino as ov

        outputs: list[list[int]] = [[] for _ in prompts]
        handles: dict[int, Any] = {}

        def submit(i: int) -> None:
            self._ids += 1
            ids = ov.Tensor(np.asarray([prompts[i]], dtype=np.int64))
            handles[i] = self.pipe.add_request(self._ids, ids, self._config(max_new_tokens[i]))

        def step() -> int:
            self.pipe.step()
            finished = [
                i for i, h in handles.items() if h.get_status() == self._genai.GenerationStatus.FINISHED
            ]
            for i in finished:
                outputs[i] = [int(t) for t in handles.pop(i).read_all()[0].generated_ids]
            return len(finished)

        closed_loop(len(prompts), max_in_flight, submit, step)
        return outputs

    def settings(self) -> dict[str, Any]:
        import openvino as ov

        return {
            "openvino": ov.get_version(),
            "openvino_genai": self._genai.get_version(),
            "properties": self.properties,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "dynamic_split_fuse": self.scheduler.dynamic_split_fuse,
        }

    def close(self) -> None:
        del self.pipe


if __name__ == "__main__":
    raise SystemExit(serve(OpenVinoPeer))
