"""The outer loop's parts that need no processes: how the model splits into fragments, and the packed pseudo-gradients.

The codes are checked against plain arithmetic written here: a per-block absmax scale, round to nearest.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetfair.errors import ConfigError
from hetfair.parallel.outer_exchange import BLOCK, OuterExchange, bytes_sent, decode, encode, payload_bytes
from hetfair.parallel.outer_fragments import split_fragments, sync_offsets


def _params(*sizes: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(size)) for size in sizes]


def test_fragments_are_contiguous_and_about_equal_in_bytes():
    params = _params(100, 1, 100, 1, 100, 1)
    assert split_fragments(params, [], 3) == [[0, 1], [2, 3], [4, 5]]
    assert split_fragments(params, [], 1) == [[0, 1, 2, 3, 4, 5]]
    assert split_fragments(params, [], 6) == [[0], [1], [2], [3], [4], [5]]


def test_fragments_never_cut_a_sharding_unit():
    """Three layers of a weight and a bias each, then a head: two fragments cut between layers, never inside one."""
    layers = [nn.Linear(10, 10) for _ in range(3)]
    head = nn.Parameter(torch.zeros(5))
    params = [p for layer in layers for p in layer.parameters()] + [head]
    assert split_fragments(params, layers, 2) == [[0, 1, 2, 3], [4, 5, 6]]
    assert split_fragments(params, layers, 4) == [[0, 1], [2, 3], [4, 5], [6]]
    with pytest.raises(ConfigError, match="splits into at most 4 fragments"):
        split_fragments(params, layers, 5)


def test_fragments_meet_spread_over_the_round_the_last_at_its_end():
    assert sync_offsets(8, 1) == [8]
    assert sync_offsets(8, 4) == [2, 4, 6, 8]
    assert sync_offsets(8, 3) == [2, 5, 8]


def _reference_codes(values: torch.Tensor, levels: int) -> torch.Tensor:
    """Plain round-to-nearest of each block of BLOCK values to ``levels`` steps of its largest magnitude."""
    out = torch.empty_like(values)
    for start in range(0, values.numel(), BLOCK):
        block = values[start: start + BLOCK]
        scale = float(block.abs().max()) / levels or 1.0
        out[start: start + BLOCK] = torch.clamp(torch.round(block / scale), -levels, levels) * scale
    return out


@pytest.mark.parametrize("dtype, levels", [("int8", 127), ("int4", 7)])
def test_integer_codes_are_per_block_absmax_rounding(dtype, levels):
    torch.manual_seed(0)
    values = torch.randn(3 * BLOCK + 17) * torch.linspace(0.01, 10, 3 * BLOCK + 17)  # blocks of unlike scales
    values[BLOCK: 2 * BLOCK] = 0.0  # an all-zero block stays zero
    payload = encode(values, dtype)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(values.numel(), dtype)
    torch.testing.assert_close(decode(payload, dtype, values.numel()), _reference_codes(values, levels),
                               rtol=1e-6, atol=1e-7)


def test_bf16_codes_are_a_cast():
    values = torch.randn(1000)
    payload = encode(values, "bf16")
    assert payload.numel() == 2000
    assert torch.equal(decode(payload, "bf16", 1000), values.to(torch.bfloat16).float())


def test_bytes_per_exchange():
    """Four ranks, a million values: fp32's ring all-reduce sends 1.5 x 4 MB; int4 all-gathers 3 x 0.53 MB."""
    assert bytes_sent(1_000_000, "fp32", 4) == 6_000_000
    blocks = -(-1_000_000 // BLOCK)
    assert bytes_sent(1_000_000, "int4", 4) == 3 * blocks * (4 + BLOCK // 2)
    assert bytes_sent(1_000_000, "bf16", 2) == 2_000_000


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_error_feedback_loses_nothing_over_rounds(dtype):
    """What each round's code drops is sent with the next: over rounds, the decoded sum equals the sum of the
    deltas less the residual still held, and that residual stays below the deltas' own spread (0.01): it is one
    rounding step, not an accumulation of them."""
    torch.manual_seed(1)
    exchange = OuterExchange(dtype, 300, torch.device("cpu"), None, world_size=1)
    sent, received = torch.zeros(300), torch.zeros(300)
    for _ in range(20):
        delta = torch.randn(300) * 1e-2
        sent += delta
        [mean] = exchange.start([delta.clone()], [5.0], rank=0, background=False).wait()
        received += mean
    torch.testing.assert_close(received + exchange.residual, sent, rtol=0, atol=1e-6)
    assert float(exchange.residual.abs().max()) < 1e-2
