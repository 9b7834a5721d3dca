"""BERT encoder with a masked-LM head (tied to the input embeddings) and an optional NSP head.

Hyper-parameters come, in increasing priority, from the flag defaults
(``bert_base``), the ``--arch`` preset, explicit flags and ``--config_file``
(a Google / Hugging Face ``bert_config.json``). The effective values are
written back to ``args`` so checkpoints record the model actually built.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hetfair.bert.config import ACTIVATIONS, BertConfig, config_from_file
from hetfair.errors import ConfigError
from hetfair.models import register_model, register_model_architecture
from hetfair.models.model import HetfairModel
from hetfair.parallel.pipeline_stage import PipelineStage, units_dict
from hetfair.utils import absolute_path

if TYPE_CHECKING:
    from hetfair.tasks import Task

logger = logging.getLogger(__name__)

HYPER_PARAMETERS = tuple(f.name for f in fields(BertConfig) if f.name != "vocab_size")
_HELP = {
    "hidden_size": "width of the encoder",
    "num_hidden_layers": "number of encoder layers",
    "num_attention_heads": "attention heads per layer",
    "intermediate_size": "width of the feed-forward layers",
    "hidden_act": f"activation: {', '.join(ACTIVATIONS)}",
    "hidden_dropout_prob": "dropout on embeddings and layer outputs",
    "attention_probs_dropout_prob": "dropout on attention probabilities",
    "max_position_embeddings": "longest input the position embeddings cover",
    "type_vocab_size": "number of segment (token type) ids",
    "initializer_range": "std of the normal weight initialisation",
    "layer_norm_eps": "LayerNorm epsilon",
}


class BertLayer(nn.Module):
    """Post-LayerNorm transformer encoder layer (as in the original BERT)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.attention_dropout = config.attention_probs_dropout_prob
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.attention_out = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.activation = ACTIVATIONS[config.hidden_act]
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=self.attention_dropout if self.training else 0.0
        )
        attended = attended.transpose(1, 2).reshape(batch, length, hidden)
        x = self.attention_norm(x + self.dropout(self.attention_out(attended)))
        return self.output_norm(x + self.dropout(self.output(self.activation(self.intermediate(x)))))


class BertEmbeddings(nn.Module):
    """Token + position + segment embeddings, normalised."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        return self.dropout(self.norm(x))


class BertLMHead(nn.Module):
    """Transform + LayerNorm, then scores against the (tied) input embeddings."""

    def __init__(self, config: BertConfig, embedding_weight: nn.Parameter) -> None:
        super().__init__()
        self.transform = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = ACTIVATIONS[config.hidden_act]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.weight = embedding_weight
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(self.activation(self.transform(hidden))), self.weight, self.bias)


def encode(embeddings: BertEmbeddings, layers: nn.ModuleList, input_ids: torch.Tensor,
           token_type_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The encoder's last hidden states ``(batch, length, hidden)``: ``embeddings`` then each of ``layers``.

    ``token_type_ids`` ``None`` is segment 0 everywhere; ``attention_mask`` is true on real tokens
    (``None``: no padding).
    """
    hidden = embed(embeddings, input_ids, token_type_ids)
    mask = layer_mask(attention_mask)
    for layer in layers:
        hidden = layer(hidden, mask)
    return hidden


