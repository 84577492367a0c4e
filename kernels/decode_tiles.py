"""The Triton linear kernel's decode tiles, by their one free dimension -- Triton-free, so that ``triton_audit`` can
count them in a process without Triton.

A linear call of at most ``DECODE_ROWS_MAX`` rows (a decode step's batch) may run narrower tiles than the dtype's
canonical matmul tile: more programs for the same weight. A decode tile keeps the canonical tile's BLOCK_M and
BLOCK_K (the same K chunks in the same order) and changes only BLOCK_N, the columns a program owns; it runs only
where a first-use check on the device finds every row's bits equal to the canonical tiles' (``triton_exact``).
"""

from __future__ import annotations

DECODE_ROWS_MAX = 64
DECODE_BLOCK_N = (32, 16)  # the decode tiles' column widths, widest first (the order ``linear_tiles`` tries them)
