"""The kernels' run-time options: which attention passes run, which AVX-512 passes serve each tile of
rows, how far ahead the quantised passes prefetch, from how many rows the 8-bit rounding is shared.

Every option gives the same bits; only the time differs. native/tuning.py measures which values
are fastest on this machine and sets them here; the values themselves live in the C library.
"""

from __future__ import annotations

from ddspec.native.lib import library

ATTENTION_MODES = {"auto": 0, "rows": 1, "shared": 2}


def set_attention(mode: str) -> None:
    """Which attention ``dd_layers_forward`` runs: ``rows`` (one (token, head) row per unit, one
    pass), ``shared`` (each kv head's keys and values read once for all its queries, three
    passes), or ``auto`` (rows for one new token, shared for more). Both compute the same sums in
    the same order; this exists for tests and measurements."""
    lib = library()
    if lib is None or lib.dd_set_attention(ATTENTION_MODES[mode]):
        raise ValueError(f"cannot set the attention mode {mode!r}")


def set_attention_wide(on: bool) -> bool:
    """Run the shared attention's passes on 16 lanes where the build has AVX-512F (``on``) or on 8;
    the same bits either way. Returns whether the 16-lane passes are in use now."""
    lib = library()
    return bool(lib is not None and lib.dd_set_attention_wide(int(bool(on))))


def attention_wide() -> bool:
    """Whether the shared attention's passes run on 16 lanes now."""
    lib = library()
    return bool(lib is not None and lib.dd_set_attention_wide(-1))


# -- the AVX-512 passes: how many groups of 16 outputs each pass runs at once ------------------
WIDE_ROWS = 8  # the tile sizes dd_wide_groups covers (more rows run in balanced tiles of at most 8)
WIDE_KINDS = {"q4_1": 0, "q8_0": 1, "q4_1a8": 2, "q8_0a8": 3}
WIDE_A8 = ("q4_1a8", "q8_0a8")  # the kinds whose AVX-512 passes also need AVX-512 VNNI


def wide_available(kind: str | None = None) -> bool:
    """Whether the kernels were built with the AVX-512 passes (a CPU with AVX-512F, DDSPEC_AVX512 unset),
    for ``kind`` when given (the 8-bit-activation kinds also need AVX-512 VNNI)."""
    lib = library()
    return lib is not None and lib.dd_wide() >= (2 if kind in WIDE_A8 else 1)


def wide_options(rows: int, kind: str | None = None) -> tuple[int, ...]:
    """The groups per pass a tile of ``rows`` rows can take: 0 (the 8-lane passes), 1, 2, 3 (up to 4
    rows; up to 8 for an 8-bit-activation ``kind``), 4 (up to 2 rows). Three groups for 5-8 rows of
    8-bit activations: the int8 model's forward over 5-8 tokens after 256 took 3.5-4% less than
    with two (Intel Xeon family 6 model 207, interleaved medians of 15); for 3-6 rows four groups
    measured the same as three, so they are not built."""
    three = WIDE_ROWS if kind in WIDE_A8 else 4
    return tuple(g for g, top in ((0, WIDE_ROWS), (1, WIDE_ROWS), (2, WIDE_ROWS), (3, three), (4, 2)) if rows <= top)


def set_wide(kind: str, groups: list[int]) -> None:
    """Use ``groups[r - 1]`` groups per pass for tiles of r rows of ``kind`` (one of WIDE_KINDS: q4_1 /
    q8_0 with fp32 activations, q4_1a8 / q8_0a8 with 8-bit ones; 0 = the 8-lane passes)."""
    lib = library()
    for rows, g in enumerate(groups, 1):
        if lib is None or lib.dd_set_wide_groups(WIDE_KINDS[kind], rows, int(g)):
            raise ValueError(f"no kernel pass for {rows} rows of {kind} in {g} groups")


def wide_choice() -> dict[str, list[int]]:
    """The groups per pass in use for tiles of 1..WIDE_ROWS rows of each kind ({} without the AVX-512 passes)."""
    if not wide_available():
        return {}
    return {kind: [library().dd_get_wide_groups(i, rows) for rows in range(1, WIDE_ROWS + 1)]
            for kind, i in WIDE_KINDS.items() if wide_available(kind)}


PREFETCH_OPTIONS = (0, 12, 24, 48)  # blocks ahead the quantised passes may prefetch (0: none)
PREFETCH_ROWS_OPTIONS = (2, 3)  # the fewest rows of a pass that prefetch (1 row: the hardware's streams keep up)


def set_share_rows(rows: int) -> None:
    """From ``rows`` rows on (0: never) the 8-bit-activation matmuls round their rows once, shared
    among the threads, instead of once per thread; the same bits either way (default 3)."""
    lib = library()
    if lib is None or lib.dd_set_share_rows(int(rows)):
        raise ValueError(f"cannot share the rounding from {rows} rows (0 or more, with the kernels built)")


def set_prefetch(blocks: int) -> None:
    """Have the quantised passes (every block kind, with fp32 or 8-bit activations) of prefetch_rows()
    rows or more prefetch the weight blocks ``blocks`` ahead into the L2 cache (0: leave it to the
    hardware). The same bits whatever it is; only the time differs."""
    lib = library()
    if lib is None or lib.dd_set_prefetch(int(blocks)):
        raise ValueError(f"cannot prefetch {blocks} blocks ahead (0 .. 256, with the kernels built)")


def prefetch_blocks() -> int:
    """The blocks ahead the quantised passes of prefetch_rows() rows or more prefetch now (0: none)."""
    lib = library()
    return 0 if lib is None else lib.dd_get_prefetch()


def set_prefetch_rows(rows: int) -> None:
    """Have the quantised passes of ``rows`` rows or more prefetch (set_prefetch's distance; default
    3). The same bits whatever it is."""
    lib = library()
    if lib is None or lib.dd_set_prefetch_rows(int(rows)):
        raise ValueError(f"cannot prefetch from {rows} rows (1 .. 64, with the kernels built)")


def prefetch_rows() -> int:
    """The fewest rows of a quantised pass that prefetch now."""
    lib = library()
    return 3 if lib is None else lib.dd_get_prefetch_rows()


def set_span_delay(us: int) -> int:
    """For tests: thread 0 of every quantised or dense matmul starts ``us`` microseconds late (0: on
    time), so that the other threads take its groups (the kernels' work stealing); returns how many
    units of groups were taken from another thread while a delay was set, since the last call."""
    lib = library()
    if lib is None:
        raise ValueError("the native kernels are not built here")
    return int(lib.dd_set_span_delay(int(us)))
