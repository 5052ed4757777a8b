"""Batch builder: packs one step's scheduled tokens into a ragged batch plus attention metadata.

All index tensors are built with a handful of vectorised torch ops per step (Python work grows with
requests, not tokens or layers). A decode step on the native kernel computes its per-request values
on Python lists instead (`_build_decode`): it builds between two forwards, with the caches cold, where
each torch op costs 10-15 us. With `q_padding_interval_size` the packed length is rounded up and the
extra tokens write to the padding slot and belong to no row group; with `kv_padding_interval_size` each
row group's KV length is rounded up and the extra reads come from the padding slot, masked out. Inputs
are copied into static buffers sized once.

A decode step built for a bucket `Shape` (a CUDA graph's, see cuda_graphs.py) has exactly that shape:
its missing requests are phantom one-token rows at position 0 of the reserved padding chunk (they
write there, read only there and never sample), and its decode row group reads `shape.keys` keys.
Any step built for a token bucket (piecewise graphs', see piecewise_graphs.py) is padded to it as q
padding pads: token 0 at position 0, writing the padding slot, in no row group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.kv_geometry import PADDING_SLOT, KVGeometry
from services.worker.attention import AttentionBatch, RaggedPrefill, RowGroup
from services.worker.buckets import Shape, round_up
from services.worker.kernels import PagedDecode, PagedPrefill


@dataclass(frozen=True)
class BatchItem:
    """Compute `token_ids` (the request's tokens at positions `[start, start + len)`) with `tables`.

    `logit_rows` are positions (of those computed) whose logits the step also returns, besides the
    last token's when it samples: a prompt-logprobs request's prompt rows; empty for any other."""

    start: int
    token_ids: list[int]
    tables: list[list[int]]
    sample: bool
    logit_rows: range = range(0)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [1, T_pad]
    position_ids: torch.Tensor  # [1, T_pad]
    # [R + P]: packed index of each sampling item's last token, then of the items' `logit_rows`
    logits_indices: torch.Tensor
    attention: AttentionBatch
    shape: Shape | None = None  # the bucket it was built for (a decode step whose graph replays)
    piecewise: int | None = None  # the token bucket it was padded to (its piecewise graphs replay)
    # Placeholders filled on the device (async batching): input row `fill_rows[i]` takes the token
    # the step before sampled in its sampling row `fill_sources[i]`, when the forward starts.
    fill_rows: torch.Tensor | None = None
    fill_sources: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None  # CUDA: the build's copies are done once it has happened


def first_keys(start: torch.Tensor, window: int | None) -> torch.Tensor:
    """Position of the first key each request's chunk (starting at `start`) can see."""
    return (start - window + 1).clamp(min=0) if window is not None else torch.zeros_like(start)


@dataclass(frozen=True)
class GroupIndex:
    """One step's per-request index tensors, seen from one allocator group (its window and views)."""

    starts: torch.Tensor  # [R]: position of each request's first token this step
    ends: torch.Tensor  # [R]: one past its last
    offsets: torch.Tensor  # [R]: packed row of its first token
    window: int | None
    views: list[tuple[int, int]]
    tables: dict[tuple[int, int], torch.Tensor]

    def select(self, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(start, end, offset, first key)` of the requests `sel`."""
        start = self.starts[sel]
        return start, self.ends[sel], self.offsets[sel], first_keys(start, self.window)


# A prefill row group pads every request to its longest query and key lengths; a request joins a
# group only while the padded work stays within a factor of the real work, by device type. On a CPU
# the attention's work is the cost. On a GPU a group costs about fifteen kernel launches a layer and
# the padded work next to nothing: launches, not FLOPs, bound a GPU's eager prefill step
# (`scripts/gpu_check --sections profile` shows it).
PADDING_WASTE = {"cpu": 1.25, "cuda": 8.0}


def prefill_groups(
    prefill: list[int], num_queries: list[int], num_keys: list[int], waste: float = PADDING_WASTE["cpu"]
) -> list[list[int]]:
    """Partition prefill requests (indices into the step's items) into row groups of similar shape,
    each padded to at most `waste` times its real work.

    One group of a 300-token prompt and a 60-token chunk would attend 2 x 300 x 300 where 300 x 300 +
    60 x 60 is needed; each extra group costs one more attention call per layer instead."""
    order = sorted(prefill, key=lambda i: num_queries[i] * num_keys[i], reverse=True)
    groups: list[list[int]] = []
    q_max = k_max = work = 0
    for i in order:
        q, k = num_queries[i], num_keys[i]
        if groups:
            padded = (len(groups[-1]) + 1) * max(q_max, q) * max(k_max, k)
            if padded <= waste * (work + q * k):
                groups[-1].append(i)
                q_max, k_max, work = max(q_max, q), max(k_max, k), work + q * k
                continue
        groups.append([i])
        q_max, k_max, work = q, k, q * k
    return groups


class BatchBuilder:
    def __init__(
        self,
        geometry: KVGeometry,
        kv_of_layer: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch_tokens: int,
        query_group: int,
        dtype: torch.dtype = torch.float32,
        q_padding: int = 0,
        kv_padding: int = 0,
        device: torch.device | str = "cpu",
        decode_kernel: PagedDecode | None = None,
        prefill_kernel: PagedPrefill | None = None,
        num_buffers: int = 1,
    ) -> None:
        self.geometry = geometry
        self.page_size = geometry.page_size
        self.kv_of_layer = kv_of_layer
        self.query_group = query_group  # query heads per KV head
        self.dtype = dtype
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.q_padding = q_padding
        self.kv_padding = kv_padding
        self.device = torch.device(device)
        self.padding_waste = PADDING_WASTE.get(self.device.type, PADDING_WASTE["cpu"])
        self.views_of_layer = [(p.group, p.sub) for p in geometry.placements]
        self.views = sorted(set(self.views_of_layer))
        self.windows = [geometry.sliding_window if kind == "sliding" else None for kind in geometry.groups]
        self.chunks_per_block = [geometry.chunks_per_block(g) for g in range(len(geometry.groups))]
        # A phantom request: token 0 at position 0 of chunk 0, so that it writes PADDING_SLOT alone.
        self.phantom = BatchItem(0, [0], [[0] * k for k in self.chunks_per_block], sample=False)
        capacity = round_up(max_batch_tokens, q_padding)
        # Each build takes the next of `num_buffers` input pairs: async batching builds a step while
        # the forward of the one before still reads its inputs.
        self._buffers = deque(
            tuple(torch.zeros(capacity, dtype=torch.long, device=self.device) for _ in range(2))
            for _ in range(num_buffers)
        )
        self.input_buf, self.position_buf = self._buffers[0]
        # Since start: outputs match with or without chunking and padding, so these counts are how a
        # test (tests/test_engine_parity.py) knows that a configuration chunked or padded at all.
        self.prompt_chunks = 0  # items computing part of a prompt, short of its last token
        self.padded_queries = 0  # positions q padding added to the packed batch
        self.padded_keys = 0  # key positions kv padding added, summed over row groups

    def decode_keys(self, items: Sequence[BatchItem]) -> int:
        """Keys the longest of these one-token requests reads, in the allocator group that reads most."""
        longest = max(it.start for it in items) + 1
        if None in self.windows:
            return longest
        return min(longest, max(w for w in self.windows if w is not None))

    def build(
        self, items: Sequence[BatchItem], shape: Shape | None = None, tokens: int | None = None
    ) -> ForwardBatch:
        """`shape`: a decode step (every item one token) padded to that bucket, phantom rows and all.
        `tokens`: any step padded to that many packed tokens (a piecewise graphs' bucket), the extra
        ones writing the padding slot and in no row group, as q padding's are."""
        if shape is not None and tokens is not None:
            raise ValueError(f"a step is built for a {shape} bucket or for {tokens} tokens, not both")
        self._buffers.rotate(-1)
        self.input_buf, self.position_buf = self._buffers[0]
        self.prompt_chunks += sum(1 for it in items if not it.sample)
        if all(len(it.token_ids) == 1 and not it.logit_rows for it in items):
            batch = self._build_decode(items, shape, tokens)
        elif shape is not None:
            raise ValueError(f"a {shape} bucket takes one-token requests only")
        else:
            batch = self._build_any(items, tokens)
        batch.piecewise = tokens
        return batch

    def _padded(self, num_tokens: int, tokens: int | None) -> int:
        """The packed length of a step of `num_tokens` tokens: `tokens` where given, else q padding's."""
        padded = round_up(num_tokens, self.q_padding) if tokens is None else tokens
        if padded < num_tokens:
            raise ValueError(f"a batch of {num_tokens} tokens does not fit a bucket of {tokens}")
        if padded > self.input_buf.numel():
            raise ValueError(
                f"batch of {num_tokens} tokens exceeds the static buffer {self.input_buf.numel()}"
            )
        return padded

    def _build_any(self, items: Sequence[BatchItem], tokens: int | None = None) -> ForwardBatch:
        dev = self.device
        lens_list = [len(it.token_ids) for it in items]
        num_tokens = sum(lens_list)
        padded = self._padded(num_tokens, tokens)
        self.padded_queries += padded - num_tokens
        flat_ids = [t for it in items for t in it.token_ids]
        starts = torch.tensor([it.start for it in items], dtype=torch.long)
        lens = torch.tensor(lens_list, dtype=torch.long)
        offsets = torch.cumsum(lens, 0) - lens  # packed index of each request's first token
        req_of_token = torch.repeat_interleave(torch.arange(len(items)), lens)
        positions = starts[req_of_token] + torch.arange(num_tokens) - offsets[req_of_token]
        ends = starts + lens

        self.input_buf[:padded].zero_()
        self.input_buf[:num_tokens] = torch.tensor(flat_ids, dtype=torch.long)
        self.position_buf[:padded].zero_()
        self.position_buf[:num_tokens] = positions
        sample_idx = [i for i, it in enumerate(items) if it.sample]
        logits_indices = (offsets + lens - 1)[sample_idx]
        extra = [
            torch.arange(it.logit_rows.start, it.logit_rows.stop) - it.start + offsets[i]
            for i, it in enumerate(items)
            if it.logit_rows
        ]
        if extra:
            logits_indices = torch.cat([logits_indices, *extra])

        page = self.page_size
        tables = {view: self._table(self._pages(items, view)) for view in self.views}
        page_of_token = positions // page
        write_slots = {}
        for view, table in tables.items():
            slots = torch.full((padded,), PADDING_SLOT, dtype=torch.long)
            slots[:num_tokens] = table[req_of_token, page_of_token] * page + positions % page
            write_slots[view] = slots.to(dev)

        decode = [i for i, n in enumerate(lens_list) if n == 1]
        prefill = [i for i, n in enumerate(lens_list) if n > 1]
        ragged = self.prefill_kernel is not None and bool(prefill)
        selections = [decode] if decode else []
        if not ragged:
            selections += prefill_groups(prefill, lens_list, ends.tolist(), self.padding_waste)
        groups: dict[int, list[RowGroup]] = {}
        prefill_of_group: dict[int, RaggedPrefill] = {}
        # Row groups expand the tables into [B, L] slots and masks where the batch goes: on a GPU a few
        # launches, not megabytes built on the host and copied over (on the CPU the move is a no-op).
        device_tables = {view: table.to(dev) for view, table in tables.items()}
        for g, window in enumerate(self.windows):
            views = [v for v in self.views if v[0] == g]
            index = GroupIndex(starts, ends, offsets, window, views, device_tables)
            groups[g] = [self._row_group(torch.tensor(sel, dtype=torch.long), index) for sel in selections]
            if ragged:
                prefill_of_group[g] = self._ragged(torch.tensor(prefill, dtype=torch.long), index)
        attention = AttentionBatch(
            num_tokens=padded,
            write_slots=write_slots,
            groups=groups,
            views_of_layer=self.views_of_layer,
            kv_of_layer=self.kv_of_layer,
            decode_kernel=self.decode_kernel,
            prefill=prefill_of_group,
            prefill_kernel=self.prefill_kernel,
        )
        return ForwardBatch(
            input_ids=self.input_buf[:padded].unsqueeze(0),
            position_ids=self.position_buf[:padded].unsqueeze(0),
            logits_indices=logits_indices.to(dev),
            attention=attention,
        )

    def _build_decode(
        self, items: Sequence[BatchItem], shape: Shape | None, tokens: int | None
    ) -> ForwardBatch:
        """`_build_any` for one-token items: the same batch, its per-request values computed on Python
        lists, turned into a few tensors for the device, and expanded there into the `[B, L]` slots
        (and, without the native decode kernel, the mask). A decode step builds between two forwards,
        with the caches cold, where each torch op costs microseconds: fewer ops make a shorter build.
        On a GPU the host's work between graph replays bounds a decode step, and this build issues
        about half the general one's device operations and copies."""
        if shape is not None:
            if len(items) > shape.tokens:
                raise ValueError(f"a {shape} bucket takes at most {shape.tokens} one-token requests")
            phantoms = shape.tokens - len(items)
            items = [*items, *[self.phantom] * phantoms]
        else:
            phantoms = 0
        dev = self.device
        n = len(items)
        padded = self._padded(n, tokens)
        page = self.page_size
        starts = [it.start for it in items]
        tail = padded - n
        self.input_buf[:padded] = torch.tensor([it.token_ids[0] for it in items] + [0] * tail)
        self.position_buf[:padded] = torch.tensor(starts + [0] * tail)
        self.padded_queries += tail + phantoms
        pages = {view: self._pages(items, view) for view in self.views}
        write_slots = {
            view: torch.tensor(
                [max(row[s // page], 0) * page + s % page for row, s in zip(rows, starts, strict=True)]
                + [PADDING_SLOT] * tail
            ).to(dev)
            for view, rows in pages.items()
        }
        rows_of_batch = torch.arange(n, device=dev)
        groups: dict[int, list[RowGroup]] = {}
        for g, window in enumerate(self.windows):
            first_list = [max(s - window + 1, 0) for s in starts] if window is not None else [0] * n
            length_list = [s + 1 - lo for s, lo in zip(starts, first_list, strict=True)]
            longest = max(length_list)
            kv_len = shape.keys if shape is not None else round_up(longest, self.kv_padding)
            self.padded_keys += kv_len - longest
            first, lengths = torch.tensor([first_list, length_list]).to(dev)
            key_idx = torch.arange(kv_len, device=dev)[None, :]
            key_pos = first[:, None] + key_idx  # [B, L]
            key_ok = key_idx < lengths[:, None]
            views = [v for v in self.views if v[0] == g]
            # Clamped to the first view's width, as `_slots` does: the slots past it are masked anyway.
            width = max(len(row) for row in pages[views[0]])
            page_idx = (key_pos // page).clamp_(max=width - 1)
            in_page = key_pos % page
            slots = {}
            for view in views:
                chunk = self._table(pages[view]).to(dev).gather(1, page_idx)
                slots[view] = torch.where(key_ok, chunk * page + in_page, PADDING_SLOT).view(-1)
            bias = None
            if self.decode_kernel is None:  # SDPA's mask, folded for GQA: [B, 1, group, L]
                bias = self._bias(key_ok[:, None, None, :].expand(n, 1, self.query_group, kv_len))
            groups[g] = [RowGroup(rows_of_batch, None, None, 1, kv_len, bias, lengths, slots)]
        attention = AttentionBatch(
            num_tokens=padded,
            write_slots=write_slots,
            groups=groups,
            views_of_layer=self.views_of_layer,
            kv_of_layer=self.kv_of_layer,
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
        )
        sampled = [i for i, it in enumerate(items) if it.sample]
        return ForwardBatch(
            input_ids=self.input_buf[:padded].unsqueeze(0),
            position_ids=self.position_buf[:padded].unsqueeze(0),
            logits_indices=torch.tensor(sampled, dtype=torch.long).to(dev),
            attention=attention,
            shape=shape,
        )

    def _pages(self, items: Sequence[BatchItem], view: tuple[int, int]) -> list[list[int]]:
        """Each item's chunk ids in one view, a page each (RECYCLED holes negative)."""
        group, sub = view
        k = self.chunks_per_block[group]
        return [it.tables[group][sub::k] for it in items]

    @staticmethod
    def _table(rows: list[list[int]]) -> torch.Tensor:
        """`[R, pages]` of `_pages` rows (RECYCLED holes and padding read as the padding chunk)."""
        width = max(len(r) for r in rows)
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        return table.clamp_(min=0)

    def _slots(
        self, sel: torch.Tensor, key_pos: torch.Tensor, key_ok: torch.Tensor, index: GroupIndex
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Per view, the pool slot `[B, L]` of each key position (the padding slot where not `key_ok`)."""
        page = self.page_size
        page_idx = (key_pos // page).clamp(max=index.tables[index.views[0]].shape[1] - 1)
        slots = {}
        for view in index.views:
            chunk = index.tables[view][sel[:, None], page_idx]
            slots[view] = torch.where(key_ok, chunk * page + key_pos % page, PADDING_SLOT).to(self.device)
        return slots

    def _ragged(self, sel: torch.Tensor, index: GroupIndex) -> RaggedPrefill:
        start, end, offset, lo = index.select(sel)
        key_pos = lo[:, None] + torch.arange(int((end - lo).max()))[None, :]
        return RaggedPrefill(
            first_rows=offset.to(self.device),
            num_queries=(end - start).to(self.device),
            lengths=(end - lo).to(self.device),
            slots=self._slots(sel, key_pos, key_pos < end[:, None], index),
            window=index.window or 0,
            max_queries=int((end - start).max()),
        )

    def _bias(self, visible: torch.Tensor) -> torch.Tensor:
        """SDPA's additive mask from a boolean one: 0 where a query may attend, -inf elsewhere."""
        return torch.zeros(visible.shape, dtype=self.dtype, device=visible.device).masked_fill_(
            ~visible, float("-inf")
        )

    def _row_group(self, sel: torch.Tensor, index: GroupIndex) -> RowGroup:
        start, end, offset, lo = index.select(sel)
        window = index.window
        num_q = int((end - start).max())
        longest = int((end - lo).max())
        kv_len = round_up(longest, self.kv_padding)
        self.padded_keys += kv_len - longest
        dev = self.device
        kept = kept_rows = None
        if bool(((end - start) < num_q).any()):  # on the host: the index tensors are still there
            q_idx = torch.arange(num_q)
            kept = ((q_idx[None, :] < (end - start)[:, None]).view(-1)).nonzero().view(-1)
            kept_rows = (offset[:, None] + q_idx[None, :]).view(-1)[kept].to(dev)
            kept = kept.to(dev)
        sel, start, end, offset, lo = (t.to(dev) for t in (sel, start, end, offset, lo))
        key_pos = lo[:, None] + torch.arange(kv_len, device=dev)[None, :]  # [B, L]
        key_ok = key_pos < end[:, None]
        slots = {view: s.view(-1) for view, s in self._slots(sel, key_pos, key_ok, index).items()}
        if num_q == 1 and self.decode_kernel is not None:  # it reads `lengths`, no mask
            return RowGroup(offset, None, None, 1, kv_len, None, end - lo, slots)
        q_idx = torch.arange(num_q, device=dev)
        valid_q = q_idx[None, :] < (end - start)[:, None]  # [B, Q]
        rows = torch.where(valid_q, offset[:, None] + q_idx[None, :], 0).reshape(-1)
        query_pos = start[:, None] + q_idx[None, :]  # [B, Q]
        mask = key_ok[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])
        if window is not None:
            mask &= key_pos[:, None, :] > query_pos[:, :, None] - window
        # A padded query row must still see one key, or softmax over nothing gives NaN.
        mask[:, :, 0] |= ~valid_q
        # Fold the mask like the queries: row (g, q) of the [group * Q] axis uses query q's mask.
        g = self.query_group
        mask = mask[:, None, None].expand(-1, 1, g, -1, -1).reshape(len(sel), 1, g * num_q, kv_len)
        return RowGroup(
            rows=rows,
            kept=kept,
            kept_rows=kept_rows,
            num_queries=num_q,
            num_keys=kv_len,
            bias=self._bias(mask),
            lengths=end - lo,
            slots=slots,
        )
