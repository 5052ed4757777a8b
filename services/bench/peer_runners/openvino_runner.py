"""Peer runner: OpenVINO GenAI's `ContinuousBatchingPipeline` on the CPU, stepped by hand.

`--model` is an OpenVINO IR exported from the safetensors directory (the harness exports it once,
fp32 weights, which is also what `optimum-cli export openvino` keeps for a model under a billion
parameters). Settings are the best found for OpenVINO on a 2-core CPU host (docs/performance-log.md has
the measurements): 512 tokens a step with dynamic split-fuse.

Precision: on a CPU with bf16 instructions the CPU plugin computes in bf16 unless told otherwise,
and its KV cache precision comes from the IR's `runtime_options` when the exporter wrote one
(optimum-intel writes f16) or else the plugin's default (u8 on such CPUs). `--precision fp32` asks
for f32 compute and an f32 KV cache, so the comparison with an fp32 engine is like for like;
`default` asks for neither. The pipeline does not hand out its compiled model, so `settings()`
reads the resolved precisions from the same IR compiled with the same properties: the plugin
resolves them from the model's runtime options and the properties alone, and the pipeline's KV
cache takes its element types from its compiled model's cache inputs.

Scoring (the protocol's `score`): the pipeline returns a log-probability only for tokens it samples
(GenerationConfig's `logprobs` is one value, of the chosen token; `echo` gives the prompt tokens'
own, not the top-ranked ones), so teacher-forced top-1 cannot come from it. Instead the same IR is
compiled with the same properties (so the same inference and KV cache precisions) and run directly,
one token a call: each position then attends over the stateful model's KV cache, held in the KV
precision, as every token the pipeline generates attends over its paged one, and as every position of
cbserve's score reads its pages. One forward over a whole prompt would attend over the prompt's
fresh float keys and values instead and never see the cache's rounding (docs/performance.md's
teacher-forced agreement has what that hid).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

# At run time this script's folder is on sys.path (protocol.py); the type checker knows the same file
# as a module of the services package.
if TYPE_CHECKING:
    from services.bench.peer_runners.protocol import closed_loop, serve
else:
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
        self.properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": args.threads}
        if args.precision == "fp32":
            self.properties |= {
                "INFERENCE_PRECISION_HINT": "f32",
                "KV_CACHE_PRECISION": "f32",
                "KEY_CACHE_PRECISION": "f32",
                "VALUE_CACHE_PRECISION": "f32",
            }
        self.precision: str = args.precision
        self.model_dir: str = args.model
        self.scheduler = scheduler
        self.pipe = ov_genai.ContinuousBatchingPipeline(args.model, scheduler, "CPU", self.properties)
        self.resolved = _resolved_precisions(args.model, self.properties)
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

    def score(self, prompts: list[list[int]]) -> list[list[int]]:
        import numpy as np
        import openvino as ov

        # Compiled for this command only: a second copy of the weights need not stay beside the
        # pipeline's through the timed rounds.
        model = Path(self.model_dir) / "openvino_model.xml"
        compiled = ov.Core().compile_model(model, "CPU", self.properties)
        request = compiled.create_infer_request()
        top1 = []
        for prompt in prompts:
            request.reset_state()  # the IR is stateful: its KV cache would carry the last prompt over
            guesses = []
            for position, token in enumerate(prompt[:-1]):
                request.infer(
                    {
                        "input_ids": np.asarray([[token]], dtype=np.int64),
                        "attention_mask": np.ones((1, position + 1), dtype=np.int64),
                        "position_ids": np.asarray([[position]], dtype=np.int64),
                        "beam_idx": np.zeros(1, dtype=np.int32),
                    }
                )
                # The lowest id among equals, as the reference's argmax.
                guesses.append(int(request.get_tensor("logits").data[0, -1].argmax()))
            top1.append(guesses)
        del request, compiled
        return top1

    def settings(self) -> dict[str, Any]:
        import openvino as ov

        inference, key, value = (self.resolved[k] for k in RESOLVED)
        kv = key if key == value else f"K {key} V {value}"
        return {
            "openvino": ov.get_version(),
            "openvino_genai": self._genai.get_version(),
            "precision_asked": self.precision,
            "precision": f"{inference}, KV {kv}",
            "resolved": self.resolved,
            "properties": self.properties,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "dynamic_split_fuse": self.scheduler.dynamic_split_fuse,
        }

    def close(self) -> None:
        del self.pipe


RESOLVED = ("INFERENCE_PRECISION_HINT", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION")


def _resolved_precisions(model_dir: str, properties: dict[str, Any]) -> dict[str, str]:
    """The compute and KV cache precisions the CPU plugin resolves for this IR and these properties
    (`bf16`, `f16`, `u8`, `f32`...), from a compile of its own that is dropped at once."""
    import openvino as ov

    compiled = ov.Core().compile_model(Path(model_dir) / "openvino_model.xml", "CPU", properties)
    try:
        return {name: compiled.get_property(name).to_string() for name in RESOLVED}
    finally:
        del compiled


if __name__ == "__main__":
    raise SystemExit(serve(OpenVinoPeer))
