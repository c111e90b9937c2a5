"""The adapter interface between HF model families and OmniModel.

A family says how to build or load its HF model, how to view it as an OmniModel (which modules are
encoders, projectors and backbone), and how to turn one raw image or audio clip into encoder inputs
plus the number of embeddings it yields (its `ItemProcessor`s: `ds_omni.batch`, the contract
with data/). Adding a family is one small file in `families/` that subclasses `Family` and calls
`families.registry.register`; `families.family_for` finds the one for a model type.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ds_omni.batch import EncodedItem, ItemProcessor
from ds_omni.errors import ModelError

class Family:
    """Base adapter. Subclasses set `name`, `model_types`, `hf_class` and implement the hooks."""

    name: str = ""
    model_types: tuple[str, ...] = ()
    hf_class: str = ""  # attribute of `transformers`
    sequence_parallel: bool = True
    """The LLM may run Ulysses SP: its decoder layers take `position_embeddings` and the packed
    attention kwargs as HF's Llama/Qwen2 layers do. Set False for a family whose layers don't."""
    bidirectional: str | None = None
    """How some tokens attend both ways (`attention_blocks`; generic.BIDIRECTIONAL), or None: the
    LLM is causal. The pipeline engine does not carry such blocks between stages."""

    def hf_model_class(self):
        import transformers
        return getattr(transformers, self.hf_class)

    def build_hf(self, config) -> torch.nn.Module:
        """A randomly initialised HF model from an HF config object."""
        return self.hf_model_class()(config)

    def load_hf(self, path: Path, trust_remote_code: bool = False) -> torch.nn.Module:
        """Load an HF model directory through the real `from_pretrained` path (safetensors only).

        Weights that do not fit the directory's config.json, or that are missing (HF would
        initialise them randomly and carry on), are an error.
        """
        try:
            model, info = self.hf_model_class().from_pretrained(
                str(path), use_safetensors=True, trust_remote_code=trust_remote_code,
                output_loading_info=True)
        except (RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ModelError(f"the weights in {str(path)!r} do not fit its config.json ({first}); "
                             "were they saved from a model with another config?") from None
        problems = {k: list(v)[:5] for k, v in info.items()
                    if k in ("missing_keys", "mismatched_keys") and v}
        if problems:
            raise ModelError(f"the weights in {str(path)!r} do not fit its config.json: {problems}; "
                             "were they saved from a model with another config or family?")
        return model

    def to_omni(self, hf_model, tokenizer):
        """View `hf_model` as an `OmniModel` sharing its parameters."""
        raise NotImplementedError

    def item_processors(self, hf_config, model_dir: Path | None = None,
                        tokenizer=None) -> dict[str, ItemProcessor]:
        """Encoder name -> processor of its raw items (HF image/feature processors)."""
        raise NotImplementedError

    def position_ids(self, input_ids: torch.Tensor, items: list[tuple[str, EncodedItem]]) -> torch.Tensor:
        """Positions of one sample's tokens [L] (or [3, L] for M-RoPE); default 0..L-1."""
        return torch.arange(input_ids.shape[0])

    def attention_blocks(self, input_ids: torch.Tensor,
                         loss_mask: torch.Tensor) -> list[tuple[int, int]]:
        """Spans (start, end) of one sample whose tokens attend to each other both ways on top of
        causal attention (Gemma 3's image tokens, PaliGemma's prefix); default none."""
        return []

    def layer_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token inputs its decoder layers take besides the hidden states, from the row's
        token ids [1, S] (ERNIE-4.5-VL's `moe_mm_token_type_ids`), each [1, S]; default none."""
        return {}

    def save_processor(self, out_dir: Path, hf_config, tokenizer, model_dir: Path | None) -> None:
        """Write the HF processor next to an exported model so users can `generate`."""
        tokenizer.save_pretrained(str(out_dir))
