"""bench.exactness --same-as (bench/concurrency_check.py): two stacks' serial token ids compared request by request."""

from bench.concurrency_check import same_requests


def test_same_requests_counts_requests_with_equal_ids() -> None:
    a = [[1, 2, 3], [4, 5], [6]]
    assert same_requests(a, [[1, 2, 3], [4, 5], [6]]) == 3
    assert same_requests(a, [[1, 2, 3], [4, 9], [6]]) == 2
    assert same_requests(a, [[1, 2, 3], [4, 5]]) == 0  # another mix: nothing compares
