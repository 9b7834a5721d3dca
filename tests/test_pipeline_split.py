"""Where a pipeline cuts the model and which ranks run which stage (hetfair.parallel.pipeline_split)."""

from __future__ import annotations

import itertools

import pytest

from hetfair.errors import ConfigError
from hetfair.parallel.pipeline_split import (
    balanced_split,
    check_split_text,
    check_stages,
    even_split,
    parse_split,
    pipelines,
    stage_capacities,
    stage_count,
    stage_rates,
    unit_ranges,
)


def slowest(counts: list[int], rates: list[float], ends: tuple[float, float]) -> float:
    """The slowest stage's time, computed directly: what balanced_split must minimise."""
    extra = [ends[0] if s == 0 else 0.0 for s in range(len(counts))]
    extra[-1] += ends[1]
    return max((count + e) / rate for count, e, rate in zip(counts, extra, rates))


@pytest.mark.parametrize("units, rates, capacities, ends", [
    (12, [1.0, 2.0], [12, 12], (0.0, 0.0)),
    (12, [1.0, 2.0], [12, 12], (0.0, 2.5)),
    (10, [1.0, 1.0, 3.0], [10, 10, 4], (0.5, 1.0)),
    (9, [2.0, 1.0, 1.0, 2.0], [9, 2, 9, 9], (0.0, 0.0)),
])
def test_balanced_split_is_the_best_of_every_split_that_fits(units, rates, capacities, ends):
    every = [list(c) for c in itertools.product(range(1, units + 1), repeat=len(rates))
             if sum(c) == units and all(n <= cap for n, cap in zip(c, capacities))]
    best = min(slowest(c, rates, ends) for c in every)
    chosen = balanced_split(units, rates, capacities, ends)
    assert sum(chosen) == units and all(1 <= n <= cap for n, cap in zip(chosen, capacities))
    assert slowest(chosen, rates, ends) == pytest.approx(best)


def test_a_node_twice_as_fast_takes_twice_the_layers():
    assert balanced_split(12, [1.0, 2.0], [12, 12]) == [4, 8]


def test_balanced_split_refuses_layers_that_fit_nowhere():
    with pytest.raises(ConfigError, match="hold at most"):
        balanced_split(12, [1.0, 1.0], [5, 6])


def test_even_split_gives_the_extra_layers_to_the_middle_stages():
    assert even_split(12, 4) == [3, 3, 3, 3]
    assert even_split(10, 4) == [2, 3, 3, 2]
    assert even_split(5, 2) == [2, 3]
    assert sum(even_split(23, 5)) == 23


def test_split_by_hand_is_checked_against_the_model():
    assert parse_split("1,3", 4, 2) == [1, 3]
    assert parse_split("even", 4, 2) is None and parse_split("auto", 4, 2) is None
    for text in ("1,2", "4", "0,4", "a,b"):
        with pytest.raises(ConfigError, match="--pipeline-split"):
            parse_split(text, 4, 2)


def test_split_text_is_checked_before_the_model_is_built():
    check_split_text("auto", 3)
    check_split_text("1,2,3", 3)
    for text, words in (("1,2,3", "one positive number of layers per stage"), ("2,0", "one positive"),
                        ("x", "whole number")):
        with pytest.raises(ConfigError, match=words):
            check_split_text(text, 2)


def test_stage_refusals_name_the_model():
    with pytest.raises(ConfigError, match="declares no sharding units"):
        check_stages(0, 2, "MnistNet")
    with pytest.raises(ConfigError, match="at least 5 sharding units"):
        check_stages(4, 5, "TransformerLM")


def test_layouts_put_stages_across_or_inside_the_nodes():
    assert pipelines(4, 2, "across") == [[0, 2], [1, 3]]  # ranks 0,1 (one node) hold stage 0 of both pipelines
    assert pipelines(4, 2, "inside") == [[0, 1], [2, 3]]
    assert pipelines(6, 3, "across") == [[0, 2, 4], [1, 3, 5]]
    assert stage_count(2, "interleaved") == 4 and stage_count(3, "1f1b") == 3


def test_stage_rates_and_capacities_take_each_positions_slowest_and_smallest_rank():
    pipes = [[0, 2], [1, 3]]
    assert stage_rates([4.0, 3.0, 1.0, 2.0], pipes, 2) == [3.0, 1.0]
    assert stage_rates([4.0, 3.0, 1.0, 2.0], pipes, 4) == [3.0, 1.0, 3.0, 1.0]  # interleaved: stage s at s % 2
    assert stage_capacities([100, 120, 50, None], pipes, 2, unit_bytes=10, end_bytes=20, units=8) == [8, 8]
    assert stage_capacities([100, 120, 50, 60], pipes, 2, unit_bytes=10, end_bytes=20, units=8) == [8, 3]
    assert stage_capacities([100, 120, 50, 60], pipes, 4, unit_bytes=10, end_bytes=20, units=8) == [4, 1, 4, 1]


def test_unit_ranges_follow_the_counts():
    assert unit_ranges([1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]
