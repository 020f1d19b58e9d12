//! Subgroup reductions, where the adapter has them (`shaders/subgroup.wgsl`), with the workgroup-memory trees as
//! the fallback (`shaders/subgroup_off.wgsl`).
//!
//! A decode step is mostly small dispatches whose last act is a reduction: a mat-vec's 32 lanes of a row, a norm's
//! 256 threads, attention's maxima and sums. In workgroup memory each is a tree of a barrier a level (6 for 32
//! lanes, 8 for 256 threads); across 32-wide subgroups it is shuffles and at most two barriers. The shaders that
//! reduce take `SG` (the adapter's least subgroup size, 0 without subgroups) and `run_sum` / `run_max` over `Red`
//! (f32, or attention's vec4 of rows), from one of the two snippets [`head`] picks, so one WGSL text holds both
//! paths and the tests run both on lavapipe (subgroups of 8).
//!
//! The shuffles take a run of `w ≤ SG` threads to be aligned consecutive invocations of one subgroup. WGSL does not
//! promise that of a 1-D workgroup, so [`probe`] checks it at load on every workgroup size the reducing shaders
//! use, and an adapter where it fails keeps the trees.

use super::{Gpu, Pass, module, wgsl};
use anyhow::{Result, ensure};

/// `BATON_GPU_SUBGROUPS=0` keeps the workgroup-memory reductions on an adapter that has subgroups (to measure
/// what the subgroups give).
fn allowed() -> bool {
    std::env::var("BATON_GPU_SUBGROUPS").map_or(true, |v| v.trim() != "0")
}

/// The subgroup size the shaders may count on (`SG`): the adapter's least, where it has subgroups, the size is a
/// power of two from 2 on, and `BATON_GPU_SUBGROUPS` allows; else 0. At most 64, the smallest reducing workgroup.
pub(super) fn usable_size(adapter: &wgpu::Adapter) -> u32 {
    let size = adapter.get_info().subgroup_min_size;
    if !allowed() || !adapter.features().contains(wgpu::Features::SUBGROUP) || size < 2 || !size.is_power_of_two() {
        return 0;
    }
    size.min(64)
}

/// The snippet a reducing module starts with: `Red`, the type its reductions take (`red`: `f32`, or `vec4<f32>`
/// for attention's rows), then `SG` and the shuffles where `sg > 0`, else `SG = 0` and stubs. (No
/// `enable subgroups;`: naga takes the subgroup built-ins where the device has the feature, and refuses the
/// directive.)
pub(super) fn head(sg: u32, red: &str) -> String {
    if sg == 0 {
        return format!("alias Red = {red};\n{}", wgsl::SUBGROUP_OFF);
    }
    format!("alias Red = {red};\nconst SG: u32 = {sg}u;\n{}", wgsl::SUBGROUP)
}

/// The probe: each thread of a workgroup of 64 and of 256 asks its shuffle partners at every distance below `SG`
/// for their index, and counts those that are not `index ^ distance` (`p.one` = 1: a binding the layout keeps).
const PROBE: &str = "
struct Params { one: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> bad: array<atomic<u32>>;

fn check(li: u32, n: u32) {
    for (var m = min(SG, n) / 2u; m > 0u; m = m / 2u) {
        if (subgroupShuffleXor(li, m) != (li ^ m)) {
            atomicAdd(&bad[0], p.one);
        }
    }
}

@compute @workgroup_size(64)
fn probe64(@builtin(local_invocation_index) li: u32) {
    check(li, 64u);
}

@compute @workgroup_size(256)
fn probe256(@builtin(local_invocation_index) li: u32) {
    check(li, 256u);
}
";

/// Whether runs of consecutive threads are subgroups' aligned runs on `gpu` at its `SG` (see the module's doc):
/// the probe run on a few workgroups of each size.
pub(super) fn probe(gpu: &Gpu) -> Result<bool> {
    let sg = gpu.subgroup();
    ensure!(sg > 0, "probing subgroups on an adapter without them");
    let bad = gpu.upload_u32(&[0])?;
    let mut pass = gpu.pass();
    for entry in ["probe64", "probe256"] {
        let pipeline = gpu.pipeline("subgroup_probe", entry, &[], || module(&[&head(sg, "f32"), PROBE]))?;
        pass.dispatch(&pipeline, &[1], &[(1, &bad.buf)], (8, 1, 1));
    }
    pass.read_u32(&bad, 0, 1)?;
    let bytes = pass.finish_read()?;
    let count = u32::from_le_bytes(bytes[0][..4].try_into()?);
    Ok(count == 0)
}

impl Pass<'_> {
    /// The pipeline of `entry` in a module that reduces f32 values: `source` after the subgroup snippet this pass
    /// uses, the key naming its `SG`.
    pub(super) fn reducing_pipeline(
        &self,
        key: &str,
        entry: &'static str,
        constants: &[(&str, f64)],
        source: impl FnOnce() -> String,
    ) -> Result<std::sync::Arc<wgpu::ComputePipeline>> {
        self.reducing_pipeline_of("f32", key, entry, constants, source)
    }

    /// [`Pass::reducing_pipeline`] of a module whose reductions take `red` values (`key` tells the types apart).
    pub(super) fn reducing_pipeline_of(
        &self,
        red: &str,
        key: &str,
        entry: &'static str,
        constants: &[(&str, f64)],
        source: impl FnOnce() -> String,
    ) -> Result<std::sync::Arc<wgpu::ComputePipeline>> {
        let sg = self.subgroup;
        self.gpu().pipeline(&format!("{key}/sg{sg}"), entry, constants, || {
            module(&[&head(sg, red), &source()])
        })
    }

    /// The pass with the subgroup reductions (`on`, where the adapter has them) or the workgroup-memory trees, so
    /// tests run both on one adapter.
    pub fn with_subgroups(mut self, on: bool) -> Self {
        self.subgroup = if on { self.gpu().subgroup() } else { 0 };
        self
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_gpu;

    /// lavapipe has subgroups (of 8): the tests of the reducing shaders would otherwise run one path only.
    #[test]
    fn software_adapter_has_subgroups() {
        let Some(gpu) = test_gpu() else { return };
        if gpu.is_software() && super::allowed() {
            assert!(gpu.subgroup() >= 2, "{} has no usable subgroups", gpu.describe());
        }
        if gpu.subgroup() > 0 {
            assert!(super::probe(&gpu).unwrap());
        }
    }

    #[test]
    fn head_shuffles_only_with_a_size() {
        let (off, on) = (super::head(0, "f32"), super::head(32, "vec4<f32>"));
        assert!(off.starts_with("alias Red = f32;") && off.contains("const SG: u32 = 0u;"));
        assert!(!off.contains("subgroupShuffleXor"));
        assert!(on.starts_with("alias Red = vec4<f32>;\nconst SG: u32 = 32u;") && on.contains("subgroupShuffleXor"));
    }
}
