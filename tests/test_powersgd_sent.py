"""What PowerSGD sends per update (`sent_numbers`, behind its declared cost `sent_fraction`)."""

from hetfair.parallel.powersgd import sent_numbers

SHAPES = [(1000, 1000), (1000,)]  # one weight matrix and its bias
"""At rank r PowerSGD sends P and Q, (1000 + 1000) * r numbers, and the bias whole: 2000 r + 1000."""


def test_sent_numbers_are_p_and_q_of_each_compressed_matrix_and_every_vector_whole():
    assert [sent_numbers(SHAPES, rank) for rank in (1, 8, 32)] == [3_000, 17_000, 65_000]


def test_a_matrix_that_would_not_shrink_twofold_is_sent_whole():
    assert sent_numbers([(4, 4)], 2) == 16  # P and Q would be (4 + 4) * 2 = 16 numbers: no gain

