"""The pure rules for slow links: the rank `--powersgd-rank auto` would take (`choose_rank`), and the outer-loop settings that fit a link (`fitting_outer`)."""

from hetfair.parallel.powersgd import RANK_LADDER, choose_rank, sent_numbers

SHAPES = [(1000, 1000), (1000,)]  # one weight matrix and its bias
"""At rank r PowerSGD sends P and Q, (1000 + 1000) * r numbers, and the bias whole: 2000 r + 1000."""


def test_sent_numbers_are_p_and_q_of_each_compressed_matrix_and_every_vector_whole():
    assert [sent_numbers(SHAPES, rank) for rank in (1, 8, 32)] == [3_000, 17_000, 65_000]


def test_a_matrix_that_would_not_shrink_twofold_is_sent_whole():
    assert sent_numbers([(4, 4)], 2) == 16  # P and Q would be (4 + 4) * 2 = 16 numbers: no gain


def test_the_largest_rank_whose_bytes_fit_the_budget_is_chosen():
    # 1 MB/s for 0.1 s: 100,000 bytes, 25,000 fp32 numbers; 2000 r + 1000 <= 25,000 up to r = 12
    assert choose_rank(SHAPES, bytes_per_second=1e6, budget_seconds=0.1) == 8


def test_a_fast_link_gets_the_top_of_the_ladder():
    assert choose_rank(SHAPES, bytes_per_second=1e9, budget_seconds=0.1) == RANK_LADDER[-1] == 32


def test_where_no_rank_fits_the_smallest_which_sends_least_is_chosen():
    assert choose_rank(SHAPES, bytes_per_second=1e6, budget_seconds=0.001) == 1


def test_the_outer_advice_takes_the_smallest_interval_then_the_least_lossy_type_that_fits_the_link():
    from hetfair.parallel.comm_advice import LinkMeasurement, fitting_outer
    # 1M fp32 parameters; their all-reduce takes 1 s: an fp32 round costs 1 s, int4 (0.5 + 4/128 bytes) 0.133 s
    link = LinkMeasurement(gradient_bytes=4_000_000, all_reduce_seconds=1.0, nodes=2, hooks=())
    assert fitting_outer(1_000_000, 2, link, compute_seconds=0.25) == (4, "fp32")
    # int8 (1 + 4/128 bytes) 0.258 s, bf16 0.5 s
    assert fitting_outer(1_000_000, 2, link, compute_seconds=0.1) == (4, "int8")  # 4 updates: 0.4 s
    assert fitting_outer(1_000_000, 2, link, compute_seconds=0.01) == (16, "int4")  # 0.16 s
    assert fitting_outer(1_000_000, 2, link, compute_seconds=1e-4) is None  # 64 updates: 6.4 ms
