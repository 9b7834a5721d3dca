"""The :class:`HetfairModel` base class."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, ClassVar, Optional

from torch import nn

from hetfair.errors import ConfigError

if TYPE_CHECKING:
    from hetfair.parallel.pipeline_stage import PipelineStage
    from hetfair.tasks import Task


WEIGHTS_FROM_CHECKPOINT = "weights_from_checkpoint"
"""An ``args`` attribute :func:`hetfair.load_model` sets to ``True``: every weight will be replaced by the
checkpoint's (a strict ``load_state_dict``), so a build may skip reading pretrained weights."""


class HetfairModel(nn.Module):
    """Base of registered models: declare flags in :meth:`add_args`, build in :meth:`build_model`."""

    init_source_options: ClassVar[tuple[str, ...]] = ()
    """The options (``dest`` names) that say where a *new* model's weights come from, e.g. ``init_from_hf``.

    A model built from them must record the sizes it took into ``args``; a checkpoint's own
    weights replace them, so :func:`hetfair.load_model` (``hetfair-validate``, ``hetfair-export``,
    ``hetfair-generate``) builds without them and needs no source that may be gone since."""

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Add this model's hyper-parameter flags to ``parser``."""

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: "Task") -> "HetfairModel":
        raise NotImplementedError

    def sharding_units(self) -> list[nn.Module]:
        """Submodules sharded as units of their own with ``--ddp-backend fully_sharded``.

        Each unit's parameters are gathered just for its forward and backward, so a model
        larger than one device trains when no unit is. The default, ``[]``, makes the whole
        model one unit (still sharded at rest). Return e.g. the transformer layers; modules
        that share a parameter (tied embeddings) must stay in the same unit or in the rest.
        """
        return []

    def pipeline_stage(self, units: range, first: bool, last: bool) -> Optional["PipelineStage"]:
        """The part of this model that runs sharding units ``units`` (indices into :meth:`sharding_units`), with
        its input layers when ``first`` and its output layers when ``last`` (``--ddp-backend pipeline``).

        A family that can be pipelined returns a :class:`~hetfair.parallel.pipeline_stage.PipelineStage` built
        from this model's own modules; the default, ``None``, refuses the mode for this model.
        """
        return None

    def export_hf(self, outdir: str, task: "Task") -> str:
        """Write this model as a Hugging Face ``transformers`` directory in ``outdir`` (``hetfair-export --to hf``)
        and return what to tell the user (where it went, how to load it).

        A family that exports overrides this; the default refuses with a
        :class:`~hetfair.errors.ConfigError`. Refuse before writing anything where you can.
        """
        raise ConfigError(f"a {type(self).__name__} model does not export to Hugging Face: its family defines no "
                          f"export_hf")
