"""The sentence classification family's spec: what ``classification = hetfair.classification.family:FAMILY``
(setup.cfg) registers."""

from hetfair.families import FamilySpec

FAMILY = FamilySpec(
    name="classification",
    tasks={"sentence_classification": "hetfair.classification.task:SentenceClassificationTask"},
    models={"bert_classifier": "hetfair.classification.bert_classifier:BertClassifier"},
    archs={name: f"hetfair.classification.bert_classifier:{name}"
           for name in ("bert_classifier_tiny", "bert_classifier_base")},
    criteria={"sentence_classification": "hetfair.classification.criterion:SentenceClassificationCriterion"},
    hf_exporter="hetfair.classification.bert_classifier:BertClassifier.export_hf",
    hf_import_flag="--init-from-hf",
    sharding_units="hetfair.classification.bert_classifier:BertClassifier.sharding_units",
)
