"""`make demo`'s headline: the median of its interleaved ar/sd pairs, each pair named."""
from specengine.demo import pairs_speedup


def test_the_speedup_is_the_median_of_the_pairs_not_the_better_one():
    assert pairs_speedup([1.0, 2.0])[0] == 1.5  # two pairs (the default): their mean
    assert pairs_speedup([0.9, 1.6, 1.1])[0] == 1.1
    assert pairs_speedup([1.02, 1.67])[1].endswith("2 interleaved ar/sd pairs: 1.02, 1.67")
