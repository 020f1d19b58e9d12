// Without subgroups (SG = 0, see subgroup.rs) the reductions take workgroup memory only and never call these.

const SG: u32 = 0u;

fn run_sum(v: Red, w: u32) -> Red {
    return v;
}

fn run_max(v: Red, w: u32) -> Red {
    return v;
}
