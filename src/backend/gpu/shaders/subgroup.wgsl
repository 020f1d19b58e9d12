// Sums and maxima across a subgroup's threads by shuffles (the module starts by defining SG, the adapter's least
// subgroup size, and Red, the type reduced: f32, or vec4<f32> for attention's rows; see subgroup.rs). A run is w
// aligned threads of one subgroup (w a power of two up to SG; subgroup.rs checks at load that a subgroup holds
// consecutive threads): each thread of the run gets the same result, the butterfly adding the same two values on
// both sides at every step.

fn run_sum(v: Red, w: u32) -> Red {
    var s = v;
    for (var m = w / 2u; m > 0u; m = m / 2u) {
        s += subgroupShuffleXor(s, m);
    }
    return s;
}

fn run_max(v: Red, w: u32) -> Red {
    var s = v;
    for (var m = w / 2u; m > 0u; m = m / 2u) {
        s = max(s, subgroupShuffleXor(s, m));
    }
    return s;
}
