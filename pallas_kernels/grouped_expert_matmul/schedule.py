"""Row tiles from group sizes: rows sorted by expert -> tiles of `tm` rows, each tile one
expert's (static shapes; the kernel's layout).

    layout = tile_layout(group_sizes_E, P, tm)
    x_RK = to_tiles(x_PK, layout)          # [S * tm, K], padding rows 0
    y_PN = from_tiles(y_RN, layout)        # the sorted rows' outputs back

Expert e's rows fill ceil(n_e / tm) consecutive tiles; S = ceil(P / tm) + min(E, P) tiles
always suffice (each expert wastes under one tile). Tiles past the used ones have expert
-1 (empty: the kernel reads no weights for them and writes zeros).
"""
import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TileLayout:
    tile_expert_S: jax.Array   # int32 [S]: expert of tile s, -1 for an empty tile
    dst_P: jax.Array           # int32 [P]: padded row of sorted row p (R = S * tm: none)
    src_R: jax.Array           # int32 [R]: sorted row of padded row r (P: a zero row)
    tm: int = dataclasses.field(metadata=dict(static=True))


def num_tiles(P: int, E: int, tm: int) -> int:
    return -(-P // tm) + min(E, P)


def tile_layout(group_sizes_E, P: int, tm: int) -> TileLayout:
    """group_sizes_E int [E] (sum <= P; rows past the sum belong to no expert)."""
    E = group_sizes_E.shape[0]
    S = num_tiles(P, E, tm)
    gs = group_sizes_E.astype(jnp.int32)
    first_row = jnp.cumsum(gs) - gs                                  # [E]
    ntile = -(-gs // tm)
    end_tile = jnp.cumsum(ntile)
    first_tile = end_tile - ntile
    p = jnp.arange(P, dtype=jnp.int32)
    e_P = jnp.searchsorted(jnp.cumsum(gs), p, side="right").astype(jnp.int32)   # E: none
    e_c = jnp.minimum(e_P, E - 1)
    dst = jnp.where(e_P < E, first_tile[e_c] * tm + p - first_row[e_c], S * tm)
    src = jnp.full((S * tm,), P, jnp.int32).at[dst].set(p, mode="drop")
    s = jnp.arange(S, dtype=jnp.int32)
    e_S = jnp.searchsorted(end_tile, s, side="right").astype(jnp.int32)
    tile_expert = jnp.where(e_S < E, e_S, -1)
    return TileLayout(tile_expert, dst, src, tm)


def to_tiles(x_PK, layout: TileLayout):
    """Sorted rows [P, K] -> padded tile rows [S * tm, K] (a gather; padding rows 0)."""
    zero = jnp.zeros((1, x_PK.shape[1]), x_PK.dtype)
    return jnp.concatenate([x_PK, zero])[layout.src_R]


def from_tiles(y_RN, layout: TileLayout):
    """Padded tile rows [S * tm, N] -> the sorted rows' [P, N] (rows of no expert: 0)."""
    zero = jnp.zeros((1, y_RN.shape[1]), y_RN.dtype)
    return jnp.concatenate([y_RN, zero])[layout.dst_P]
