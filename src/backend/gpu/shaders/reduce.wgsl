// Reductions over a whole workgroup of WG threads (a power of two, the including shader's constant), after one of
// the subgroup snippets (subgroup.rs). On a GPU whose subgroups are 32 wide a workgroup of 64 takes 2 barriers
// where a tree in workgroup memory took 7, one of 256 takes 2 where it took 9.

var<workgroup> red: array<Red, WG>;

fn combine(a: Red, b: Red, is_max: bool) -> Red {
    return select(a + b, max(a, b), is_max);
}

// The maximum (`is_max`) or the sum of x (of type Red, see subgroup.wgsl: a vector's componentwise) over the
// workgroup, for every thread: runs of w = SG threads by subgroup shuffles (subgroup.wgsl; without subgroups,
// SG = 0, each thread is its own run), halved in workgroup memory until at most 8 runs' results are left (none to
// halve where subgroups are 32 wide; Metal's least size, 4, leaves 64 runs in 256 threads), which every thread
// then combines in order. Every thread of the workgroup calls it (it holds barriers), and it ends with a barrier,
// so the next call may write `red`.
fn reduce(li: u32, x: Red, is_max: bool) -> Red {
    let w = max(min(SG, WG), 1u);
    // Every thread of a run holds the run's result, so red[i] is run(i) for every i.
    var v = x;
    if (w > 1u) {
        if (is_max) {
            v = run_max(x, w);
        } else {
            v = run_sum(x, w);
        }
    }
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s >= 8u * w; s = s / 2u) {
        if (li < s) {
            red[li] = combine(red[li], red[li + s], is_max);
        }
        workgroupBarrier();
    }
    var r = red[0];
    for (var i = w; i < min(WG, 8u * w); i += w) {
        r = combine(r, red[i], is_max);
    }
    workgroupBarrier();
    return r;
}

fn reduce_max(li: u32, x: Red) -> Red {
    return reduce(li, x, true);
}

fn reduce_sum(li: u32, x: Red) -> Red {
    return reduce(li, x, false);
}
