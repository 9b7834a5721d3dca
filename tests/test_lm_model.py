"""The transformer_lm model: GPT-2 small's sizes, causality, dropout flags, sharding units, bad sizes.

Its numerics are checked against transformers in test_lm_hf.py; here the fully sharded run is checked
against one process of the same hetfair-train command (the plain update).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import final_parameters, free_port, rank_flags, run_nodes, subprocess_env
from hetfair.lm.config import LMConfig
from hetfair.lm.model import TransformerLM
from hetfair.models import resolve_arch
from hetfair.options import parse_train_args
from hetfair.rng import seed_everything
from hetfair.tasks import TASK_REGISTRY
from hetfair_cli.train import main as train_main
from lm_model_helpers import lm_train_args, make_lm_data


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory):
    return make_lm_data(tmp_path_factory.mktemp("lm_model"))


def tiny(positions: str, dropout: float = 0.0) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(LMConfig(vocab_size=50, max_positions=12, embed_dim=16, layers=2, attention_heads=2,
                                  ffn_embed_dim=32, positions=positions, dropout=dropout, attention_dropout=dropout))


def test_gpt2_small_has_the_sizes_of_gpt2_small():
    """124,439,808 parameters: GPT-2 small's count with its 50,257 tokens and 1,024 positions."""
    parser = argparse.ArgumentParser()
    TransformerLM.add_args(parser)
    model_name, defaults = resolve_arch("gpt2_small")
    parser.set_defaults(**defaults)
    task = SimpleNamespace(vocab_size=50257, max_positions=lambda: 1024)
    with torch.device("meta"):
        model = TransformerLM.build_model(parser.parse_args([]), task)
    assert model_name == "transformer_lm"
    assert sum(p.numel() for p in model.parameters()) == 124_439_808
    assert model.embed_tokens.weight is not None and not hasattr(model, "lm_head")  # the output layer is tied


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_each_position_sees_only_the_tokens_before_it(positions):
    model = tiny(positions).eval()
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 50
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :7], before[:, :7], atol=0, rtol=0)
    assert (after[:, 7:] - before[:, 7:]).abs().amax() > 1e-3


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_the_order_of_the_context_matters(positions):
    """Without positions the last token's scores would not depend on the order of the tokens before it."""
    model = tiny(positions).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[4, 9, 17, 23, 5], [23, 17, 9, 4, 5]]))
    assert (logits[0, -1] - logits[1, -1]).abs().amax() > 1e-3


def test_dropout_flags_turn_dropout_off():
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    off, on = tiny("learned", dropout=0.0), tiny("learned", dropout=0.5)
    with torch.no_grad():
        torch.testing.assert_close(off.train()(tokens), off.eval()(tokens), atol=0, rtol=0)
        assert (on.train()(tokens) - on.eval()(tokens)).abs().amax() > 1e-3


def test_sharding_units_are_the_decoder_layers_and_the_embeddings_stay_in_the_root():
    model = tiny("learned")
    units = model.sharding_units()
    assert units == list(model.layers) and len(units) == 2
    in_units = {id(p) for unit in units for p in unit.parameters()}
    assert id(model.embed_tokens.weight) not in in_units and id(model.embed_positions.weight) not in in_units


def test_fully_sharded_update_on_two_ranks_is_the_one_process_update(tmp_path, data):
    """One SGD update of 8 blocks split 3 + 5 over two FSDP2 ranks (units = the decoder layers) equals the
    update of one process on all 8. 1e-5: float32 sums of the same terms, reduced in another order."""
    common = lm_train_args(data, tmp_path, "--optimizer", "sgd", "--lr", "0.5", "--lr-scheduler", "fixed",
                           "--max-update", "1")
    init = f"tcp://127.0.0.1:{free_port()}"
    commands = [common + ["--max-sentences", "8", "--save-dir", str(tmp_path / "one")]]
    commands += [common + ["--max-sentences", str(batch), "--save-dir", str(tmp_path / "two"),
                           *rank_flags(rank, 2, init), "--ddp-backend", "fully_sharded"]
                 for rank, batch in enumerate([3, 5])]
    for result in run_nodes(commands, cwd=tmp_path, timeout=300):
        assert result.returncode == 0, result.stderr
    expected, actual = final_parameters(tmp_path / "one"), final_parameters(tmp_path / "two")
    initial = initial_parameters(common)
    assert expected.keys() == actual.keys() == initial.keys()
    assert all((expected[name] - initial[name]).abs().amax() > 1e-4 for name in expected)  # every tensor moved
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=1e-5, rtol=0, msg=name)


def initial_parameters(argv: list[str]) -> dict[str, torch.Tensor]:
    """The model hetfair-train starts from: seeded with --seed, then built by the task."""
    args = parse_train_args(argv)
    seed_everything(args.seed)
    return TASK_REGISTRY.get(args.task).setup_task(args).build_model(args).state_dict()


@pytest.mark.parametrize("flags, message", [
    (["--decoder-embed-dim", "30"], "--decoder-embed-dim 30 is not a multiple of --decoder-attention-heads 4"),
    (["--max-target-positions", "8"], "samples of 16 tokens do not fit the model's 8 positions"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--positions", "rotary", "--decoder-embed-dim", "36"], "rotary positions need an even head size"),
])
def test_sizes_that_cannot_work_are_one_line(tmp_path, data, capsys, flags, message):
    code = train_main(lm_train_args(data, tmp_path, *flags))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_the_model_and_generation_do_not_import_transformers():
    """transformers is optional: only export and --init-from-hf import it (fresh interpreter, as a user runs it)."""
    probe = ("import sys, hetfair_cli.generate, hetfair.lm.model; from hetfair.models import resolve_arch; "
             "resolve_arch('gpt_mini'); print('transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], env=subprocess_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
