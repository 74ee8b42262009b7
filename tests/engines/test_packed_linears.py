"""The scheduler's view of the model (``engines/embedded/packed.py``): the engine's own parameters,
multi-row linears on oneDNN's packed weights, re-packed when the weights change; the plain path for
one row, for autograd, and where the packed copies would not fit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from polar_env.engines.embedded import packed
from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.packed import PackedLinear, decoding_view

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch build has no oneDNN packed linear")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32, bias=False))


def test_the_view_shares_the_parameters_and_packs_only_multi_row_inference() -> None:
    model = _model()
    view = decoding_view(model)
    assert view is not model and isinstance(view[0], PackedLinear) and isinstance(view[2], PackedLinear)
    assert view[0].weight is model[0].weight and view[2].weight is model[2].weight
    assert not any(isinstance(m, PackedLinear) for m in model.modules())  # the engine's model is untouched
    rows = torch.randn(5, 64)
    with torch.inference_mode():
        assert torch.allclose(view(rows), model(rows), rtol=1e-5, atol=1e-5)
        assert view[0].repacks == 1
        one = rows[:1]
        assert torch.equal(view(one), model(one))  # a lone row runs F.linear itself
    out = view(rows)  # outside inference mode: F.linear, with autograd
    out.sum().backward()
    assert model[0].weight.grad is not None and torch.equal(out, model(rows))


def test_a_weight_change_in_place_is_seen_at_the_next_forward() -> None:
    model = _model()
    view = decoding_view(model)
    rows = torch.randn(4, 64)
    with torch.inference_mode():
        view(rows)
    with torch.no_grad():
        model[0].weight.mul_(-1.0)
    with torch.inference_mode():
        assert torch.allclose(view(rows), model(rows), rtol=1e-5, atol=1e-5)
        assert view[0].repacks == 2 and view[2].repacks == 1


def test_a_reload_through_the_engine_reaches_the_batched_decode() -> None:
    engine = EmbeddedEngine()
    decoder = engine.scheduler.decoder
    assert decoder is not engine.model
    assert not any(isinstance(m, PackedLinear) for m in copy.deepcopy(engine.model).modules())  # the trainer's copy
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.inference_mode():
        before = decoder(input_ids=ids).logits
    state = {k: v * 0.5 for k, v in engine.model.state_dict().items()}
    engine.reload_weights(state)
    with torch.inference_mode():
        after, plain = decoder(input_ids=ids).logits, engine.model(input_ids=ids).logits
    assert not torch.allclose(before, after)
    assert torch.allclose(after, plain, rtol=1e-4, atol=1e-5)


def test_no_view_when_the_packed_copies_would_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    need = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(packed, "memory_available", lambda: int(need / packed.MEMORY_SHARE) - 1)
    assert decoding_view(model) is model
    monkeypatch.setattr(packed, "memory_available", lambda: int(need / packed.MEMORY_SHARE) + 1024)
    assert decoding_view(model) is not model


def test_no_view_without_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed, "available", lambda: False)
    model = _model()
    assert decoding_view(model) is model
    rows = torch.randn(3, 64)
    assert torch.equal(F.linear(rows, model[0].weight, model[0].bias), model[0](rows))
