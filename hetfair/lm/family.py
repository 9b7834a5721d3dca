"""The language-modelling family's spec: what ``lm = hetfair.lm.family:FAMILY`` (setup.cfg) registers."""

from hetfair.families import FamilySpec

FAMILY = FamilySpec(
    name="lm",
    tasks={"language_modeling": "hetfair.lm.task:LanguageModelingTask"},
    models={"transformer_lm": "hetfair.lm.model:TransformerLM"},
    archs={name: f"hetfair.lm.model:{name}" for name in ("gpt_tiny", "gpt_mini", "gpt2_small")},
    criteria={"lm_cross_entropy": "hetfair.lm.criterion:LmCrossEntropyCriterion"},
    preprocessor="hetfair.lm.preprocess",
    hf_exporter="hetfair.lm.model:TransformerLM.export_hf",
    hf_import_flag="--init-from-hf",
    sharding_units="hetfair.lm.model:TransformerLM.sharding_units",
    pipeline_stage="hetfair.lm.model:TransformerLM.pipeline_stage",
)
