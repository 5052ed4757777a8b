"""The peer systems of `cbserve bench offline`: engines that are not ours (services/bench/peers.py), each
in a process of its own, started before the timed rounds and driven round by round."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from services.bench.arguments import peer_system
from services.bench.offline.results import SystemResult
from services.bench.workload import Workload

if TYPE_CHECKING:
    from services.bench.peers import PeerProcess, PeerSpec


def start_peer(
    spec: PeerSpec,
    precision: str | None,
    model_path: Path,
    threads: int,
    peers: dict[str, PeerProcess],
    runners: dict[str, Callable[[int | None], SystemResult]],
    workload: Workload,
) -> int:
    """Start one peer (its load and warm-up are not timed) and add its runner; 1 if it cannot run."""
    from services.bench.peers import PeerProcess, PeerUnavailable

    name = peer_system(spec.name, precision)
    print(f"starting {name} ...", flush=True)
    try:
        peer = PeerProcess(spec, model_path, threads, precision)
    except PeerUnavailable as exc:
        print(f"  {name} left out: {exc}", flush=True)
        return 1
    peers[name] = peer
    runners[name] = lambda c: run_peer(peer, workload, c)
    return 0


def run_peer(peer: PeerProcess, workload: Workload, max_in_flight: int | None) -> SystemResult:
    wall, outputs, peak_rss = peer.run(workload, max_in_flight)
    # What the peer reports it resolved its precision to (a `--peer` runner may say nothing).
    extra = {
        "settings": peer.settings,
        "peak_rss_bytes": peak_rss,
        "precision": peer.settings.get("precision", "-"),
    }
    return SystemResult(peer.name, wall, outputs, workload.total_prompt_tokens, extra=extra)
