"""The scheduler's view of the model: the same parameters, multi-row linears on oneDNN's packed weights.

PyTorch's fp32 ``F.linear`` on CPU goes to MKL, whose GEMM for a few rows against a large weight
runs at a fraction of this machine's speed (SmolLM2's 576 → 49,152 head: 19.6 ms for 4 rows
against 9.5 ms with the weight reordered once for oneDNN, the layout torch.compile's CPU freezing
uses). A batched decode step is exactly that shape: rows = requests. The view shares every
parameter with the engine's model, so a weight reload (in place, under ``exclusive()``) is seen at
once; a linear re-packs its weight the first time it runs after the weight changed (its tensor
version or storage moved). One-row inputs (a lone decode) and anything outside inference mode run
the plain ``F.linear``, exactly as before. Cost: one packed copy of every linear weight (SmolLM2:
+540 MB resident). The trainer's copy of the model (``copy.deepcopy(engine.model)``) never sees
the view.
"""

from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path
from typing import TypeGuard

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MEMORY_SHARE = 0.25
"""The packed copies may take at most this share of the memory available at start; past it the
scheduler decodes on the plain model (a 4B model's 16 GB of fp32 linears would need 16 GB more)."""


def memory_available() -> int | None:
    """``MemAvailable`` from /proc/meminfo, in bytes; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@functools.cache
def available() -> bool:
    """oneDNN's packed linear is in this torch build (CPU wheels have it; builds without mkldnn do not)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), None)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(3, 2), weight, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.equal(out, torch.full((3, 2), 2.0)))


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` over the original's parameters, with a oneDNN-packed copy for multi-row inference."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed: torch.Tensor | None = None
        self._packed_of: tuple[int, int] = (-1, -1)  # the (storage, version) the packed copy was made from
        self.repacks = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.numel() <= x.shape[-1] or not torch.is_inference_mode_enabled():
            return F.linear(x, self.weight, self.bias)
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or key != self._packed_of:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
            self._packed_of = key
            self.repacks += 1
        flat = x.reshape(-1, x.shape[-1])
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _packable(module: torch.nn.Module) -> TypeGuard[torch.nn.Linear]:
    return isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32


def decoding_view(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s modules copied around its own parameters and buffers (nothing is duplicated but
    the packed weights), each fp32 ``nn.Linear`` a ``PackedLinear``; ``model`` itself when this
    torch has no packed linear or the copies would take more than ``MEMORY_SHARE`` of the memory
    available."""
    if not available():
        return model
    need = sum(m.weight.numel() * 4 for m in model.modules() if _packable(m))
    free = memory_available()
    if free is not None and need > MEMORY_SHARE * free:
        log.warning("embedded engine: decoding without packed linears (they would take %.1f GB of the %.1f GB "
                    "available; batched steps run MKL's slower GEMM)", need / 1e9, free / 1e9)
        return model
    shared: dict[int, object] = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    view = copy.deepcopy(model, memo=shared)
    for name, module in [(n, m) for n, m in view.named_modules() if _packable(m)]:
        parent_name, _, child = name.rpartition(".")
        parent = view.get_submodule(parent_name) if parent_name else view
        setattr(parent, child, PackedLinear(module))
    return view
