"""The Hugging Face encoder family's spec: what ``hf_encoder = hetfair.hf_encoder.family:FAMILY`` (setup.cfg)
registers. It brings a model only: the sentence_classification task trains it."""

from hetfair.families import FamilySpec

FAMILY = FamilySpec(
    name="hf_encoder",
    models={"hf_encoder": "hetfair.hf_encoder.model:HfEncoderModel"},
    hf_exporter="hetfair.hf_encoder.model:HfEncoderModel.export_hf",
    hf_import_flag="--hf-model",
    sharding_units="hetfair.hf_encoder.units:layer_units",
)
