"""The toy family's spec: a regression task reading what its preprocessor writes, a linear model, a summed MSE."""

from hetfair.families import FamilySpec

FAMILY = FamilySpec(
    name="toyfam",
    tasks={"toyfam": "toy_family.task:ToyFamTask"},
    models={"toyfam_linear": "toy_family.model:ToyFamLinear"},
    archs={"toyfam_wide": "toy_family.model:toyfam_wide"},
    criteria={"toyfam_mse": "toy_family.criterion:ToyFamMSE"},
    preprocessor="toy_family.preprocess",
)
