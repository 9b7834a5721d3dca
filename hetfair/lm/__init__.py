"""hetfair's causal language-modelling family: ``--task language_modeling`` and the ``transformer_lm`` models.

Registered through entry points like a third-party plugin (see setup.cfg). The data side:
:mod:`hetfair.lm.corpus` reads text or JSON lines through Hugging Face ``datasets``,
:mod:`hetfair.lm.tokenizer` trains or loads a byte-level BPE ``tokenizers`` tokenizer,
:mod:`hetfair.lm.preprocess` binarizes documents into :mod:`hetfair.data.indexed_dataset` files,
:mod:`hetfair.lm.dataset` cuts the token stream into blocks, :mod:`hetfair.lm.task` and
:mod:`hetfair.lm.criterion` train on them.
"""
