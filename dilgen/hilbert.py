"""The generalized Hilbert curve ("gilbert", Jakub Červený's gilbert2d construction).

SPEC §2 fixes the curve: it starts at cell (row 0, col 0) and makes its first half-split
along the longer side (cols when cols >= rows); on a 2^k x 2^k grid it is the classic
d2xy Hilbert curve with x = col, y = row. Standard library only.
"""
from __future__ import annotations

from functools import lru_cache


def _sign(x: int) -> int:
    return (x > 0) - (x < 0)


def _walk(x: int, y: int, ax: int, ay: int, bx: int, by: int, out: list[tuple[int, int]]) -> None:
    """Append the cells of the rectangle spanned by major axis (ax, ay) and minor axis
    (bx, by) from corner (x, y), in curve order. Coordinates are (x = col, y = row)."""
    width, height = abs(ax + ay), abs(bx + by)
    dax, day = _sign(ax), _sign(ay)
    dbx, dby = _sign(bx), _sign(by)
    if height == 1:                      # a single row along the major axis
        for _ in range(width):
            out.append((x, y))
            x, y = x + dax, y + day
        return
    if width == 1:                       # a single column along the minor axis
        for _ in range(height):
            out.append((x, y))
            x, y = x + dbx, y + dby
        return
    ax2, ay2 = ax // 2, ay // 2
    bx2, by2 = bx // 2, by // 2
    width2, height2 = abs(ax2 + ay2), abs(bx2 + by2)
    if 2 * width > 3 * height:
        # Long rectangle: split in two along the major axis; keep the halves even so the
        # curve can end on the far corner.
        if width2 % 2 and width > 2:
            ax2, ay2 = ax2 + dax, ay2 + day
        _walk(x, y, ax2, ay2, bx, by, out)
        _walk(x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by, out)
        return
    # Standard case: up along the minor half, across, and back down.
    if height2 % 2 and height > 2:
        bx2, by2 = bx2 + dbx, by2 + dby
    _walk(x, y, bx2, by2, ax2, ay2, out)
    _walk(x + bx2, y + by2, ax, ay, bx - bx2, by - by2, out)
    _walk(x + (ax - dax) + (bx2 - dbx), y + (ay - day) + (by2 - dby),
          -bx2, -by2, -(ax - ax2), -(ay - ay2), out)


@lru_cache(maxsize=64)
def gilbert_order(rows: int, cols: int) -> tuple[int, ...]:
    """π: curve index → raster offset (row·cols + col) on a rows x cols grid."""
    if rows < 1 or cols < 1:
        raise ValueError(f"grid must be at least 1 x 1, got {rows} x {cols}")
    cells: list[tuple[int, int]] = []
    if cols >= rows:
        _walk(0, 0, cols, 0, 0, rows, cells)
    else:
        _walk(0, 0, 0, rows, cols, 0, cells)
    return tuple(y * cols + x for x, y in cells)


def inverse(perm: tuple[int, ...] | list[int]) -> list[int]:
    """π⁻¹ of a permutation given as a sequence."""
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def truncated_order(rows: int, cols: int, length: int) -> tuple[int, ...]:
    """Curve order of a short segment (SPEC §2): the positions that exist (< length),
    in the order the full grid's curve visits them."""
    return tuple(p for p in gilbert_order(rows, cols) if p < length)
