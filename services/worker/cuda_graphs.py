"""CUDA graphs for decode steps: each bucket shape captured once at start, replayed by every step of it.

What is captured. A decode step (every request computes one token) runs its whole forward as one
graph, embedding to logits, paged attention included: vLLM's FULL_DECODE_ONLY. The other steps (a
prompt chunk, alone or beside decode rows) replay piecewise graphs where our own forward runs the
model (piecewise_graphs.py: the stretches between two attention calls, captured per token bucket,
attention eager between them), and run eagerly with transformers' layers, which have no seam
between a layer's attention and the rest short of splitting them with torch.compile. Decode steps
are where launches dominate, one token per request, and a whole graph leaves none of them; a prompt
chunk's attention changes shape with every step, so no graph holds it. The device check
(scripts/gpu_check) reports the steps and time of each kind: whole graphs, pieces, eager.

Shapes. `Buckets` (buckets.py) on `q_padding_interval_size` and `kv_padding_interval_size`
(`DEFAULT_Q_INTERVAL` and `DEFAULT_KV_INTERVAL` where they are 0), `MAX_GRAPHS` at most; the builder
pads a step to its bucket with phantom rows (batch.py). A decode step larger than every bucket, in
requests or in context, has no whole graph: pieces serve it where they are captured, else it runs
eagerly.

Memory. The graphs draw from one memory pool, captured largest first so that each smaller one
reuses what the first drew; their static inputs are views of the front of one buffer per input,
sized by the largest shape (graphs replay one at a time), and their logits land in one buffer. The
piecewise graphs draw from the same pool, captured after these. The capture's time and memory are
logged once, at start.

A replay copies the step's inputs into the static ones (device to device, asynchronous), replays,
and selects the rows whose logits were asked for. The back end is a `Capture`: `cuda_capture` on a
device; `eager_capture` runs the same shapes and static inputs eagerly, for tests on a CPU and
`gpu_check --device cpu`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import structlog
import torch

from services.common.config import CBConfig
from services.worker.batch import BatchBuilder, BatchItem, ForwardBatch
from services.worker.buckets import Buckets, Shape

log = structlog.get_logger(__name__)

DEFAULT_Q_INTERVAL = 8  # requests: a decode step pads at most 7 phantom rows
DEFAULT_KV_INTERVAL = 256  # keys: attention reads at most 255 padded keys per request
MAX_GRAPHS = 128  # e.g. 64 requests x 4096 keys with the defaults

Step = Callable[[], None]
Capture = Callable[[Step], Step]  # runs a step once, as its capture; returns its replay


def cuda_capture(device: torch.device) -> Capture:
    """Capture into CUDA graphs sharing one memory pool and one capture stream."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)

    def capture(step: Step) -> Step:
        # A warm-up run on the capture stream first: lazy set-up (cuBLAS handles and workspaces,
        # kernel selection) must not happen inside a capture.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            step()
        torch.cuda.current_stream(device).wait_stream(stream)
        return graph.replay

    return capture


