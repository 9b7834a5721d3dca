"""Sentence classification: the ``sentence_classification`` task and criterion, and hetfair's BERT classifier.

Registered through entry points like a third-party plugin (see setup.cfg), building on the
BERT family (:mod:`hetfair.bert`): its tokenizers, encoder and Hugging Face conversion.
"""
