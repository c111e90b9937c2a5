"""The coverage sweep: which transformers vision-language families ds_omni trains exactly.

Tooling, not training: it builds tiny random models of HF's image-text-to-text types and checks
ds_omni against HF's own forward. Nothing below this layer imports it.
  sweep             the sweep over the mapping, one family's check, the table (`ds-omni families`)
  reference         the HF side of a check, built apart from the code under test
  recipes/          per type, a tiny random HF config and a processor built from parts
  torchvision_rows  the rows that need torchvision: where its Python side lies, why a row goes
                    without it, and the handle on the one child process that checks them
  child             that child process (`python -m ds_omni.coverage.child`)
"""
