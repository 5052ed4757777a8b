"""`cbserve chat`: a terminal chat on the in-process engine, streaming tokens as they are sampled."""

from __future__ import annotations

import sys

from services.common.sampling_params import SamplingParams
from services.worker.engine import Engine


def stream_text(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> str:
    """Run one request to the end, printing the text as it grows. A token that ends inside a UTF-8
    character decodes to U+FFFD; it is held back until the next token completes the character."""
    tokenizer = engine.tokenizer
    req = engine.add_request(prompt_ids, params)
    shown = ""
    while not req.finished:
        engine.step()
        text = tokenizer.decode(req.output_ids, skip_special_tokens=True)
        if not text.endswith("\ufffd") and len(text) > len(shown):
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    engine.run_until_done()  # release the finished request's blocks
    return shown


def chat_loop(model: str | None, max_new_tokens: int, temperature: float) -> int:
    engine = Engine.from_pretrained(model)
    if engine.tokenizer is None:
        print(f"{model}: no tokenizer in the model directory; chat needs one", file=sys.stderr)
        return 2
    messages: list[dict[str, str]] = []
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    print("cbserve chat — an empty line or Ctrl-D quits.", file=sys.stderr)
    with engine:
        for line in sys.stdin:
            if not line.strip():
                break
            messages.append({"role": "user", "content": line.strip()})
            ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            reply = stream_text(engine, list(ids), params)
            print()
            messages.append({"role": "assistant", "content": reply})
    return 0
