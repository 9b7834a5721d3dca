"""The :class:`PipelineStage` base: one stage of a model cut for ``--ddp-backend pipeline``.

A model family that can be pipelined returns one from :meth:`HetfairModel.pipeline_stage`:
the model's own modules for a range of its sharding units, plus its input layers on the
first stage and its output layers on the last. The stage keeps each module under the
name it has in the model (units in a ``ModuleDict`` keyed by their index), so its
``state_dict`` keys are the whole model's and checkpoints move to and from every mode.
A parameter two stages share (tied input and output embeddings) is one tensor in the
model and a copy on each of the two stages, kept equal by summing their gradients.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn


class PipelineStage(nn.Module):
    """One stage: ``forward(*activations, **net_input)``. The first stage ignores ``activations`` and reads the
    sample's ``net_input``; every stage but the last returns the activations for the next one (float32 tensors of
    the shapes :meth:`boundary` gives); the last returns what the whole model's forward returns."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.first = first
        self.last = last

    def boundary(self, net_input: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """Tensors on the meta device shaped as the activations that cross a stage boundary for a micro-batch
        with ``net_input`` (the same between any two stages)."""
        raise NotImplementedError

    def tied_rows(self, inputs: dict[str, Any]) -> Optional[torch.Tensor]:
        """The rows of the tied embeddings (the weight the first and last stage share) that a micro-batch with
        model ``inputs`` looks up: then only those rows travel between the two stages
        (:mod:`hetfair.parallel.pipeline_tied`). ``None`` (here): the whole weight's gradients are summed."""
        return None

    def output_work(self) -> float:
        """On a last stage: the work of its output layers per sample, in units of one of its sharding units'
        work (what ``--pipeline-split auto`` adds to the last stage); here 0, not counted."""
        return 0.0

    def one_shape(self, inputs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The micro-batches' model ``inputs`` made one shape where the family can without changing any real
        position's output (padding that attention ignores), so that one schedule step runs them all; here as
        they are (micro-batches of other shapes then run in schedule steps of their own)."""
        return list(inputs)


def boundary_bytes(model: nn.Module, units: int, criterion: nn.Module, sample: dict[str, Any]) -> int:
    """fp32 bytes one sample's activations take at a stage boundary of ``model`` (of ``units`` sharding units),
    from ``sample`` (a collated batch that ``criterion`` turns into the model's inputs); 0 where the model cannot
    be pipelined."""
    cut = getattr(model, "pipeline_stage", None)
    stage = cut(range(0, 1), first=True, last=False) if cut is not None and units > 1 else None
    if stage is None:
        return 0
    inputs = criterion.model_inputs(sample)  # type: ignore[operator]
    return sum(4 * tensor.numel() for tensor in stage.boundary(inputs)) // max(int(sample.get("nsentences", 1)), 1)


def units_dict(units: nn.ModuleList, indices: range) -> nn.ModuleDict:
    """The units ``indices`` of ``units`` under their index, so their ``state_dict`` keys are the model's."""
    return nn.ModuleDict({str(index): units[index] for index in indices})
