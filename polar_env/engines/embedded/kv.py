"""The running batch's KV: every row's keys and values in one preallocated slab per layer.

A decode step writes one column in place instead of concatenating the whole cache (with
``DynamicCache`` a step copied every row's KV, 46 KB a token on SmolLM2: 0.7 GB a step for 16
rows of 1k tokens). Rows are left-padded to a common width; ``mask`` marks each row's real
columns, which need not be contiguous (a row prefilled beside longer prompts has a masked gap
between its kept prefix and its new tokens). The keys already carry their rotary positions, so a
row attends to exactly its own tokens whatever columns they sit in. Rows join (the slab is
rebuilt, wider if a joiner is longer) and leave (rows dropped, and the columns that were padding
in every remaining row) only at step boundaries.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import DynamicCache

SPARE = 64
"""Columns allocated past the current width; the slab doubles when a step reaches its end."""


class _KV(Protocol):
    keys: torch.Tensor
    values: torch.Tensor


def kv_layers(cache: DynamicCache) -> list[_KV]:
    """The cache's layers as plain full-attention KV (what padding into a batch needs)."""
    from transformers.cache_utils import DynamicLayer

    layers: list[_KV] = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or not isinstance(layer.keys, torch.Tensor):
            raise TypeError(f"cannot batch a {type(layer).__name__} cache layer")
        layers.append(cast(_KV, layer))
    return layers


@functools.cache
def _slab_layer_class() -> type:
    """``SlabLayer``, a transformers ``DynamicLayer`` (defined once transformers is imported)."""
    from transformers.cache_utils import DynamicLayer

    class SlabLayer(DynamicLayer):
        """``keys``/``values`` are views of the slab's first ``length`` columns."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
            self.device, self.is_initialized = keys.device, True
            self.length = keys.shape[-2]
            self.slab_k = _spare(keys, self.length + SPARE)
            self.slab_v = _spare(values, self.length + SPARE)
            self._views()

        def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.slab_k[:, :, : self.length], self.slab_v[:, :, : self.length]
            self.keys, self.values = keys, values
            return keys, values

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
                   **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
            end = self.length + key_states.shape[-2]
            if end > self.slab_k.shape[-2]:
                self.slab_k = _spare(self.slab_k[:, :, : self.length], max(end, 2 * self.slab_k.shape[-2]))
                self.slab_v = _spare(self.slab_v[:, :, : self.length], max(end, 2 * self.slab_v.shape[-2]))
            self.slab_k[:, :, self.length: end] = key_states
            self.slab_v[:, :, self.length: end] = value_states
            self.length = end
            return self._views()

        def crop(self, tokens_to_remove: int) -> None:
            self.length -= abs(tokens_to_remove)
            self._views()

    return SlabLayer


def _spare(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """``tensor`` copied into a new slab of ``columns`` columns (the rest uninitialised)."""
    slab = tensor.new_empty((*tensor.shape[:2], columns, tensor.shape[-1]))
    slab[:, :, : tensor.shape[-2]] = tensor
    return slab


Layers = list[tuple[torch.Tensor, torch.Tensor]]


class BatchKV:
    """The running rows' KV (a cache the model updates in place) and their mask, ``[rows, width]``."""

    def __init__(self, layers: Layers, mask: torch.Tensor) -> None:
        from transformers import DynamicCache

        slab = _slab_layer_class()
        self.cache = DynamicCache()
        self.cache.layers = [slab(keys, values) for keys, values in layers]
        self.mask = mask  # long, 1 on real columns
        self.dense = bool(mask.all())  # no padding anywhere: a lone row runs the unmasked path

    @classmethod
    def of(cls, cache: DynamicCache, mask: torch.Tensor) -> BatchKV:
        return cls([(kv.keys, kv.values) for kv in kv_layers(cache)], mask)

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def step_mask(self) -> torch.Tensor:
        """The mask for one more column (the token this step runs), kept for the next step."""
        self.mask = F.pad(self.mask, (0, 1), value=1)
        return self.mask

    def joined(self, cache: DynamicCache, mask: torch.Tensor) -> BatchKV:
        """This batch with ``cache``'s rows appended, everything left-padded to the wider width."""
        width = max(self.width, int(mask.shape[1]))
        ours, theirs = kv_layers(self.cache), kv_layers(cache)
        data = [(torch.cat([_left_pad(a.keys, width), _left_pad(b.keys, width)]),
                 torch.cat([_left_pad(a.values, width), _left_pad(b.values, width)]))
                for a, b in zip(ours, theirs, strict=True)]
        masks = torch.cat([F.pad(self.mask, (width - self.width, 0)), F.pad(mask, (width - mask.shape[1], 0))])
        return BatchKV(data, masks)

    def select(self, keep: list[int]) -> BatchKV:
        """Only these rows, without the columns that are padding in every one of them."""
        index = torch.tensor(keep)
        mask = self.mask[index]
        start = int(mask.any(0).int().argmax())
        data = [(kv.keys[index, :, start:], kv.values[index, :, start:]) for kv in kv_layers(self.cache)]
        return BatchKV(data, mask[:, start:])

    def row(self, i: int) -> DynamicCache:
        """Row ``i``'s KV alone, its real columns in order (for the prefix cache)."""
        columns = self.mask[i].nonzero().squeeze(1)
        return _dynamic([(kv.keys[i: i + 1, :, columns], kv.values[i: i + 1, :, columns])
                         for kv in kv_layers(self.cache)])


def pad_together(caches: list[DynamicCache | None], lengths: list[int]) -> tuple[DynamicCache, torch.Tensor]:
    """Several rows' caches (None: empty) as one, left-padded to the longest, and its mask."""
    from transformers import DynamicCache

    width = max(lengths)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    present = [kv_layers(c) for c in caches if c is not None and c.get_seq_length() > 0]
    if width == 0 or not present:
        return DynamicCache(), mask
    template = present[0]
    data = []
    for li, layer in enumerate(template):
        keys, values = [], []
        for cache in caches:
            if cache is None or cache.get_seq_length() == 0:
                keys.append(layer.keys.new_zeros((1, *layer.keys.shape[1:2], width, layer.keys.shape[-1])))
                values.append(layer.values.new_zeros((1, *layer.values.shape[1:2], width, layer.values.shape[-1])))
            else:
                kv = kv_layers(cache)[li]
                keys.append(_left_pad(kv.keys, width))
                values.append(_left_pad(kv.values, width))
        data.append((torch.cat(keys), torch.cat(values)))
    return _dynamic(data), mask


def _dynamic(data: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=data)


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(tensor, (0, 0, width - tensor.shape[-2], 0)) if tensor.shape[-2] < width else tensor
