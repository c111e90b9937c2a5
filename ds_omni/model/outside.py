"""Numbers an HF model's forward applies outside its modules, which the backbone must apply too.

Granite's embedding multiplier (after image features are merged in), the head's logit scaling
(Granite), multipliers (Muse, Cohere), soft-capping (Gemma 2 / 4, Mistral Large 4, Muse),
suppressed tokens (Chameleon), and Inkling's muP division and padded vocabulary. `embed_scale`
and `logit_rule` read them from the HF classes' own forward code and the config, so a rule
applies exactly where HF's forward applies it (a Granite LLM inside LLaVA gets the embedding
multiplier but not the causal-LM head's scaling). `LogitRule` applies the head's in HF's order;
`problem` says what is found but not known.

Dims: n positions, V vocabulary.
"""

from __future__ import annotations

import inspect
import re
from typing import NamedTuple

import torch

EMBED_SCALED = re.compile(r"inputs_embeds\s*=\s*inputs_embeds\s*\*\s*self\.embedding_multiplier")
SUPPRESSED = "vocabulary_mapping.image_tokens"  # Chameleon: `logits[:, :, image_tokens] = min`


class LogitRule(NamedTuple):
    """What HF's forward does to the head's logits [n, V], in its order (default: nothing)."""

    multiplier: float = 1.0  # logits * m (Muse's output_multiplier, Cohere's logit_scale)
    divisor: float = 1.0  # logits / s (Granite's logits_scaling)
    softcap: float | None = None  # cap * tanh(logits / cap), as HF: divide, tanh, multiply
    suppressed: tuple[int, ...] = ()  # token ids whose logits are the dtype's minimum
    hidden_divisor: float = 1.0  # the head sees hidden / m (Inkling's logits_mup_width_multiplier)
    vocab: int | None = None  # logits[..., :vocab] (Inkling's unpadded_vocab_size)

    def head(self, lm_head, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, D] -> logits [n, V] as HF's forward makes them around `lm_head`."""
        if self.hidden_divisor != 1:
            hidden = hidden / self.hidden_divisor
        return self(lm_head(hidden))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiplier != 1:
            logits = logits * self.multiplier
        if self.divisor != 1:
            logits = logits / self.divisor
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.suppressed:
            ids = torch.tensor(self.suppressed, dtype=torch.long, device=logits.device)
            logits = logits.index_fill(-1, ids, torch.finfo(logits.dtype).min)  # no gradient there
        if self.vocab is not None and self.vocab < logits.shape[-1]:
            logits = logits[..., :self.vocab]
        return logits


def _source(cls) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):  # no class, or no source at hand
        return ""


def logit_rule(owner_cls, text_config, suppressed: tuple[int, ...] = ()) -> LogitRule:
    """The rule `owner_cls.forward` (the class holding the LM head) applies to its logits."""
    code = _source(owner_cls)

    def used(name: str, default):
        value = getattr(text_config, name, None)
        return value if value and name in code else default

    return LogitRule(multiplier=float(used("output_multiplier", None) or used("logit_scale", 1.0)),
                     divisor=float(used("logits_scaling", 1.0)),
                     softcap=used("final_logit_softcapping", None),
                     suppressed=tuple(suppressed) if SUPPRESSED in code else (),
                     hidden_divisor=float(used("logits_mup_width_multiplier", 1.0)),
                     vocab=used("unpadded_vocab_size", None))


def embed_scale(llm_cls, text_config) -> float:
    """What the LLM's forward multiplies the embeddings it is given by (Granite), else 1."""
    value = getattr(text_config, "embedding_multiplier", None)
    if value in (None, 1) or not EMBED_SCALED.search(_source(llm_cls)):
        return 1.0
    return float(value)


def problem(owner_cls, text_config) -> str | None:
    """Why ds_omni cannot follow what the forwards of `owner_cls` (the head's) and of the LLM
    `text_config` configures do outside the modules, or None."""
    value = getattr(text_config, "embedding_multiplier", None)
    if "embedding_multiplier" in getattr(text_config, "attribute_map", {}):
        value = None  # another field's alias (Inkling's logits_mup_width_multiplier), read there
    llm_cls = text_model_class(text_config) if value not in (None, 1) else None  # (imports it)
    if llm_cls is not None and embed_scale(llm_cls, text_config) == 1:
        return (f"its config sets embedding_multiplier {value} but its LLM's forward does not "
                "apply it the way Granite's does (inputs_embeds * embedding_multiplier)")
    code = _source(owner_cls)
    if "finfo(logits.dtype).min" in code and SUPPRESSED not in code:
        return ("its forward sets some logits to the dtype's minimum by a rule ds_omni does not "
                "know (it knows Chameleon's vocabulary_mapping.image_tokens)")
    return None


def text_model_class(text_config):
    """The HF class of the LLM that `text_config` configures (AutoModel's mapping), or None."""
    from transformers import AutoModel
    try:
        return AutoModel._model_mapping[type(text_config)]
    except (KeyError, ValueError, ImportError, AttributeError):
        return None


def suppressed_ids(hf_model) -> tuple[int, ...]:
    """The token ids whose logits HF's forward sets to the minimum (Chameleon's VQ image tokens,
    from the model's own vocabulary mapping), else ()."""
    inner = getattr(hf_model, "model", None)
    mapping = getattr(inner, "vocabulary_mapping", None)
    return tuple(int(i) for i in getattr(mapping, "image_tokens", ()) or ())
