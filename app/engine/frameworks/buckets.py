"""Padded sizes shared by the framework runners: a compiled step serves every batch or context up to its bucket.

Powers of two suit batch rows (a product of 8 or of 6 rows costs about the same). A context is read whole by the
attention of every decode step, so its width steps by 1.5x and 2x in turn (4, 6, 8, 12, 16, ... blocks): at most
1.5x the context instead of 2x, for twice the (still logarithmic) number of compiled widths.
"""

from __future__ import annotations


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """The next power of two at or above ``n``, at least ``minimum``."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


def context_bucket(blocks: int, minimum: int) -> int:
    """The width in blocks for a context of ``blocks`` blocks: the smallest ``m * 2^k`` (``m`` 2 or 3) at or above
    ``blocks``, at least ``minimum`` (itself a power of two): 4, 6, 8, 12, 16, 24, ... for a minimum of 4."""
    width = max(minimum, 1)
    while width < blocks:
        width = width * 3 // 2 if width >= 2 and (width & (width - 1)) == 0 else 1 << width.bit_length()
    return width
