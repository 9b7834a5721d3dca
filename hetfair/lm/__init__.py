"""Causal language modelling, shipped with hetfair but registered like any third-party plugin.

The model (``transformer_lm`` and its ``gpt_*`` architectures, :mod:`hetfair.lm.model`), task and
criterion are listed by the family's spec (:mod:`hetfair.lm.family`, one ``hetfair.families`` entry
point in ``setup.cfg``), imported only when chosen. Its
Hugging Face conversion (:mod:`hetfair.lm.hf`) and text generation (:mod:`hetfair.lm.generate`)
import ``transformers`` only when used.

The data side (``--task language_modeling``): :mod:`hetfair.lm.corpus` reads text or JSON lines
through Hugging Face ``datasets``, :mod:`hetfair.lm.tokenizer` trains or loads a byte-level BPE
``tokenizers`` tokenizer, :mod:`hetfair.lm.preprocess` binarizes documents into
:mod:`hetfair.data.indexed_dataset` files, :mod:`hetfair.lm.dataset` cuts the token stream into
blocks, :mod:`hetfair.lm.task` and :mod:`hetfair.lm.criterion` train on them.
"""
