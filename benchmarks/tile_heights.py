"""What the canonical arrangement's 64-row GEMM tiles cost at a training pass's rows, and whether taller tiles would
keep their bits on this host.

    python -m benchmarks.tile_heights --shape llama100m --dtype all --threads 1,2 --rows 320 --reps 7

A host whose ``same_bits`` probes fail (guard mode ``canonical`` measures it anywhere) runs a linear layer's rows as
GEMM calls of at most 64 rows (``gemm_tiles.ROW_BLOCKS``: the tallest tile the guard's ``gemm_rows`` probe covers),
where ``auto`` stacks them into one call. For each distinct weight shape of the model (q, k/v, o, gate/up, down, LM
head), at ``--rows`` rows, this times the GEMM calls alone -- ``torch.mm`` on the weight laid out [K, N] once, rows
zero-padded, no plan or copy around them -- interleaved in one process:

- ``64-row tiles / one call``: what the per-tile arrangement's GEMMs cost over the stacked call's;
- ``H-row tiles + 64 / one call`` (H in ``TALL_HEIGHTS``): whole tiles of H rows, the rest in 64-row tiles -- what a
  canonical arrangement with taller tiles would cost;

and asks of one call of ``--rows`` rows (``auto``'s stacked call) and of an H-row call whether each row has the bits
that row gets in 64-row calls (seeded rows, compared bitwise: what the guard's probes ask, here of ``torch.mm``
alone). Taller canonical tiles would pay only on a host where that holds, and a host whose GEMM
accumulates by the number of rows in a call (the hosts ``canonical`` exists for) would refuse them: the figures say
what the 64-row bound costs here, and whether a taller one would keep this host's bits.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from vexact.engine.model import short_dtype_name
from vexact_kernels.gemm_tiles import ROW_BLOCKS

from .common import (
    DTYPES,
    add_common_arguments,
    cli_main,
    compare,
    describe_run,
    fmt_ratio,
    inner_repeats,
    new_record,
    parse_list,
    parse_one,
    parse_threads,
    print_table,
    renamed_sides,
    shapes,
)
from .decode_profile import weight_shapes

TILE = ROW_BLOCKS[-1]
"""The canonical arrangement's tallest tile: the height a training pass's rows are cut into."""
TALL_HEIGHTS = (2 * TILE, 4 * TILE)
"""Taller tiles this asks about (128 and 256 rows)."""
DEFAULT_ROWS = "320"
"""llama100m's training pass in ``end_to_end``: 8 sequences of 32 + 8 tokens, 320 rows."""


def _tiles(x: torch.Tensor, height: int) -> list[torch.Tensor]:
    """``x``'s rows in whole tiles of ``height`` rows, the rest in ``TILE``-row tiles, each its own zero-padded copy."""
    rows = x.shape[0]
    whole = rows // height * height if height > TILE else 0
    starts = [(s, height) for s in range(0, whole, height)] + [(s, TILE) for s in range(whole, rows, TILE)]
    tiles = []
    for start, size in starts:
        tile = x.new_zeros(size, x.shape[1])
        tile[: min(size, rows - start)] = x[start : start + size]
        tiles.append(tile)
    return tiles


def _calls(x: torch.Tensor, weight_kn: torch.Tensor, height: int) -> Callable[[], list[torch.Tensor]]:
    """The GEMM calls of ``_tiles(x, height)`` (the tiles made here, once: not timed)."""
    tiles = _tiles(x, height)
    return lambda: [torch.mm(tile, weight_kn) for tile in tiles]


def _rows_differing(weight_kn: torch.Tensor, rows: int, gen: torch.Generator) -> int:
    """Rows of one call of ``rows`` seeded rows whose bits differ from those the same rows get in ``TILE``-row calls
    (the last one zero-padded, as the canonical tiles are)."""
    x = torch.randn(rows, weight_kn.shape[0], generator=gen).to(weight_kn.dtype)
    tiled = torch.cat([torch.mm(tile, weight_kn) for tile in _tiles(x, TILE)])[:rows]
    return int((torch.mm(x, weight_kn) != tiled).any(dim=1).sum())


