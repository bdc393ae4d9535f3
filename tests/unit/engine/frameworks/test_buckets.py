"""The padded sizes the framework runners compile for: powers of two for rows, 1.5x/2x steps for contexts."""

from __future__ import annotations

from app.engine.frameworks.buckets import context_bucket, pow2_bucket


def test_pow2_bucket() -> None:
    assert [pow2_bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    assert pow2_bucket(3, 8) == 8 and pow2_bucket(9, 8) == 16


def test_context_bucket_steps_by_one_and_a_half_and_two() -> None:
    assert [context_bucket(b, 4) for b in (1, 4, 5, 6, 7, 9, 13, 17, 25, 33, 49)] == [
        4, 4, 6, 6, 8, 12, 16, 24, 32, 48, 64
    ]
    assert [context_bucket(b, 1) for b in (1, 2, 3, 4, 5)] == [1, 2, 3, 4, 6]
    for blocks in range(1, 2000):  # at least the context, at most 1.5x it (past the minimum)
        assert blocks <= context_bucket(blocks, 4) <= max(4, -(-3 * blocks // 2))
    # few widths: the compiled shapes of a 2048-token context in blocks of 16 (a minimum of 4 blocks)
    assert len({context_bucket(b, 4) for b in range(1, 129)}) == 11
