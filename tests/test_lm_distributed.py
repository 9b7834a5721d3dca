"""Language-model training is the same on one process, on three heterogeneous gloo ranks and in a plain
PyTorch loop over the same token stream; its perplexity reaches TensorBoard.

The reference reads the text with Python, encodes it with the tokenizers library, cuts the stream
into blocks and takes SGD steps on the mean next-token cross-entropy of each update's blocks (in
the epoch's seeded order): what hetfair's preprocess, blocks, batch plan and token-summed criterion
must add up to, whichever ranks share the work.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import final_parameters, free_port, rank_flags, run_nodes
from lm_helpers import reference_stream, small_corpus
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tokenizers import Tokenizer

from hetfair.lm.config import LMConfig
from hetfair.lm.model import TransformerLM

SEED, LR, BLOCK = 5, 0.5, 16
TINY = {"embed_dim": 32, "layers": 2, "attention_heads": 2, "ffn_embed_dim": 64}
BLOCKS_PER_RANK = [2, 4, 6]  # --max-tokens 32, 64, 96 on three ranks; 12 blocks (192 tokens) on one
UPDATE_FREQ = 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """About 2,000 characters of the Jargon File (some 60 blocks: three updates, the last one short)."""
    tmp = tmp_path_factory.mktemp("lm_dist")
    return small_corpus(tmp)


def commands(tmp_path: Path, data: Path, max_tokens: list[int]) -> list[list[str]]:
    """One hetfair-train command per rank, each rank with its own --max-tokens; saving to ``ckpt_<ranks>``."""
    save_dir = tmp_path / f"ckpt_{len(max_tokens)}"
    common = ["--task", "language_modeling", "--data", str(data), "--arch", "gpt_tiny",
              "--tokens-per-sample", str(BLOCK), "--decoder-embed-dim", "32", "--decoder-layers", "2",
              "--decoder-attention-heads", "2", "--decoder-ffn-embed-dim", "64", "--dropout", "0",
              "--attention-dropout", "0", "--optimizer", "sgd", "--lr", str(LR), "--lr-scheduler", "fixed",
              "--seed", str(SEED), "--max-epoch", "1", "--update-freq", str(UPDATE_FREQ), "--save-dir", str(save_dir),
              "--no-epoch-checkpoints", "--log-format", "none", "--distributed-timeout", "120",
              "--tensorboard-logdir", str(tmp_path / f"tb_{len(max_tokens)}")]
    init = f"tcp://127.0.0.1:{free_port()}"
    return [[*common, "--max-tokens", str(tokens), *(rank_flags(rank, len(max_tokens), init)
                                                     if len(max_tokens) > 1 else [])]
            for rank, tokens in enumerate(max_tokens)]


def reference_parameters(data: Path, docs: list[str], layers: int = TINY["layers"], epochs: int = 1,
                         momentum: float = 0.0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The initial and the final parameters of the plain loop (a model of ``layers`` layers, ``epochs`` epochs, SGD
    with ``momentum``)."""
    stream = torch.from_numpy(reference_stream(data / "tokenizer.json", docs))
    sources, targets = stream[:-1].split(BLOCK), stream[1:].split(BLOCK)
    vocab_size = Tokenizer.from_file(str(data / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(SEED)
    model = TransformerLM(LMConfig(vocab_size=vocab_size, max_positions=BLOCK, dropout=0.0, attention_dropout=0.0,
                                   **{**TINY, "layers": layers}))
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    update = sum(BLOCKS_PER_RANK) * UPDATE_FREQ
    for epoch in range(1, epochs + 1):
        order = np.random.default_rng([SEED, epoch]).permutation(len(sources))
        assert len(order) % update and len(order) > 2 * update, "the corpus must give two full updates and a short one"
        for start in range(0, len(order), update):
            chunk = order[start:start + update].tolist()
            optimizer.zero_grad()
            summed = sum(F.cross_entropy(model(sources[i][None])[0], targets[i], reduction="sum") for i in chunk)
            (summed / sum(len(targets[i]) for i in chunk)).backward()
            optimizer.step()
    return initial, model.state_dict()


def test_one_process_and_three_heterogeneous_ranks_train_as_the_plain_loop(tmp_path, corpus):
    data, docs = corpus
    jobs = commands(tmp_path, data, [BLOCK * sum(BLOCKS_PER_RANK)]) + commands(
        tmp_path, data, [BLOCK * n for n in BLOCKS_PER_RANK])
    for result in run_nodes(jobs, cwd=tmp_path, timeout=300):  # the one-process job and the three ranks at once
        assert result.returncode == 0, result.stderr
    single, split = final_parameters(tmp_path / "ckpt_1"), final_parameters(tmp_path / "ckpt_3")
    initial, expected = reference_parameters(data, docs)
    assert single.keys() == split.keys() == expected.keys()
    for name in expected:  # float32 sums in other orders differ by about 1e-7
        torch.testing.assert_close(split[name], single[name], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(single[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)
    moved = max(float((expected[name] - initial[name]).abs().max()) for name in expected)
    assert moved > 1e-2, "the updates must move the parameters far beyond the tolerance"
    for phase in ("train", "valid"):
        events = EventAccumulator(str(tmp_path / "tb_1" / phase))
        events.Reload()
        (loss,), (ppl,) = events.Scalars("loss"), events.Scalars("ppl")
        assert ppl.value == pytest.approx(2 ** loss.value, rel=1e-5) and ppl.value > 1
