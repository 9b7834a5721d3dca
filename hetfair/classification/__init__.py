"""Sentence classification: the ``sentence_classification`` task and criterion, and hetfair's BERT classifier.

Registered by its family spec (:mod:`hetfair.classification.family`, one ``hetfair.families`` entry point
in setup.cfg) like a third-party plugin, building on the
BERT family (:mod:`hetfair.bert`): its tokenizers, encoder and Hugging Face conversion.
"""
