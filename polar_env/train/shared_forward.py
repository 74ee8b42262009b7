"""The trainer's forward with one prefix per group: the group's shared prefix runs once, and each
member's suffix runs over that prefix's KV cache.

Causal attention makes this exact: a suffix token sees the prefix's keys and values whichever
forward computed them, so each member's response logprobs equal those of its full forward (within
float tolerance; ``tests/train/test_shared_forward.py``). The prefix holds no scored position
(``polar_env.trajectory.group_prefix.shared_prefix_len``), so every logit comes from a suffix.

Gradients. The prefix's keys and values are handed to the suffixes as detached leaves: each
member's loss can then be backpropagated on its own (the trainer's chunks), accumulating the
gradient w.r.t. the prefix's KV on those leaves, and ``SharedPrefix.backward`` pushes that
accumulated gradient through the prefix's graph once, after the group's last member. The sum is
the gradient of the full forwards: d/dθ = direct suffix terms + (dL/dKV) · (dKV/dθ).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache


class SharedPrefix:
    """A group's prefix forwarded once (with autograd when grad is enabled)."""

    def __init__(self, model: torch.nn.Module, prefix_ids: list[int]) -> None:
        from transformers import DynamicCache, PretrainedConfig
        from transformers.cache_utils import CacheLayerMixin

        config = model.config
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"a shared prefix needs a transformers model, not a {type(model).__name__}")
        self.model, self.config = model, config
        self.ids = list(prefix_ids)
        self.length = len(prefix_ids)
        cache = DynamicCache(config=config)
        model(input_ids=torch.tensor([prefix_ids]), cache=cache, use_cache=True, logits_to_keep=1)
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in cache.layers:
            if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
                raise ValueError(f"a shared prefix needs key/value cache layers, not {type(layer).__name__}")
            self._kv.append((layer.keys, layer.values))
        self._leaves = [(k.detach().requires_grad_(k.requires_grad), v.detach().requires_grad_(v.requires_grad))
                        for k, v in self._kv]

    def cache(self) -> DynamicCache:
        """A fresh cache over the prefix's leaves: a suffix forward appends to it, never to them."""
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=self._leaves, config=self.config)

    def backward(self) -> None:
        """Push the gradient the members left on the leaves through the prefix's graph, once."""
        outputs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for (k, v), (lk, lv) in zip(self._kv, self._leaves, strict=True):
            for out, leaf in ((k, lk), (v, lv)):
                if out.requires_grad and leaf.grad is not None:
                    outputs.append(out)
                    grads.append(leaf.grad)
        if outputs:
            torch.autograd.backward(outputs, grads)
        self._kv, self._leaves = [], []  # the graph and its buffers go now, not at the next group


def suffix_logprobs(
    prefix: SharedPrefix, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs of ``response_ids`` after ``prompt_ids``, forwarding only what follows the shared
    prefix: the same arithmetic as ``engines.embedded.model.response_logprobs`` on the full ids."""
    if not 0 < prefix.length < len(prompt_ids) or prompt_ids[: prefix.length] != prefix.ids:
        raise ValueError(f"the shared prefix ({prefix.length} ids) must start the prompt ({len(prompt_ids)} ids) "
                         "and end before its last id")
    suffix = (prompt_ids + response_ids)[prefix.length:]
    out = prefix.model(input_ids=torch.tensor([suffix]), cache=prefix.cache(), use_cache=True,
                       logits_to_keep=len(response_ids) + 1)
    logits = out.logits[0, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(response_ids).unsqueeze(1)).squeeze(1)
