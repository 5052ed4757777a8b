"""`cbserve bench offline --agreement`: teacher-forced top-1 agreement with float32 transformers, the
finer measure of what a lower precision costs (services/bench/agreement.py computes it).

Greedy runs diverge for good at their first differing token, so the table's `greedy = fp32` count is
coarse. After the timed rounds, every engine system and peer scores a fixed prose text, each position
seeing the true tokens before it, and `top-1 = fp32` counts the positions whose top-ranked next token
equals float32 transformers'.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.bench.offline.engine_runner import build_engine
from services.bench.offline.pool import prose_pool

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from services.bench.arguments import EngineVariant
    from services.bench.peers import PeerProcess

# (positions where the system's top-1 equals float32 transformers', positions scored), or the reason
# it could not be scored.
Top1 = tuple[int, int] | str


def prose_prompts(model_path: Path) -> list[list[int]]:
    """The agreement text's prompts (services/bench/agreement.py), made before anything is loaded so
    that a model without a tokenizer is refused at once, not after the timed rounds."""
    from transformers import AutoTokenizer

    from services.bench.agreement import prose_conversations
    from services.common.model_source import has_tokenizer

    if not has_tokenizer(model_path):
        raise SystemExit(f"--agreement tokenizes a prose text, and {model_path} has no tokenizer")
    return prose_conversations(AutoTokenizer.from_pretrained(model_path, local_files_only=True))


def measure_top1(
    prose: list[list[int]],
    systems: list[str],
    model_path: Path,
    hf_model: PreTrainedModel | None,
    engines_wanted: Mapping[str, EngineVariant],
    engine_settings: dict[str, Any],
    peers: Mapping[str, PeerProcess],
) -> dict[str, Top1]:
    """Teacher-forced top-1 agreement with float32 transformers on `prose`, for each engine system
    (a fresh engine at its dtype and settings, its pool sized to the prose) and each running peer
    (its `score` command). Untimed. A system that cannot be scored gets its reason, not a crash: the
    timed results beside it are worth keeping."""
    from services.bench.agreement import agreement as same_top1
    from services.bench.agreement import engine_top1, reference_top1
    from services.bench.peers import PeerCannotScore, PeerUnavailable
    from services.common.model_source import load_model

    positions = sum(len(p) - 1 for p in prose)
    print(f"\nagreement: float32 transformers' top-1 at {positions} positions of prose ...", flush=True)
    model = hf_model if hf_model is not None else load_model(model_path, dtype=torch.float32)[0]
    reference = reference_top1(model, prose)
    del model  # the hf systems' model stays with them; one loaded here goes
    out: dict[str, Top1] = {}
    for name in systems:
        try:
            if name in engines_wanted:
                with build_engine(
                    model_path, engines_wanted[name], prose_pool(engine_settings, prose)
                ) as engine:
                    other = engine_top1(engine, prose)
            elif name in peers:
                other = peers[name].score(prose)
            else:
                continue  # the stack runs the engine's arithmetic; the hf systems are the reference's
            out[name] = same_top1(reference, other)
        except (PeerCannotScore, PeerUnavailable, RuntimeError, ValueError) as exc:
            out[name] = str(exc)
        reason = f" ({out[name]})" if isinstance(out[name], str) else ""
        print(f"  {name}: {top1_cell(out[name])}{reason}", flush=True)
    return out


def top1_cell(value: Top1 | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return "n/a"
    same, total = value
    return f"{same}/{total} ({100 * same / total:.2f}%)"
