//! Link settings only: Baton builds no code here.

fn main() {
    // Relative relocations packed (DT_RELR): a position-independent `baton` carries ~28,000 of them, 670 KiB of
    // `.rela.dyn` that the loader reads at every start and that stays resident; packed they take 8 KiB, and the
    // SmolLM2 bench's peak RSS drops by about 0.35 MiB (docs/performance.md). GNU ld (2.38+) packs them only where
    // the C library it links against can apply them (glibc 2.36+); x86-64 only, where ld has had it longest.
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    if env("CARGO_CFG_TARGET_OS") == "linux"
        && env("CARGO_CFG_TARGET_ENV") == "gnu"
        && env("CARGO_CFG_TARGET_ARCH") == "x86_64"
    {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
