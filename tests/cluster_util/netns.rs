//! Network namespaces for the cluster tests: a link between two sides (two namespaces, or the host and a namespace)
//! over a veth pair, which a test can shape with `tc`, cut and restore. Needs root and `ip`; where either is
//! missing, [`Link`]'s constructors say so and return `None` (the caller prints SKIPPED). Namespaces, and the veth
//! pairs in them, are deleted on drop, also when a test fails.

use super::NodeProc;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The shared secret of the nodes in a namespace (a node listening beyond loopback requires one).
pub const SECRET: &str = "netns test secret, long enough";

/// Writes [`SECRET`] to `dir/secret`, for `--secret-file`.
pub fn secret_file(dir: &tempfile::TempDir) -> PathBuf {
    let p = dir.path().join("secret");
    std::fs::write(&p, format!("{SECRET}\n")).unwrap();
    p
}

/// Runs `cmd` (`ip`, `tc`); `Err` names the command and carries its standard error.
pub fn run(cmd: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd[0])
        .args(&cmd[1..])
        .output()
        .map_err(|e| format!("{}: {e}", cmd.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed: {}",
            cmd.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Why namespaces cannot be built here (not root, no `ip`), or `None`.
pub fn unavailable() -> Option<String> {
    if unsafe { libc::geteuid() } != 0 {
        return Some("network namespaces need root".into());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("no `ip` command (iproute2)".into());
    }
    None
}

/// A named network namespace, deleted on drop (which deletes the veth ends in it, and so their peers).
pub struct Netns(pub String);

impl Netns {
    fn add(name: String) -> Result<Netns, String> {
        run(&["ip", "netns", "add", &name])?;
        let ns = Netns(name);
        run(&["ip", "-n", &ns.0, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// `ip [-n NAME] ARGS...`: in this namespace, or on the host for `None`.
    fn ip(ns: Option<&Netns>, args: &[&str]) -> Result<(), String> {
        let mut cmd = vec!["ip"];
        if let Some(ns) = ns {
            cmd.extend(["-n", &ns.0]);
        }
        cmd.extend_from_slice(args);
        run(&cmd)
    }

    /// `tc ARGS...` in this namespace, or on the host for `None`.
    fn tc(ns: Option<&Netns>, args: &[&str]) -> Result<(), String> {
        let mut cmd = vec![];
        if let Some(ns) = ns {
            cmd.extend(["ip", "netns", "exec", &ns.0]);
        }
        cmd.push("tc");
        cmd.extend_from_slice(args);
        run(&cmd)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.0]);
    }
}

/// Whether namespace `name` still exists.
pub fn netns_exists(name: &str) -> bool {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.split_whitespace().next() == Some(name))
}

/// Side `a` (a namespace, or the host for `None`) at 10.213.N.1 joined to namespace `b` at 10.213.N.2 by a veth
/// pair (`a_dev` on a's side).
pub struct Link {
    pub a: Option<Netns>,
    pub b: Netns,
    pub a_dev: String,
    pub b_ip: String,
}

impl Link {
    /// Two namespaces, the link shaped with `tc tbf` at `rate` both ways. `None` (after printing SKIPPED and why)
    /// where the harness cannot run.
    pub fn new(rate: &str) -> Option<Link> {
        let made = match unavailable() {
            Some(why) => Err(why),
            None => Self::between_namespaces(rate),
        };
        made.map_err(|e| eprintln!("SKIPPED: cannot build network namespaces ({e})"))
            .ok()
    }

    fn between_namespaces(rate: &str) -> Result<Link, String> {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{}x{n}", std::process::id());
        let a = Netns::add(format!("btA{tag}"))?;
        let b = Netns::add(format!("btB{tag}"))?;
        let subnet = 10 + (std::process::id() as usize * 7 + n) % 240;
        let (va, vb) = (format!("bva{tag}"), format!("bvb{tag}"));
        let (va, vb) = (&va[..va.len().min(15)], &vb[..vb.len().min(15)]);
        Netns::ip(
            Some(&a),
            &["link", "add", va, "type", "veth", "peer", "name", vb, "netns", &b.0],
        )?;
        let link = Link {
            a: Some(a),
            b,
            a_dev: va.to_string(),
            b_ip: format!("10.213.{subnet}.2"),
        };
        link.address(subnet, vb)?;
        // tbf needs a bucket of at least rate / HZ bytes; 4 MB covers 10 Gbit/s at HZ 250. A slow link gets a small
        // bucket, or its first 4 MB would pass at full speed.
        let slow = rate.ends_with("kbit")
            || rate
                .strip_suffix("mbit")
                .and_then(|r| r.parse::<u32>().ok())
                .is_some_and(|r| r < 100);
        let burst = if slow { "64kb" } else { "4mb" };
        for (ns, dev) in [(link.a.as_ref(), va), (Some(&link.b), vb)] {
            Netns::tc(
                ns,
                &[
                    "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", "20ms",
                ],
            )?;
        }
        Ok(link)
    }

    /// The host joined to a new namespace, unshaped. `Err` says why it cannot be built (not root, no `ip`, ...).
    pub fn to_host() -> Result<Link, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let b = Netns::add(format!("btH{}x{n}", std::process::id()))?;
        // The host's end is named for its subnet, so creating it claims the subnet on the host: a name (and so a
        // subnet) another test holds fails with "File exists", and the next one is tried.
        let first = std::process::id() as usize * 7 + n;
        let mut last = String::new();
        for i in 0..240 {
            let subnet = 10 + (first + i) % 240;
            let (va, vb) = (format!("bth{subnet}"), format!("btn{subnet}"));
            match run(&[
                "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb, "netns", &b.0,
            ]) {
                Ok(()) => {
                    let link = Link {
                        a: None,
                        b,
                        a_dev: va,
                        b_ip: format!("10.213.{subnet}.2"),
                    };
                    link.address(subnet, &vb)?;
                    return Ok(link);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Addresses both ends (10.213.SUBNET.1 on a's, .2 on b's) and brings them up.
    fn address(&self, subnet: usize, b_dev: &str) -> Result<(), String> {
        let a = self.a.as_ref();
        Netns::ip(
            a,
            &["addr", "add", &format!("10.213.{subnet}.1/24"), "dev", &self.a_dev],
        )?;
        Netns::ip(
            Some(&self.b),
            &["addr", "add", &format!("10.213.{subnet}.2/24"), "dev", b_dev],
        )?;
        Netns::ip(a, &["link", "set", &self.a_dev, "up"])?;
        Netns::ip(Some(&self.b), &["link", "set", b_dev, "up"])
    }

    /// The command prefix that runs a program in namespace `b` (`ip netns exec` execs in place: the child's pid is
    /// the program's).
    pub fn in_b(&self) -> [&str; 4] {
        ["ip", "netns", "exec", &self.b.0]
    }

    /// A SmolLM2 node inside namespace `b`, authenticated with [`SECRET`] (it listens off loopback).
    pub fn node(&self, secret: &Path, extra: &[&str]) -> NodeProc {
        let mut args = vec!["--secret-file", secret.to_str().unwrap()];
        args.extend_from_slice(extra);
        NodeProc::try_spawn_in(&self.in_b(), &super::smollm2(), &format!("{}:0", self.b_ip), &args)
            .unwrap_or_else(|log| panic!("node in {} failed:\n{log}", self.b.0))
    }

    /// Runs `f` on a thread that lives in side `a` (every socket it opens is there).
    pub fn in_a<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let Some(a) = &self.a else { return f() };
        let path = format!("/var/run/netns/{}", a.0);
        std::thread::scope(|s| {
            s.spawn(|| {
                let ns = std::fs::File::open(&path).unwrap();
                assert_eq!(
                    unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
                    0,
                    "setns {path}"
                );
                f()
            })
            .join()
            .unwrap()
        })
    }

    /// `ip link set A_DEV down` (`up == false`): the link is cut, its routes go, packets in flight are dropped; or
    /// back up.
    pub fn set_up(&self, up: bool) {
        let state = if up { "up" } else { "down" };
        Netns::ip(self.a.as_ref(), &["link", "set", &self.a_dev, state]).unwrap();
    }

    /// A bad link from a to b: `tc netem` delay and loss, or where the kernel has no netem, `tc tbf` at 64 kbit/s
    /// with a 100 ms queue (queueing delays packets, overflow drops them). Returns what it set.
    pub fn impair(&self) -> String {
        let netem = ["netem", "delay", "100ms", "50ms", "loss", "5%"];
        let tbf = ["tbf", "rate", "64kbit", "burst", "4kb", "latency", "100ms"];
        let mut errors = vec![];
        for q in [&netem[..], &tbf[..]] {
            let mut args = vec!["qdisc", "replace", "dev", &self.a_dev, "root"];
            args.extend_from_slice(q);
            match Netns::tc(self.a.as_ref(), &args) {
                Ok(()) => return q.join(" "),
                Err(e) => errors.push(e),
            }
        }
        panic!("cannot shape the link: {errors:?}")
    }

    /// Removes what [`Link::impair`] set.
    pub fn restore(&self) {
        Netns::tc(self.a.as_ref(), &["qdisc", "del", "dev", &self.a_dev, "root"]).unwrap();
    }
}
