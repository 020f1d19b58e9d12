// Without subgroups (SG = 0, see subgroup.rs) the reductions take workgroup memory only and never call these.

const SG: u32 = 0u;

fn run_sum(v: f32, w: u32) -> f32 {
    return v;
}

fn run_max(v: f32, w: u32) -> f32 {
    return v;
}
