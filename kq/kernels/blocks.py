"""The 128-input block both kernel layouts (layout.py's tiles, lane_layout.py's lanes) are cut in."""
from __future__ import annotations

PACK_K = 128            # rows of K per prepacked block (8 nibbles x 16 words)


def padded_k(k: int) -> int:
    return -(-k // PACK_K) * PACK_K
