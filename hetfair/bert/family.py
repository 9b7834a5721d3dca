"""The BERT family's spec: what ``bert = hetfair.bert.family:FAMILY`` (setup.cfg) registers."""

from hetfair.families import FamilySpec

FAMILY = FamilySpec(
    name="bert",
    tasks={"bert": "hetfair.bert.task:BertTask"},
    models={"bert": "hetfair.bert.model:BertModel"},
    archs={name: f"hetfair.bert.model:{name}" for name in ("bert_tiny", "bert_mini", "bert_small", "bert_base",
                                                           "bert_large")},
    criteria={"masked_lm": "hetfair.bert.criterion:MaskedLmCriterion"},
    preprocessor="hetfair.bert.preprocess",
    hf_exporter="hetfair.bert.model:BertModel.export_hf",
    hf_import_flag="--init-from-hf",
    sharding_units="hetfair.bert.model:BertModel.sharding_units",
    pipeline_stage="hetfair.bert.model:BertModel.pipeline_stage",
)
