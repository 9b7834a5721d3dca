"""Any Hugging Face ``transformers`` encoder as a hetfair model (``--arch hf_encoder --hf-model DIR``).

Registered by its family spec (:mod:`hetfair.hf_encoder.family`, one ``hetfair.families`` entry point in
``setup.cfg``), like a third-party plugin: importing it imports nothing, and ``transformers`` (the ``hf``
extra) is imported only when the model is built (:mod:`hetfair.hf_encoder.model`). Its sharding units are found in the
model's own layer list (:mod:`hetfair.hf_encoder.units`), so no family needs code of its own.
"""
