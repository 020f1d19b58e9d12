// A batch's expert picks grouped by expert, for the tiled indexed matmuls (matmul_tiled.wgsl over
// tiled_picks.wgsl): `order` lists the picks (indices z of `ids`) expert by expert, and `tiles` cuts each expert's
// run into tiles of up to TILE picks, (expert, first slot in order, picks) at 3g for tile g, and (NONE, 0, 0) from
// the last tile to p.max_tiles (the grid the matmuls are dispatched over, sized on the host for any routing).
//
// One workgroup: the picks are counted per expert (workgroup atomics), one thread sums the counts into each
// expert's first slot and first tile (at most MAX_EXPERTS steps in workgroup memory: microseconds, where a parallel
// scan would need its own barriers per step), then each pick takes the next slot of its expert's run. Within a run
// the picks' order is the atomics', not fixed: each pick's products are its own, so no value depends on it. A pick
// of no expert (an id past n_expert; the routing writes none) is left out, its outputs unwritten.

struct Params {
    n_picks: u32,
    n_expert: u32,
    max_tiles: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> order: array<u32>;
@group(0) @binding(3) var<storage, read_write> tiles: array<u32>;

const WG: u32 = 256u;
// The most experts a layer may have here (moe.rs's MAX_GROUPED_EXPERTS): 12 KiB of workgroup memory.
const MAX_EXPERTS: u32 = 1024u;
// Picks a tile: matmul_tiled.wgsl's BN.
const TILE: u32 = 64u;
const NONE: u32 = 0xffffffffu;

var<workgroup> count: array<atomic<u32>, MAX_EXPERTS>;
var<workgroup> first_slot: array<u32, MAX_EXPERTS>;
var<workgroup> first_tile: array<u32, MAX_EXPERTS>;
var<workgroup> n_tiles: u32;

// Every valid pick takes a turn at its expert's counter, from zero: with `place`, the pick goes to its expert's
// first slot plus its turn; without, the counters end as the experts' counts. Every thread calls it (it holds a
// barrier).
fn take_turns(li: u32, place: bool) {
    for (var e = li; e < p.n_expert; e += WG) {
        atomicStore(&count[e], 0u);
    }
    workgroupBarrier();
    for (var z = li; z < p.n_picks; z += WG) {
        let e = ids[z];
        if (e < p.n_expert) {
            let turn = atomicAdd(&count[e], 1u);
            if (place) {
                order[first_slot[e] + turn] = z;
            }
        }
    }
}

@compute @workgroup_size(256)
fn group_picks(@builtin(local_invocation_index) li: u32) {
    take_turns(li, false);
    workgroupBarrier();
    if (li == 0u) {
        var slot = 0u;
        var tile = 0u;
        for (var e = 0u; e < p.n_expert; e++) {
            let c = atomicLoad(&count[e]);
            first_slot[e] = slot;
            first_tile[e] = tile;
            slot += c;
            tile += (c + TILE - 1u) / TILE;
        }
        n_tiles = tile;
    }
    workgroupBarrier();
    for (var e = li; e < p.n_expert; e += WG) {
        let c = atomicLoad(&count[e]);
        for (var j = 0u; j * TILE < c; j++) {
            let g = 3u * (first_tile[e] + j);
            tiles[g] = e;
            tiles[g + 1u] = first_slot[e] + j * TILE;
            tiles[g + 2u] = min(TILE, c - j * TILE);
        }
    }
    for (var g = n_tiles + li; g < p.max_tiles; g += WG) {
        tiles[3u * g] = NONE;
        tiles[3u * g + 1u] = 0u;
        tiles[3u * g + 2u] = 0u;
    }
    // The tiles read the counts: they are taken again, for the places, only after.
    workgroupBarrier();
    take_turns(li, true);
}
