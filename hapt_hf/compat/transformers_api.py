"""transformers internals the pipeline stages call (tested on transformers 5.23 and 5.24).

A stage must build the very masks and compute the very loss the full model does, so it calls
the functions the model's own forward calls; transformers exports them from modules it does
not document as public (``transformers.masking_utils``, ``transformers.loss.loss_utils``).
"""
from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

__all__ = ["SLIDING_ATTENTION", "attention_mask", "causal_lm_loss_sum", "causal_lm_tp_plan",
           "init_module_buffers", "supports_sdpa"]

SLIDING_ATTENTION = "sliding_attention"
"""The attention kind (``config.layer_types`` entry) masked by a sliding window."""
_CACHE_ARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters \
    else "past_key_values"
"""The mask builders' name for the KV cache: ``cache`` from transformers 5.24 (which deprecates
``past_key_values`` with a FutureWarning), ``past_key_values`` before."""


def attention_mask(kind: str, *, config: Any, inputs_embeds: Tensor,
                   attention_mask: Tensor | None, past_key_values: Any,
                   position_ids: Tensor | None) -> Any:
    """The mask a decoder layer of attention ``kind`` receives, as the full model builds it.

    ``kind`` is ``"full_attention"`` or ``"sliding_attention"``; the result is in the form the
    configured attention implementation expects (a tensor, a block mask, or None);
    ``past_key_values`` is the (empty) cache the full model builds its mask with. Tested on
    transformers 5.23 and 5.24 (``masking_utils.create_causal_mask`` and
    ``create_sliding_window_causal_mask`` with ``inputs_embeds=``, no ``cache_position``, the
    cache as ``past_key_values=`` up to 5.23 and ``cache=`` from 5.24).
    """
    build = create_sliding_window_causal_mask if kind == SLIDING_ATTENTION \
        else create_causal_mask
    return build(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                 position_ids=position_ids, **{_CACHE_ARG: past_key_values})


def causal_lm_loss_sum(logits: Tensor, labels: Tensor, vocab_size: int) -> Tensor:
    """The SUM of per-token cross-entropies over shifted labels that are not -100 (0-dim).

    transformers' own causal-LM loss (what ``model(labels=...)`` computes), made a plain sum
    by ``num_items_in_batch=1``. Tested on transformers 5.23 (``loss.loss_utils.ForCausalLMLoss``).
    """
    return ForCausalLMLoss(logits, labels, vocab_size=vocab_size, num_items_in_batch=1)


def init_module_buffers(model: Any, module: Any) -> None:
    """Fill ``module``'s computed (non-persistent) buffers as ``model``'s initialisation does.

    Buffers such as GPT-J's sinusoidal position table are neither in a checkpoint nor drawn from
    the RNG: the model's ``_init_weights`` writes them. Called on one module (not its children);
    the module's own parameters and the RNG state are restored around it, so only buffers change.
    Tested on transformers 5.23 (``PreTrainedModel._init_weights``).
    """
    import torch

    rng = torch.get_rng_state()
    params = {n: p.detach().clone() for n, p in module.named_parameters(recurse=False)}
    with torch.no_grad():
        model._init_weights(module)
        for n, p in module.named_parameters(recurse=False):
            p.copy_(params[n])
    torch.set_rng_state(rng)


def supports_sdpa(config: Any) -> bool:
    """Whether the causal-LM class transformers builds for ``config`` runs with
    ``attn_implementation="sdpa"``: the class's ``_supports_sdpa`` flag, the one
    ``from_config`` checks before it refuses sdpa. The class is the one
    ``MODEL_FOR_CAUSAL_LM_MAPPING`` gives for the config's class (the one named in
    ``config.architectures`` where the mapping offers several). A config no causal-LM class
    takes gives False. Tested on transformers 5.24 (every accepted model type: the flag agrees
    with building the model with sdpa).
    """
    cls = _causal_lm_class(config)
    return bool(getattr(cls, "_supports_sdpa", False))


def causal_lm_tp_plan(config: Any) -> dict[str, str] | None:
    """The tensor-parallel plan of the causal-LM class transformers builds for ``config``
    beyond its base model (``LlamaForCausalLM._tp_plan == {"lm_head":
    "colwise_gather_output"}``); None where the class has none or no class takes the config.
    Tested on transformers 5.24."""
    plan = getattr(_causal_lm_class(config), "_tp_plan", None)
    return dict(plan) if plan else None


def _causal_lm_class(config: Any) -> Any:
    """The class ``MODEL_FOR_CAUSAL_LM_MAPPING`` gives for the config's class (the one named in
    ``config.architectures`` where the mapping offers several), None where it gives none."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        classes = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None
    if isinstance(classes, (list, tuple)):
        named = set(getattr(config, "architectures", None) or ())
        classes = next((c for c in classes if c.__name__ in named), classes[0])
    return classes
