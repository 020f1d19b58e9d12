// Reductions over a whole workgroup of WG threads (a power of two, the including shader's constant), after one of
// the subgroup snippets (subgroup.rs). On a GPU whose subgroups are 32 wide a workgroup of 64 takes 2 barriers
// where the tree took 7, one of 256 takes 2 where it took 9.

var<workgroup> red: array<f32, WG>;

// The maximum (`is_max`) or the sum of x over the workgroup, for every thread: runs of SG threads by subgroup
// shuffles (subgroup.wgsl), halved in workgroup memory until at most 8 runs' results are left (none to halve where
// subgroups are 32 wide; Metal's least size, 4, leaves 64 runs in 256 threads), which every thread then combines in
// order; without subgroups (SG = 0), a tree. Every thread of the workgroup calls it (it holds barriers), and it ends
// with a barrier, so the next call may write `red`.
fn reduce(li: u32, x: f32, is_max: bool) -> f32 {
    let w = min(SG, WG);
    var r = x;
    if (w > 1u) {
        // Every thread of a run holds the run's result, so red[i] is run(i) for every i.
        if (is_max) {
            red[li] = run_max(x, w);
        } else {
            red[li] = run_sum(x, w);
        }
        workgroupBarrier();
        for (var s = WG / 2u; s >= 8u * w; s = s / 2u) {
            if (li < s) {
                if (is_max) {
                    red[li] = max(red[li], red[li + s]);
                } else {
                    red[li] += red[li + s];
                }
            }
            workgroupBarrier();
        }
        r = red[0];
        for (var i = w; i < min(WG, 8u * w); i += w) {
            if (is_max) {
                r = max(r, red[i]);
            } else {
                r += red[i];
            }
        }
    } else {
        red[li] = x;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s = s / 2u) {
            if (li < s) {
                if (is_max) {
                    red[li] = max(red[li], red[li + s]);
                } else {
                    red[li] += red[li + s];
                }
            }
            workgroupBarrier();
        }
        r = red[0];
    }
    workgroupBarrier();
    return r;
}

fn reduce_max(li: u32, x: f32) -> f32 {
    return reduce(li, x, true);
}

fn reduce_sum(li: u32, x: f32) -> f32 {
    return reduce(li, x, false);
}
