"""``choose_rank``: the rank ``--powersgd-rank auto`` would take from the measured link and the gradients' shapes."""

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