def embed(embeddings: BertEmbeddings, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
    """The embedded input; ``token_type_ids`` ``None`` is segment 0 everywhere."""
    return embeddings(input_ids, torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids)


def layer_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The layers' attention mask from the ``(batch, length)`` one, true on real tokens."""
    return None if attention_mask is None else attention_mask[:, None, None, :].bool()


class BertHeads(nn.Module):
    """The output end, shared by :class:`BertModel` and its last pipeline stage (:mod:`hetfair.bert.pipeline`),
    which hold the same modules under the same names."""

    lm_head: "BertLMHead"
    nsp: bool

    def heads(self, hidden: torch.Tensor, masked_tokens: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Scores of the masked LM (on ``masked_tokens`` only, when given) and, with ``nsp``, of the next sentence."""
        output = {"mlm_logits": self.lm_head(hidden if masked_tokens is None else hidden[masked_tokens])}
        if self.nsp:
            output["nsp_logits"] = self.nsp_head(torch.tanh(self.pooler(hidden[:, 0])))
        return output


@register_model("bert")
class BertModel(BertHeads, HetfairModel):
    """BERT for pretraining: masked LM, plus next-sentence prediction when ``nsp``.

    The NSP pooler and classifier exist only with ``nsp``, so without it every
    parameter receives a gradient (DDP needs no unused-parameter search).
    """

    init_source_options = ("init_from_hf",)

    def __init__(self, config: BertConfig, nsp: bool = False) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.lm_head = BertLMHead(config, self.embeddings.word.weight)
        if nsp:
            self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
            self.nsp_head = nn.Linear(config.hidden_size, 2)
        self.nsp = nsp
        self.apply(self._init_weights)

    def sharding_units(self) -> list[nn.Module]:
        """One unit per encoder layer; embeddings and heads (tied to them) stay in the root unit."""
        return list(self.layers)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        defaults = BertConfig(vocab_size=0)
        for name in HYPER_PARAMETERS:
            value = getattr(defaults, name)
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value,
                                metavar=type(value).__name__.upper(), help=f"{_HELP[name]} (bert_config.json: {name})")
        parser.add_argument("--config_file", "--config-file", metavar="JSON", dest="config_file",
                            type=absolute_path,
                            help="bert_config.json whose values override the architecture and flags")
        parser.add_argument("--init-from-hf", metavar="DIR",
                            help="start from a local Hugging Face BERT directory (config.json + model.safetensors "
                                 "or pytorch_model.bin): its config sizes the model, its weights initialise it")

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: "Task") -> "BertModel":
        if getattr(args, "init_from_hf", None):
            return cls.from_hugging_face(args, task)
        vocab_size = len(task.vocab)  # type: ignore[attr-defined]
        config = BertConfig(vocab_size=vocab_size, **{name: getattr(args, name) for name in HYPER_PARAMETERS})
        if args.config_file:
            config = config_from_file(args.config_file, config)
            if config.vocab_size != vocab_size:
                raise ConfigError(f"--config_file {args.config_file} has vocab_size {config.vocab_size} but the "
                                  f"vocabulary of --data has {vocab_size} tokens; fix one of them")
        max_positions = task.max_positions()
        if max_positions is not None and max_positions > config.max_position_embeddings:
            raise ConfigError(f"samples of {max_positions} tokens do not fit max_position_embeddings "
                              f"{config.max_position_embeddings}; lower --tokens-per-sample")
        vars(args).update({name: getattr(config, name) for name in HYPER_PARAMETERS})
        return cls(config, nsp=bool(getattr(args, "nsp", False)))

    @classmethod
    def from_hugging_face(cls, args: argparse.Namespace, task: "Task") -> "BertModel":
        """The model of ``--init-from-hf DIR``: sized by its ``config.json``, initialised with its weights.

        Its ``vocab.txt`` or ``tokenizer.json`` (if any) must be the task's vocabulary. Heads the directory lacks (the NSP
        head of a ``BertForMaskedLM``, every head of a bare ``BertModel``) start from the usual
        random initialisation; the lines logged say which, and what was loaded.
        """
        from hetfair.bert.hf import from_hf_state_dict, init_report, read_hf_directory

        directory = args.init_from_hf
        source = read_hf_directory(directory)
        config, tokens = source.config, source.tokens
        vocab = task.vocab  # type: ignore[attr-defined]
        if config.vocab_size != len(vocab) or (tokens is not None and tuple(tokens) != tuple(vocab.tokens)):
            raise ConfigError(f"--init-from-hf {directory} has another vocabulary ({config.vocab_size} tokens) than "
                              f"--data ({len(vocab)} tokens); preprocess with --dict {directory}/vocab.txt")
        vars(args).update({name: getattr(config, name) for name in HYPER_PARAMETERS})
        model = cls(config, nsp=bool(getattr(args, "nsp", False)))
        state, missing = from_hf_state_dict(source.weights, config.num_hidden_layers, model.nsp, directory)
        try:
            model.load_state_dict(state, strict=False)
        except RuntimeError as exc:
            raise ConfigError(f"--init-from-hf {directory}: weights do not fit its config.json: "
                              f"{str(exc).splitlines()[-1].strip()}") from exc
        for line in init_report(directory, source, missing):
            logger.info(line)
        return model

    def export_hf(self, outdir: str, task: "Task") -> str:
        """A ``BertForPreTraining`` (``--nsp``) or ``BertForMaskedLM`` directory with the task's tokenizer."""
        from hetfair.bert.hf import success_message, write_hf_directory
        from hetfair.bert.hf_tokenizer import hf_tokenizer_files

        vocab, spec = task.vocab, task.tokenizer_spec  # type: ignore[attr-defined]
        tokenizer_files = hf_tokenizer_files(spec, vocab, self.config.max_position_embeddings)  # may refuse: write after
        write_hf_directory(outdir, self.config, self.state_dict(), self.nsp, vocab.pad, tokenizer_files)
        return success_message(outdir, self.nsp)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        masked_tokens: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Scores of the masked LM and (with ``nsp``) of next-sentence prediction.

        Args:
            input_ids, token_type_ids: ``(batch, length)`` token and segment ids.
            attention_mask: ``(batch, length)``, true on real tokens (``None``: no padding).
            masked_tokens: ``(batch, length)`` booleans; the LM head runs only on these
                positions and ``mlm_logits`` is ``(n_masked, vocab)`` in row-major order.
                ``None`` scores every position: ``(batch, length, vocab)``.
        """
        hidden = encode(self.embeddings, self.layers, input_ids, token_type_ids, attention_mask)
        return self.heads(hidden, masked_tokens)

    def pipeline_stage(self, units: range, first: bool, last: bool) -> PipelineStage:
        return BertStage(self, units, first, last)


MASKED_SHARE = 0.15
"""The share of positions BERT's masked-LM head scores (its usual ``--mask-prob``), for
:meth:`BertStage.output_work`."""


def _pad_positions(value: Any, length: int) -> Any:
    """A ``(batch, positions)`` input padded with zeros (false) to ``length`` positions; anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[1] >= length:
        return value
    return F.pad(value, (0, length - value.shape[1]))


def _arch(hidden_size: int, num_hidden_layers: int, num_attention_heads: int) -> dict[str, int]:
    return {"hidden_size": hidden_size, "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": num_attention_heads, "intermediate_size": 4 * hidden_size}


@register_model_architecture("bert", "bert_tiny")
def bert_tiny() -> dict[str, int]:
    return _arch(128, 2, 2)


@register_model_architecture("bert", "bert_mini")
def bert_mini() -> dict[str, int]:
    return _arch(256, 4, 4)


@register_model_architecture("bert", "bert_small")
def bert_small() -> dict[str, int]:
    return _arch(512, 4, 8)


@register_model_architecture("bert", "bert_base")
def bert_base() -> dict[str, int]:
    return _arch(768, 12, 12)


@register_model_architecture("bert", "bert_large")
def bert_large() -> dict[str, int]:
    return _arch(1024, 24, 16)


class BertStage(BertHeads, PipelineStage):
    """Encoder layers ``units`` of ``model``; the embeddings on the first stage, the heads on the last."""

    def __init__(self, model: BertModel, units: range, first: bool, last: bool) -> None:
        PipelineStage.__init__(self, first, last)
        self.hidden_size = model.config.hidden_size
        if first:
            self.embeddings = model.embeddings
        self.layers = units_dict(model.layers, units)
        self.nsp = model.nsp and last
        if last:
            self.lm_head = model.lm_head
            if model.nsp:
                self.pooler, self.nsp_head = model.pooler, model.nsp_head

    def forward(self, *activations: torch.Tensor, input_ids: torch.Tensor,
                token_type_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                masked_tokens: torch.Tensor | None = None) -> Any:
        hidden = embed(self.embeddings, input_ids, token_type_ids) if self.first else activations[0]
        mask = layer_mask(attention_mask)
        for layer in self.layers.values():
            hidden = layer(hidden, mask)
        return self.heads(hidden, masked_tokens) if self.last else hidden.float()

    def boundary(self, net_input: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        batch, length = net_input["input_ids"].shape
        return (torch.empty(batch, length, self.hidden_size, device="meta"),)

    def tied_rows(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["input_ids"]

    def output_work(self) -> float:
        """The masked-LM head scores the masked positions only (BERT's usual share, :data:`MASKED_SHARE`) against
        the vocabulary: its weights times that share, over a layer's weights."""
        layer = sum(param.numel() for param in next(iter(self.layers.values())).parameters())
        return MASKED_SHARE * sum(param.numel() for param in self.lm_head.parameters()) / layer

    def one_shape(self, inputs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each micro-batch padded to the longest: its padding is masked out of attention and scores no token,
        so the real positions' outputs are as without it (up to float summation order)."""
        length = max(item["input_ids"].shape[1] for item in inputs)
        if any(item.get("attention_mask") is None for item in inputs if item["input_ids"].shape[1] < length):
            return list(inputs)  # no mask to hide the padding from attention
        return [{name: _pad_positions(value, length) for name, value in item.items()} for item in inputs]