def run(shape_name: str, dtype_names: list[str], thread_list: list[int | None], rows_list: list[int], reps: int,
        malloc: str = "steady") -> dict:
    """Run the benchmark; returns the JSON-ready record."""
    record = new_record("tile_heights", torch.device("cpu"), [shape_name], dtype_names, reps, thread_list[0], "exact",
                        malloc, rows=rows_list, tile=TILE, tall_heights=list(TALL_HEIGHTS))
    record["settings"]["threads"] = [count or torch.get_num_threads() for count in thread_list]
    config = shapes()[shape_name].model
    for threads in record["settings"]["threads"]:
        torch.set_num_threads(threads)
        for dtype_name in dtype_names:
            dtype = DTYPES[dtype_name]
            gen = torch.Generator().manual_seed(0)
            for n, k in weight_shapes(config):
                weight_kn = torch.randn(k, n, generator=gen).to(dtype)
                for rows in rows_list:
                    x = torch.randn(rows, k, generator=gen).to(dtype)
                    one = lambda x=x, w=weight_kn: torch.mm(x, w)  # noqa: E731
                    inner = inner_repeats(one)
                    entry = {"shape": shape_name, "weight": f"N={n} K={k}", "dtype": dtype_name,
                             "threads": torch.get_num_threads(), "rows": rows, "inner_calls": inner,
                             "rows_differing_one_call": _rows_differing(weight_kn, rows, gen)}
                    for height in (TILE, *TALL_HEIGHTS):
                        if height > TILE and rows < height:
                            continue  # no whole tile of that height: the same calls as TILE's
                        summary = compare(_calls(x, weight_kn, height), one, reps=reps, inner=inner).summary()
                        entry[f"tiles_{height}"] = renamed_sides(summary, "tiles", "one_call")
                        if height > TILE:
                            entry[f"rows_differing_{height}"] = _rows_differing(weight_kn, height, gen)
                    record["results"].append(entry)
    return record


def table(record: dict) -> tuple[list[str], list[list[str]]]:
    """The record as (columns, rows): per weight shape, dtype, threads and rows, each arrangement's GEMM time over
    one call's, and whether each taller tile keeps the 64-row tile's bits."""
    tile, tall = record["settings"]["tile"], record["settings"]["tall_heights"]
    columns = ["weight", "dtype", "threads", "rows", f"{tile}-row tiles / one call",
               *(f"{h}-row tiles + {tile} / one call" for h in tall),
               *(f"{label} call: {tile}-row bits" for label in ["one", *(f"{h}-row" for h in tall)])]
    rows = []
    for r in record["results"]:
        timed = [fmt_ratio(r[f"tiles_{h}"]) if f"tiles_{h}" in r else "—" for h in (tile, *tall)]
        bits = ["—" if f"rows_differing_{h}" not in r else
                "yes" if r[f"rows_differing_{h}"] == 0 else f"no ({r[f'rows_differing_{h}']} of {size} rows)"
                for h, size in [("one_call", r["rows"]), *((h, h) for h in tall)]]
        rows.append([r["weight"], short_dtype_name(r["dtype"]), str(r["threads"]), str(r["rows"]), *timed, *bits])
    return columns, rows


def print_results(record: dict) -> None:
    print_table(f"GEMM calls of the canonical tiles and of taller ones, over one call ({describe_run(record)})",
                *table(record))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, "tile_heights", default_shape="llama100m", default_reps=7, thread_list=True,
                         cpu_only="cpu (this measures the host's GEMM library)")
    p.add_argument("--rows", default=DEFAULT_ROWS, metavar="N[,N...]",
                   help=f"rows of the linear layer's input, a comma list (default {DEFAULT_ROWS}: llama100m's "
                        "training pass in end_to_end)")


def _parse_rows(value: str) -> list[int]:
    try:
        rows = [int(v) for v in value.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise ValueError(f"--rows must be a comma list of positive integers (e.g. 320), got {value!r}")
    return rows


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Run the benchmark the parsed options ask for; the JSON-ready record."""
    if device.type != "cpu":
        raise ValueError("tile_heights measures the host CPU's GEMM library: use --device cpu")
    return run(parse_one(args.shape, list(shapes()), "shape"), parse_list(args.dtype, list(DTYPES), "dtype"),
               parse_threads(args.threads), _parse_rows(args.rows), args.reps, malloc=args.malloc)


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.tile_heights") -> int:
    """Command-line entry point; bad input (unknown shape, dtype, rows, a device other than cpu) exits 2 with one
    line."""
    return cli_main(argv, prog, __doc__.split("\n")[0], "tile_heights", add_arguments, measure, print_results)


if __name__ == "__main__":
    sys.exit(main())
