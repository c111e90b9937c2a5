"""Types the generic adapter is not exact for that no recipe module covers, with why
(`NOT_EXACT`): another architecture than a tower feeding a decoder-only LLM (BLIP, BLIP-2,
Florence-2, Kosmos-2 and 2.5), a processor that does not say how one image becomes tokens
(PP-Chart2Table, ShieldGemma 2), image codes that depend on the other images (Emu3), a tower
that needs timm (FastVLM)."""

from ds_omni.coverage.recipes.common import NOT_EXACT


NOT_EXACT.update({
    "blip": "BlipForConditionalGeneration has no inner ...Model: its text decoder is a BERT-style "
            "decoder with cross-attention to the image, not a decoder-only LLM fed embeddings",
    "blip-2": "Blip2ForConditionalGeneration has no inner ...Model: its LLM is a whole "
              "...ForCausalLM (OPT or T5) with its own head, which the generic backbone cannot "
              "split",
    "florence2": "its language model is an encoder-decoder (BART); ds_omni's backbone is "
                 "decoder-only",
    "emu3": "HF pads the images of one call to the largest and its VQ-VAE's convolutions see the "
            "padding, so an image's codes depend on the other images of the sample (its tiny "
            "recipe's logits differ by 0.6 from the second, smaller image on); ds_omni encodes "
            "each image alone",
    "pp_chart2table": "HF's processor has no image token to expand (the chat template writes the "
                      "image's tokens itself), so nothing says how one image becomes tokens",
})
NOT_EXACT["shieldgemma2"] = (
    "transformers cannot load a ShieldGemma 2 checkpoint into the class its image-text-to-text "
    "mapping names (Gemma3ForConditionalGeneration): the saved keys keep a `model.` prefix (its "
    "key mapping is for ShieldGemma2ForImageClassification) and every weight loads as missing; "
    "and its processor cannot cut one image: ShieldGemma2Processor ignores the text it is given "
    "and writes its own chat-template prompt per safety policy around each image (one image a "
    "sample). Its model is Gemma 3's, which is exact")
NOT_EXACT.update({
    "kosmos-2": "transformers maps no processor to it (its own Kosmos2Processor is not in the auto "
                "mapping) and its text model is not a generic backbone: its forward scales the "
                "embeddings, adds sinusoidal position embeddings offset by the padding "
                "(Kosmos2TextSinusoidalPositionalEmbedding) and places the image embeddings at "
                "image_embeds_position_mask itself, and it has no rotary_emb; a dedicated adapter "
                "is needed",
    "kosmos-2.5": "transformers maps no processor to it (its own Kosmos2_5Processor is not in the "
                  "auto mapping) and its text model is not a generic backbone: its forward adds "
                  "sinusoidal position and segment embeddings and places the image embeddings "
                  "at image_embeds_position_mask itself, and it has no rotary_emb; a dedicated "
                  "adapter is needed",
    "fast_vlm": "not verified: its vision tower is timm's FastViTHD (vision_config timm_wrapper) "
                "and timm, which needs torchvision, does not install next to a CPU torch; "
                "transformers maps no processor to it, and neither its model file nor its docs "
                "name one (they load the checkpoint's through AutoProcessor)",
})
