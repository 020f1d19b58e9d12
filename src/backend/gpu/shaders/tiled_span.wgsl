// What the tiled kernels (matmul_tiled.wgsl, matmul_coop.wgsl) ask of their rows module, which says which tokens a
// tile takes and where its outputs go: tiled_batch.wgsl (a batch's tokens in order) or tiled_picks.wgsl (a
// mixture's picks of one expert, grouped on the device). The module gives
//   span(wid) -> Span           the tile's tokens (n = 0: a tile of none, which returns at once);
//   x_row(s, tl) -> u32         the row of x (and of its halves) of the tile's token tl, NONE past the tile's;
//   w_row(s, r) -> u32          the row of this part's weight buffer for the tile's weight row r, NONE for none;
//   y_at(s, r, tl) -> u32       where row r's output for token tl goes in y, NONE for nowhere.

// No row: a token past the tile's, a weight row past the matrix or outside this part of it.
const NONE: u32 = 0xffffffffu;

// A tile's tokens: t0 and n, the first and how many (up to BN) in the rows module's numbering; the column slice it
// sums; e, the expert whose rows it takes (tiled_picks.wgsl; 0 in tiled_batch.wgsl).
struct Span {
    t0: u32,
    n: u32,
    slice: u32,
    e: u32,
}
