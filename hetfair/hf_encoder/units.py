"""The sharding units of any ``transformers`` model, found from its own layer list.

The rule: the units are the children of the model's longest :class:`~torch.nn.ModuleList`
whose children are all of one class and hold parameters, none of them shared with a module
outside its own child (a tied weight must stay in one unit). On a tie in length the first such
list in module order wins. That is ``bert.encoder.layer`` in BERT, RoBERTa and MiniLM,
``distilbert.transformer.layer`` in DistilBERT, ``encoder.layers`` in most others. A model
without such a list has no units: it is sharded as one (still sharded at rest).
"""

from __future__ import annotations

from torch import nn


def layer_units(model: nn.Module) -> list[nn.Module]:
    """The children of the longest list of same-class, parameter-holding, untied blocks in ``model``."""
    owners = _parameter_owners(model)
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best) and _is_block_list(module, owners):
            best = list(module)
    return best


def _is_block_list(blocks: nn.ModuleList, owners: dict[int, set[int]]) -> bool:
    """All of one class, each holding parameters that no module outside it holds too."""
    if len({type(block) for block in blocks}) != 1:
        return False
    return all(_is_untied_block(block, owners) for block in blocks)


def _is_untied_block(block: nn.Module, owners: dict[int, set[int]]) -> bool:
    inside = {id(module) for module in block.modules()}
    params = list(block.parameters())
    return bool(params) and all(owners[id(param)] <= inside for param in params)


def _parameter_owners(model: nn.Module) -> dict[int, set[int]]:
    """``id(parameter) -> ids of the modules holding it directly`` (more than one for a tied weight)."""
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(id(module))
    return owners
