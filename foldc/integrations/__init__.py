"""Integrations of foldc with model libraries.

- `foldc.integrations.hf`: Hugging Face transformers (`FoldcCache` and the ``"foldc"`` attention
  implementation). Needs ``transformers`` (``pip install 'foldc[hf]'``); it is imported on use, not here.
"""
