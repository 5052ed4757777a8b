"""A stand-in peer for the harness tests: transformers' `generate`, one request at a time, behind the
peer protocol (services/bench/peer_runners/protocol.py), run as its own process like a real peer.

Environment knobs, so the tests can see the harness catch what a real peer might do:
- STANDIN_CORRUPT=i: request i's last generated token is changed (a peer that disagrees).
- STANDIN_FAIL=1: the runner dies before it is ready (a peer that cannot start).
- STANDIN_NO_SCORE=1: scoring fails, the runner stays up (a peer that cannot give prompt logits).

`--precision default` runs the model in bfloat16, as a real peer's default does on a CPU with bf16
instructions; `fp32` (the protocol's default) in float32.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

# This checkout's services, not those of whichever checkout the interpreter has installed: the
# harness starts a peer with no PYTHONPATH, and the protocol under test is the one beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from services.bench.peer_runners.protocol import serve


class StandIn:
    def __init__(self, args: argparse.Namespace) -> None:
        if os.environ.get("STANDIN_FAIL"):
            print("stand-in peer: failing on purpose", file=sys.stderr)
            raise SystemExit(3)
        torch.set_num_threads(args.threads)
        self.precision: str = args.precision
        self.dtype = torch.float32 if args.precision == "fp32" else torch.bfloat16
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=self.dtype)
        self.corrupt = int(os.environ.get("STANDIN_CORRUPT", "-1"))
        self.runs = 0

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_new_tokens: list[int], max_in_flight: int) -> list[list[int]]:
        outputs = []
        for prompt, n in zip(prompts, max_new_tokens, strict=True):
            config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0)
            ids = torch.tensor([prompt])
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
            outputs.append(out[0, len(prompt) :].tolist())
        self.runs += 1
        if self.runs > 1 and 0 <= self.corrupt < len(outputs):  # run 1 is the warm-up
            outputs[self.corrupt][-1] = (outputs[self.corrupt][-1] + 1) % self.model.config.vocab_size
        return outputs

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[list[int]]:
        """Teacher-forced top-1: one forward over each whole prompt, argmax after every position."""
        if os.environ.get("STANDIN_NO_SCORE"):
            raise RuntimeError("stand-in peer: no scoring on purpose")
        return [self.model(torch.tensor([p])).logits[0, :-1].argmax(-1).tolist() for p in prompts]

    def settings(self) -> dict[str, Any]:
        return {
            "engine": "transformers generate",
            "threads": torch.get_num_threads(),
            "precision_asked": self.precision,
            "precision": str(self.model.dtype).removeprefix("torch."),
        }

    def close(self) -> None:
        pass


if __name__ == "__main__":
    raise SystemExit(serve(StandIn))
