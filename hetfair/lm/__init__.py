"""Causal language modelling, shipped with hetfair but registered like any third-party plugin.

The model (``transformer_lm`` and its ``gpt_*`` architectures, :mod:`hetfair.lm.model`) is an
entry point of the hetfair distribution (``setup.cfg``), imported only when chosen. Its
Hugging Face conversion (:mod:`hetfair.lm.hf`) and text generation (:mod:`hetfair.lm.generate`)
import ``transformers`` only when used.
"""
