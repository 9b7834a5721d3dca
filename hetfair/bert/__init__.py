"""BERT pretraining, shipped with hetfair but registered like any third-party plugin.

The task (``bert``), model (``bert`` and its ``bert_*`` architectures) and
criterion (``masked_lm``) are listed by the family's spec (:mod:`hetfair.bert.family`,
one ``hetfair.families`` entry point in ``setup.cfg``), so they are imported only when chosen.
The rest is their data path: ``hetfair-preprocess`` (:mod:`hetfair.bert.preprocess`), the binary
splits it writes (:mod:`hetfair.data.indexed_dataset`), the layout of its output
directory (:mod:`hetfair.bert.data_dir`), vocabularies
(:mod:`hetfair.bert.tokenizer`), masking and samples.

Importing this package imports nothing else: the tokenizer libraries load with
the modules that need them.
"""
