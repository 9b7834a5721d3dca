"""The job's dynamic loss scale (fairseq's rules) and the autocast each precision runs under."""

from __future__ import annotations

import argparse

import pytest
import torch

from hetfair.errors import DivergenceError
from hetfair.precision.mixed import LossScaleConfig, LossScaler, autocast


def scaler(**config: float) -> LossScaler:
    return LossScaler(LossScaleConfig(**{"init_scale": 128.0, "scale_window": 3, **config}))


def test_an_overflow_halves_the_scale_and_restarts_the_window() -> None:
    s = scaler()
    s.update(overflow=False)
    s.update(overflow=False)
    s.update(overflow=True)
    assert (s.scale, s.clean_updates) == (64.0, 0)
    s.update(overflow=False)
    s.update(overflow=False)
    assert s.scale == 64.0  # two clean updates since the overflow: not yet a window
    s.update(overflow=False)
    assert (s.scale, s.clean_updates) == (128.0, 0)


def test_the_scale_doubles_after_every_window_of_clean_updates() -> None:
    s = scaler()
    scales = []
    for _ in range(7):
        s.update(overflow=False)
        scales.append(s.scale)
    assert scales == [128.0, 128.0, 256.0, 256.0, 256.0, 512.0, 512.0]


def test_threshold_loss_scale_is_a_floor() -> None:
    s = scaler(threshold_loss_scale=100.0)
    s.update(overflow=True)
    assert s.scale == 100.0
    s.update(overflow=True)
    assert s.scale == 100.0


def test_reaching_min_loss_scale_is_one_divergence_line() -> None:
    s = scaler(init_scale=4.0, min_loss_scale=1.0)
    s.update(overflow=True)
    assert s.scale == 2.0
    with pytest.raises(DivergenceError) as caught:
        s.update(overflow=True)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("gradients overflow even at loss scale 2, and halving it would take it to or below "
                              "--min-loss-scale 1;")
    assert s.scale == 2.0  # left as it was


def test_state_round_trips_exactly() -> None:
    s = scaler(init_scale=3.0)
    for overflow in (False, True, False, False):
        s.update(overflow)
    restored = scaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict() == {"scale": 1.5, "clean_updates": 2}


@pytest.mark.parametrize("world_size,update_freq,window", [(1, 1, 16384), (3, 2, 2730), (1, 20000, 1)])
def test_the_default_window_is_fairseqs(world_size: int, update_freq: int, window: int) -> None:
    args = argparse.Namespace(fp16_init_scale=128.0, fp16_scale_window=None, min_loss_scale=1e-4,
                              threshold_loss_scale=None, update_freq=update_freq)
    assert LossScaleConfig.from_args(args, world_size).scale_window == window


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                             ("fp16", torch.float16)])
def test_autocast_runs_matrix_products_in_the_chosen_precision(precision: str, dtype: torch.dtype) -> None:
    layer = torch.nn.Linear(4, 2)
    with autocast(precision, torch.device("cpu")):
        out = layer(torch.ones(3, 4))
    assert out.dtype == dtype and layer.weight.dtype == torch.float32