def eager_capture(step: Step) -> Step:
    """No graph: the step runs at its capture and again at every replay, on the same static inputs."""
    step()
    return step


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` (tensors in dicts, lists and dataclasses) with each tensor `t` replaced by `fn(t)`, in a
    fixed order: two batches of one shape give their tensors in the same order."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {key: _map_tensors(value, fn) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(value, fn) for value in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **fields)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    _map_tensors(obj, collect)
    return found


def _step_inputs(batch: ForwardBatch) -> list[torch.Tensor]:
    """What a step's graph reads besides the weights and the KV pool (`logits_indices` is read after
    the replay, not by it)."""
    metadata = _tensors(batch.attention.write_slots) + _tensors(batch.attention.groups)
    return [batch.input_ids, batch.position_ids, *metadata]


class _Arena:
    """One flat buffer per static input, sized by the first shape placed, which must be the largest."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def place(self, batch: ForwardBatch) -> ForwardBatch:
        """`batch` with its inputs moved into views of the buffers' fronts. The graphs own them: a
        builder's buffers take turns (async batching builds the next step during a replay)."""
        index = itertools.count()

        def view(t: torch.Tensor) -> torch.Tensor:
            i = next(index)
            if i == len(self._buffers):
                self._buffers.append(torch.empty(t.numel(), dtype=t.dtype, device=t.device))
            buffer = self._buffers[i]
            if buffer.numel() < t.numel() or buffer.dtype != t.dtype:
                raise RuntimeError(f"static input {i} ({t.dtype}, {t.numel()}) does not fit its buffer")
            return buffer[: t.numel()].view(t.shape).copy_(t)

        attention = batch.attention
        moved = dataclasses.replace(
            attention,
            write_slots=_map_tensors(attention.write_slots, view),
            groups=_map_tensors(attention.groups, view),
        )
        return dataclasses.replace(
            batch, input_ids=view(batch.input_ids), position_ids=view(batch.position_ids), attention=moved
        )

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)


@dataclasses.dataclass
class _Graph:
    inputs: ForwardBatch  # the static inputs the replay reads
    replay: Step


class CudaGraphs:
    """The decode graphs of one model runner (its KV pool's addresses are part of every graph)."""

    def __init__(self, builder: BatchBuilder, buckets: Buckets, vocab_size: int, capture: Capture) -> None:
        self.builder = builder
        self.buckets = buckets
        self.capture = capture  # the back end, whose memory pool piecewise graphs share
        self._graphs: dict[Shape, _Graph] = {}
        self._arena = _Arena()
        self._logits = torch.empty(buckets.max_tokens, vocab_size, device=builder.device)
        self.replays = 0
        self.eager_decodes = 0  # decode steps larger than every bucket (pieces may serve them)
        self.cost = CaptureCost()

    @classmethod
    def for_runner(
        cls,
        forward: Callable[[ForwardBatch], torch.Tensor],
        builder: BatchBuilder,
        config: CBConfig,
        max_keys: int,
        vocab_size: int,
        capture: Capture | None = None,
    ) -> CudaGraphs:
        """Buckets from `config` for decode steps reading up to `max_keys` keys, every one captured."""
        q = config.q_padding_interval_size or DEFAULT_Q_INTERVAL
        kv = config.kv_padding_interval_size or DEFAULT_KV_INTERVAL
        room = builder.input_buf.numel() // q * q  # the builder's static buffers hold the phantoms too
        if room == 0:
            raise ValueError(
                f"use_cuda_graph: a step of max_batch_tokens={config.max_batch_tokens} holds no bucket "
                f"of {q} tokens (q_padding_interval_size)"
            )
        max_tokens = min(config.max_requests_per_batch, config.max_batch_tokens, room)
        buckets = Buckets.plan(q, kv, max_tokens, max_keys, MAX_GRAPHS)
        graphs = cls(builder, buckets, vocab_size, capture or cuda_capture(builder.device))
        graphs.capture_all(forward)
        return graphs

    @property
    def count(self) -> int:
        return len(self._graphs)

    def capture_all(self, forward: Callable[[ForwardBatch], torch.Tensor]) -> None:
        """`forward`: the eager forward (logits of `batch.logits_indices`). Only the captures hold
        it, so that CUDA graphs do not keep their runner alive (nor it them) in a reference cycle."""
        # The builder's counters tell what real steps were padded by; the capture's builds are not steps.
        counters = (self.builder.padded_queries, self.builder.padded_keys)
        with measured(self.builder.device) as self.cost:
            for shape in self.buckets.shapes():
                self._graphs[shape] = self._capture_one(shape, forward)
        self.builder.padded_queries, self.builder.padded_keys = counters
        log.info(
            "cuda graphs captured",
            graphs=self.count,
            seconds=round(self.cost.seconds, 2),
            memory_mib=self.cost.memory_mib,
            static_input_mib=round(self._arena.nbytes / 2**20, 1),
            max_requests=self.buckets.max_tokens,
            max_context=self.buckets.max_keys,
            q_interval=self.buckets.q_interval,
            kv_interval=self.buckets.kv_interval,
        )

    def _capture_one(self, shape: Shape, forward: Callable[[ForwardBatch], torch.Tensor]) -> _Graph:
        # Requests reading exactly `shape.keys` keys, all from the padding chunk: the capture writes
        # only there (as every phantom row does later).
        pages = -(-shape.keys // self.builder.page_size)
        tables = [[0] * (pages * k) for k in self.builder.chunks_per_block]
        dummy = BatchItem(shape.keys - 1, [0], tables, sample=True)
        inputs = self._arena.place(self.builder.build([dummy] * shape.tokens, shape))
        logits = self._logits[: shape.tokens]

        def step() -> None:
            logits.copy_(forward(inputs))  # every row samples in `inputs`: all its logits

        return _Graph(inputs, self.capture(step))

    def shape_for(self, items: Sequence[BatchItem]) -> Shape | None:
        """The bucket of a decode step; None for another step or one larger than every bucket."""
        if any(len(it.token_ids) != 1 for it in items):
            return None
        shape = self.buckets.shape_of(len(items), self.builder.decode_keys(items))
        if shape is None:
            self.eager_decodes += 1
        return shape

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[R + P, vocab]` of `batch` (built for a bucket) by its graph's replay."""
        if batch.shape is None:
            raise ValueError("only a batch built for a bucket replays a graph")
        graph = self._graphs[batch.shape]
        for static, step in zip(_step_inputs(graph.inputs), _step_inputs(batch), strict=True):
            static.copy_(step, non_blocking=True)
        graph.replay()
        self.replays += 1
        return self._logits[: batch.shape.tokens].index_select(0, batch.logits_indices)


@dataclasses.dataclass
class CaptureCost:
    """What capturing a set of graphs took, logged once at start and reported by the device check."""

    seconds: float = 0.0
    memory_bytes: int | None = None  # device memory the graphs hold (None: not a CUDA device)

    @property
    def memory_mib(self) -> float | None:
        return None if self.memory_bytes is None else round(self.memory_bytes / 2**20, 1)


@contextlib.contextmanager
def measured(device: torch.device) -> Iterator[CaptureCost]:
    """The cost of the captures run within the block, filled in as it ends."""
    cost = CaptureCost()
    before = _free_bytes(device)
    started = time.perf_counter()
    yield cost
    cost.seconds = time.perf_counter() - started
    after = _free_bytes(device)
    if before is not None and after is not None:
        cost.memory_bytes = before - after


def _free_bytes(device: torch.device) -> int | None:
    """The device's free memory once its work is done; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]
