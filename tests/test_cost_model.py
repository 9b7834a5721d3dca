"""Each mode's formula (hetfair/parallel/cost_model.py) against times and bytes computed by hand.

The job: a model of 1M fp32 parameters (4 MB of gradients, one DDP bucket), 1 GFLOP and 1 MB of
activations per sample, Adam (2 bytes of state per parameter byte), 4 sharding units; two ranks of
10 samples at 10 ms each (100 ms of forward and backward, no optimizer step counted: no memory
bandwidth given), on two nodes joined by 100 MB/s with 0.1 ms latency; inside a node 10 GB/s, 10 us.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hetfair.cluster.description import Link
from hetfair.parallel import STRATEGY_REGISTRY, ParallelConfig
from hetfair.parallel import cost_model as cm

NETWORK = Link(1e8, 1e-4)
INSIDE = Link(1e10, 1e-5)
MODEL = cm.ModelCost(parameters=1_000_000, flops_per_sample=1e9, activation_bytes=1_000_000, optimizer_ratio=2.0,
                     units=4, largest_unit_bytes=1_000_000)


def job(nodes: int = 2, per_node: int = 1, overlaps: bool = False, model: cm.ModelCost = MODEL,
        memory: int = 10**9) -> cm.Job:
    ranks = tuple(cm.Rank(node, 0.01, memory, None, 10) for node in range(nodes) for _ in range(per_node))
    return cm.Job(model, ranks, (INSIDE,) * nodes, NETWORK, overlaps)


def test_the_collectives_are_the_ring_alpha_beta_formulas() -> None:
    assert cm.all_reduce(NETWORK, 4e6, 2) == pytest.approx(2 * 1e-4 + 4e6 / 1e8)  # 2 (W-1) a + 2 (W-1)/W S/B
    assert cm.all_reduce(NETWORK, 4e6, 4, messages=3) == pytest.approx(3 * 6 * 1e-4 + 1.5 * 4e6 / 1e8)
    assert cm.all_gather(NETWORK, 4e6, 4) == pytest.approx(3 * 1e-4 + 0.75 * 4e6 / 1e8)
    assert cm.send_to_all(NETWORK, 1e6, 3) == pytest.approx(2 * 1e-4 + 2 * 1e6 / 1e8)
    assert cm.all_reduce(NETWORK, 4e6, 1) == 0.0  # one rank: nothing to exchange


def test_replicated_on_cpus_waits_for_the_whole_all_reduce() -> None:
    cost = cm.replicated(job())
    all_reduce, stats = 2e-4 + 0.04, 2e-4
    assert cost.compute == pytest.approx(0.1)
    assert cost.seconds == pytest.approx(0.1 + all_reduce + stats)
    assert cost.network_bytes == pytest.approx(4e6)  # 2 (W-1)/W of the 4 MB
    assert cost.state_memory == (16_000_000, 16_000_000)  # parameters, gradients and Adam's 2x


def test_a_hook_that_sends_half_halves_the_bandwidth_term_only() -> None:
    cost = cm.replicated(job(), sent_fraction=0.5)
    assert cost.seconds == pytest.approx(0.1 + 2e-4 + 0.02 + 2e-4)


def test_on_gpus_ddp_hides_its_buckets_behind_the_backward_but_never_the_last() -> None:
    one_bucket = cm.replicated(job(overlaps=True))
    assert one_bucket.exposed == pytest.approx(2e-4 + 0.04 + 2e-4)  # one bucket: ready only at the end
    big = job(overlaps=True, model=cm.ModelCost(100_000_000, 1e9, 1_000_000, 2.0, 4, 1_000_000))
    buckets = math.ceil(4e8 / (25 * 2**20))
    all_reduce = buckets * 2e-4 + 4e8 / 1e8
    assert buckets == 16
    assert cm.replicated(big).exposed == pytest.approx(max(all_reduce / 16, all_reduce - 2 / 3 * 0.1) + 2e-4)


def test_zero_1_steps_a_shard_and_broadcasts_it_after_the_step() -> None:
    cost = cm.replicated(job(), zero=True)
    broadcasts = 1e-4 + 0.5 * 4e6 / 1e8  # (W - 1) shard-times of a 2 MB shard
    assert cost.seconds == pytest.approx(0.1 + 2e-4 + 0.04 + broadcasts + 2e-4)
    assert cost.state_memory == (12_000_000, 12_000_000)  # Adam's state halved: 4 + 4 + 8 / 2 MB
    one_big = cm.replicated(job(model=replace(MODEL, largest_parameter_bytes=3_600_000)), zero=True)
    assert one_big.seconds == pytest.approx(0.1 + 2e-4 + 0.04 + 1e-4 + 3.6e6 / 1e8 + 2e-4)  # whole parameters


def test_fully_sharded_gathers_twice_and_reduce_scatters_once_per_unit() -> None:
    cost = cm.fully_sharded(job())
    gather = 4 * 1e-4 + 0.5 * 4e6 / 1e8
    all_reduce = 4 * 2 * 1e-4 + 4e6 / 1e8  # gloo's reduce-scatter is an all-reduce of the whole input
    assert cost.seconds == pytest.approx(0.1 + 2 * gather + all_reduce + 2e-4)
    assert cost.network_bytes == pytest.approx((2 * 0.5 + 1) * 4e6)
    on_gpus = cm.fully_sharded(job(overlaps=True))  # a ring's reduce-scatter; all but the first unit's hidden
    assert on_gpus.communication == pytest.approx(3 * gather + 2e-4)
    assert on_gpus.exposed == pytest.approx(gather / 4 + 2 * gather / 4 + 2e-4)
    assert cost.state_memory == (10_000_000, 10_000_000)  # half of 16 MB, and the 1 MB unit (and its gradients) whole


def test_uneven_shards_on_gloo_reduce_by_all_reduce_and_gather_the_faster_way() -> None:
    cost = cm.uneven_sharded(job(), (0.25, 0.75))
    padded_gather = 4 * 1e-4 + 0.75 * 4e6 / 1e8  # each rank sends its segment padded to the 3 MB share
    all_reduce = 4 * 2 * 1e-4 + 4e6 / 1e8  # the 4 MB of each unit's gradients, unpadded
    assert padded_gather < all_reduce  # two ranks: the padded gather sends 3 MB, an all-reduce 4 MB
    assert cost.seconds == pytest.approx(0.1 + 2 * padded_gather + all_reduce + 2e-4)
    assert cost.network_bytes == pytest.approx(2 * 0.75 * 4e6 + 4e6)
    assert cost.state_memory == (6_000_000, 14_000_000)
    four = job(nodes=4)  # 1:1:1:7: a padded gather sends 3 x 2.8 MB, an all-reduce of the gathered unit 1.5 x 4 MB
    summed = cm.uneven_sharded(four, (0.1, 0.1, 0.1, 0.7))
    summed_gather = 4 * 6 * 1e-4 + 1.5 * 4e6 / 1e8
    assert summed_gather < 4 * 3 * 1e-4 + 3 * 0.7 * 4e6 / 1e8
    assert summed.seconds == pytest.approx(0.1 + 3 * summed_gather + 2 * 3 * 1e-4)  # stats: 2 (W - 1) latencies


def test_uneven_shards_on_gpus_send_padded_segments_behind_the_compute() -> None:
    cost = cm.uneven_sharded(job(overlaps=True), (0.25, 0.75))
    gather = 4 * 1e-4 + 0.75 * 4e6 / 1e8
    scatter = 4 * 1e-4 + 0.5 * 2 * 0.75 * 4e6 / 1e8  # a ring reduce-scatter of both padded segments
    assert cost.communication == pytest.approx(2 * gather + scatter + 2e-4)
    assert cost.exposed == pytest.approx(gather / 4 + (gather + scatter) / 4 + 2e-4)  # all but one unit's hidden


def test_hybrid_shards_inside_nodes_and_all_reduces_the_shards_across() -> None:
    cost = cm.hybrid_sharded(job(nodes=2, per_node=2))
    inside = 4 * 1e-5 + 0.5 * 4e6 / 1e10
    scatter = 4 * 2 * 1e-5 + 4e6 / 1e10  # gloo: an all-reduce
    across = 4 * 2 * 1e-4 + 4e6 / 1e8
    stats = 2 * 3 * 1e-4  # four ranks over the network
    assert cost.seconds == pytest.approx(0.1 + 2 * inside + scatter + across + stats)
    assert cost.network_bytes == pytest.approx(4e6 / 2)


def test_the_outer_loop_pays_its_exchange_once_a_round() -> None:
    plain = cm.outer_loop(job(), interval=8)
    assert plain.seconds == pytest.approx(0.1 + 2e-4 + (2e-4 + 0.04) / 8)
    streamed = cm.outer_loop(job(), interval=8, dtype="int4", fragments=4, overlap=True)
    assert streamed.seconds == pytest.approx(0.1 + 2e-4)  # 5.7 ms of exchange behind 0.8 s of inner updates
    packed = math.ceil(1e6 / 128) * (4 + 64)
    assert cm.outer_loop(job(), interval=8, dtype="int4").seconds == pytest.approx(
        0.1 + 2e-4 + (1e-4 + packed / 1e8) / 8)
    assert plain.state_memory == (24_000_000, 24_000_000)  # + the anchor and the outer momentum


def test_an_exchange_longer_than_the_round_shows_what_is_left() -> None:
    slow = cm.Job(MODEL, job().ranks, (INSIDE, INSIDE), Link(1e6, 1e-4), False)
    exchange = 2e-4 + 4e6 / 1e6  # 4 s of fp32 over 1 MB/s
    round_compute = 8 * (0.1 + 2e-4)
    cost = cm.outer_loop(slow, interval=8, overlap=True)
    assert cost.seconds == pytest.approx(0.1 + 2e-4 + (exchange - round_compute) / 8)


def test_memory_fit_takes_the_largest_micro_batch_beside_the_state() -> None:
    small = job(memory=20_000_000)
    micro, peaks = cm.memory_fit(small, cm.replicated(small).state_memory)
    assert micro == (4, 4)  # (20 MB - 16 MB) / 1 MB per sample
    assert peaks == (20_000_000, 20_000_000)
    assert cm.memory_fit(job(memory=15_000_000), (16_000_000, 0))[0] == (0, 10)


def test_each_strategy_names_its_own_formula() -> None:
    two = job()
    c10d, sharded = STRATEGY_REGISTRY.get("c10d"), STRATEGY_REGISTRY.get("fully_sharded")
    assert c10d.predict(ParallelConfig("c10d"), two) == cm.replicated(two)
    assert sharded.predict(ParallelConfig("fully_sharded"), two) == cm.fully_sharded(two)
    assert sharded.predict(ParallelConfig("fully_sharded", shard_fractions=(0.25, 0.75)), two) \
        == cm.uneven_sharded(two, (0.25, 0.75))
    diloco = STRATEGY_REGISTRY.get("diloco")
    assert diloco.predict(ParallelConfig("diloco", outer_interval=32), two) == cm.outer_loop(two, 32)
    assert diloco.changes_numbers(ParallelConfig("diloco"), two) and not c10d.changes_numbers(ParallelConfig("c10d"),
                                                                                               two)
    assert STRATEGY_REGISTRY.get("hybrid_sharded").cost_variants("hybrid_sharded", two) == []  # one rank a node
    assert len(STRATEGY_REGISTRY.get("hybrid_sharded").cost_variants("hybrid_sharded", job(per_node=2))) == 1


def test_with_accumulation_only_the_last_micro_batch_hides_the_all_reduce() -> None:
    """Four micro-batches of the big model: 400 ms of compute, of which the last micro-batch's backward (67 ms)
    overlaps the 4 s all-reduce; a sharded rank gathers its units for each micro-batch."""
    big = cm.ModelCost(100_000_000, 1e9, 1_000_000, 2.0, 4, 1_000_000)
    four = cm.Job(big, tuple(cm.Rank(node, 0.01, 10**9, None, 40) for node in range(2)), (INSIDE,) * 2, NETWORK,
                  True, accumulation=4)
    all_reduce = 16 * 2e-4 + 4e8 / 1e8
    assert cm.replicated(four).seconds == pytest.approx(0.4 + max(all_reduce / 16, all_reduce - 2 / 3 * 0.1) + 2e-4)
    gather = 4 * 1e-4 + 0.5 * 4e8 / 1e8
    assert cm.fully_sharded(four).communication == pytest.approx(9 * gather + 2e-4)  # 2 gathers x 4, 1 scatter


PIPELINED = replace(MODEL, boundary_bytes=100_000)  # 100 kB of activations a sample at a stage boundary


def test_a_pipeline_waits_for_its_bubble_and_sends_activations_not_gradients() -> None:
    """Two nodes, one stage each (half the layers), the pipeline's 20 samples in 4 micro-batches of 5: a slot is
    a stage's 5 x 0.5 x 10 ms = 25 ms and, on CPUs, the boundary's 500 kB each way (2 x (0.1 ms + 5 ms)); the last
    micro-batch leaves after 4 + 2 - 1 slots. The tied embeddings' rows (at most the 1 MB outside the 3 units of
    1 MB, less than the 20 samples' 2 MB of boundary) go to the first stage and their gradients back, and the
    statistics are all-reduced."""
    cost = cm.pipeline(job(model=PIPELINED), stages=2, microbatches=4, shares=[0.5, 0.5])
    slot = 0.025 + 2 * (1e-4 + 5e5 / 1e8)
    tied, stats = 2 * (1e-4 + 1e6 / 1e8), 2e-4
    assert cost.compute == pytest.approx(0.1)  # the stages' forward and backward, as one rank's of 20 samples
    assert cost.seconds == pytest.approx(5 * slot + tied + stats)
    assert cost.network_bytes == pytest.approx(2 * 20 * 1e5 + 2e6)  # 2 MB of activations, 1 MB of rows each way
    assert cost.state_memory == (int((2e6 + 1e6) * 4), int((2e6 + 1e6) * 4))  # half the units, and the ends


def test_on_gpus_a_pipeline_slot_is_the_longer_of_compute_and_transfer() -> None:
    cost = cm.pipeline(job(model=PIPELINED, overlaps=True), stages=2, microbatches=4, shares=[0.5, 0.5])
    assert cost.seconds == pytest.approx(5 * 0.025 + 2 * (1e-4 + 1e6 / 1e8) + 2e-4)


def test_uneven_stages_put_more_layers_on_the_faster_node() -> None:
    """Node 1 twice as fast: of 4 layers the auto split gives it 3 (even: 2), and the slowest slot shrinks."""
    ranks = (cm.Rank(0, 0.02, 10**9, None, 10), cm.Rank(1, 0.01, 10**9, None, 10))
    slow_fast = cm.Job(replace(PIPELINED, units=5), ranks, (INSIDE,) * 2, NETWORK, False)
    pipeline = STRATEGY_REGISTRY.get("pipeline")
    even, auto = (pipeline.predict(ParallelConfig("pipeline", pipeline_split=how, pipeline_microbatches=4), slow_fast)
                  for how in ("even", "auto"))
    assert {config.pipeline_split for config in pipeline.cost_variants("pipeline", slow_fast)} == {"even", "auto"}
    assert auto.seconds < even.seconds
    assert pipeline.cost_variants("pipeline", job()) == []  # a model without a stage boundary is not weighed
