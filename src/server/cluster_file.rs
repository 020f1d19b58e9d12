//! `baton serve --cluster cluster.toml`: the nodes a server drives, their roles and the links between them.
//!
//! ```toml
//! model = "smollm2"              # optional: the model every node serves (default: --model)
//! secret_file = "cluster.key"    # optional: shared secret for nodes beyond loopback
//! wire_bits = "16"               # optional: hidden-state precision on the wire (32, 16, bf16, 8)
//! offload = "auto"               # optional, with prefill nodes: auto, never, always, or a share such as 60%
//! kv_bits = "16"                 # optional, with prefill nodes: KV precision from prefill to decode node
//! prefill_timeout = 10.0         # optional, with prefill nodes: seconds before a silent prefill node is given up
//!
//! [[node]]
//! name = "d1"
//! addr = "10.0.0.2:7070"
//! role = "decode"                # decode | prefill | stage
//! slots = 2                      # decode: sessions the router keeps on it (default: --parallel)
//!
//! [[node]]
//! name = "s1"
//! addr = "10.0.0.3:7070"         # or "local" for a stage computed in the server itself
//! role = "stage"
//! layers = "0:15"                # stage: the layer range it owns
//!
//! [[link]]
//! a = "p1"
//! b = "d1"
//! gbps = 2.5                     # optional figures for the planner
//! latency_ms = 0.3
//! ```
//!
//! Stage nodes together form one pipeline. Decode nodes each serve all layers; the router spreads requests over
//! them (`addr = "local"`: the server decodes itself). Prefill nodes serve every decode node: per request the
//! least-loaded healthy one prefills and the decode node pulls the KV (see [`super::disagg_hook`]).

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    Stage,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeEntry {
    pub name: String,
    pub addr: String,
    pub role: Role,
    pub layers: Option<String>,
    pub slots: Option<usize>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub a: String,
    pub b: String,
    pub gbps: Option<f64>,
    pub latency_ms: Option<f64>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    pub model: Option<String>,
    pub secret_file: Option<PathBuf>,
    pub wire_bits: Option<String>,
    pub offload: Option<String>,
    pub kv_bits: Option<String>,
    pub prefill_timeout: Option<f64>,
    #[serde(default, rename = "node")]
    pub nodes: Vec<NodeEntry>,
    #[serde(default, rename = "link")]
    pub links: Vec<Link>,
}

/// What the server runs, derived from the file.
#[derive(Clone, Debug, PartialEq)]
pub enum Topology {
    /// One pipeline over the stage nodes: a `--pipeline` spec.
    Pipeline(String),
    /// Decode nodes behind the router, optionally with prefill nodes.
    Decode {
        decode: Vec<NodeEntry>,
        prefill: Vec<NodeEntry>,
    },
}

impl PartialEq for NodeEntry {
    fn eq(&self, o: &Self) -> bool {
        self.name == o.name && self.addr == o.addr && self.role == o.role
    }
}

/// `baton serve --prefill-node A,B`: this server decodes (a local decode node), the listed nodes prefill.
pub fn local_decode(list: &str) -> Result<Topology> {
    let prefill: Vec<NodeEntry> = list
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(|a| NodeEntry {
            name: a.to_string(),
            addr: a.to_string(),
            role: Role::Prefill,
            layers: None,
            slots: None,
        })
        .collect();
    if prefill.is_empty() || prefill.iter().any(|p| !p.addr.contains(':')) {
        bail!("--prefill-node {list:?} must be HOST:PORT[,HOST:PORT...]");
    }
    let local = NodeEntry {
        name: "local".into(),
        addr: "local".into(),
        role: Role::Decode,
        layers: None,
        slots: None,
    };
    Ok(Topology::Decode {
        decode: vec![local],
        prefill,
    })
}

impl ClusterFile {
    pub fn load(path: &Path) -> Result<ClusterFile> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let f = ClusterFile::parse(&text).with_context(|| format!("cluster file {}", path.display()))?;
        // A relative secret file is relative to the cluster file.
        Ok(ClusterFile {
            secret_file: f.secret_file.map(|s| path.parent().unwrap_or(Path::new(".")).join(s)),
            ..f
        })
    }

    pub fn parse(text: &str) -> Result<ClusterFile> {
        let f: ClusterFile = toml::from_str(text).map_err(|e| anyhow::anyhow!("{}", e.to_string().trim()))?;
        let mut names = HashSet::new();
        for n in &f.nodes {
            if !names.insert(n.name.as_str()) {
                bail!("node name {:?} is used twice", n.name);
            }
            if n.addr != "local" && !n.addr.contains(':') {
                bail!(
                    "node {:?}: addr {:?} must be HOST:PORT (or local for a stage or a decode node)",
                    n.name,
                    n.addr
                );
            }
            if n.addr == "local" && n.role == Role::Prefill {
                bail!(
                    "node {:?}: a prefill node cannot be local (the server would prefill for itself)",
                    n.name
                );
            }
            match (n.role, &n.layers) {
                (Role::Stage, None) => bail!("stage node {:?} needs layers = \"A:B\"", n.name),
                (Role::Decode | Role::Prefill, Some(_)) => {
                    bail!(
                        "node {:?}: layers are for stages; decode and prefill nodes serve every layer",
                        n.name
                    )
                }
                _ => {}
            }
            if let Some(slots) = n.slots {
                let what = format!("node {:?}: slots", n.name);
                crate::util::count_in(&what, slots as u64, 1..=crate::util::limits::MAX_SLOTS)?;
            }
        }
        for l in &f.links {
            for (what, v) in [("gbps", l.gbps), ("latency_ms", l.latency_ms)] {
                if let Some(v) = v
                    && !(v.is_finite() && v >= 0.0)
                {
                    bail!(
                        "link {:?} - {:?}: {what} must be a finite number ≥ 0, not {v}",
                        l.a,
                        l.b
                    );
                }
            }
            for end in [&l.a, &l.b] {
                if !names.contains(end.as_str()) {
                    bail!("link {:?} - {:?} names an unknown node {end:?}", l.a, l.b);
                }
            }
        }
        Ok(f)
    }

    pub fn topology(&self) -> Result<Topology> {
        let of = |r: Role| -> Vec<NodeEntry> { self.nodes.iter().filter(|n| n.role == r).cloned().collect() };
        let (stages, decode, prefill) = (of(Role::Stage), of(Role::Decode), of(Role::Prefill));
        match (stages.is_empty(), decode.is_empty()) {
            (true, true) => bail!("the cluster file names no decode or stage node"),
            (false, false) => bail!("a cluster is either a pipeline of stages or a set of decode nodes, not both"),
            (false, true) => {
                if !prefill.is_empty() {
                    bail!("prefill nodes pair with decode nodes, not with a pipeline of stages");
                }
                let spec: Vec<String> = stages
                    .iter()
                    .map(|s| format!("{}={}", s.addr, s.layers.as_deref().unwrap_or("")))
                    .collect();
                Ok(Topology::Pipeline(spec.join(",")))
            }
            (true, false) => Ok(Topology::Decode { decode, prefill }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_cluster_with_links() {
        let f = ClusterFile::parse(
            r#"
            model = "smollm2"
            [[node]]
            name = "d1"
            addr = "127.0.0.1:7001"
            role = "decode"
            slots = 2
            [[node]]
            name = "p1"
            addr = "127.0.0.1:7002"
            role = "prefill"
            [[link]]
            a = "p1"
            b = "d1"
            gbps = 2.5
            "#,
        )
        .unwrap();
        match f.topology().unwrap() {
            Topology::Decode { decode, prefill } => {
                assert_eq!(decode.len(), 1);
                assert_eq!(decode[0].slots, Some(2));
                assert_eq!(prefill[0].name, "p1");
            }
            t => panic!("{t:?}"),
        }
    }

    #[test]
    fn stages_become_a_pipeline_spec() {
        let f = ClusterFile::parse(
            "[[node]]\nname='a'\naddr='h:1'\nrole='stage'\nlayers='0:10'\n\
             [[node]]\nname='b'\naddr='local'\nrole='stage'\nlayers='10:end'\n",
        )
        .unwrap();
        assert_eq!(
            f.topology().unwrap(),
            Topology::Pipeline("h:1=0:10,local=10:end".into())
        );
    }

    #[test]
    fn mistakes_are_named() {
        let bad = [
            ("[[node]]\nname='a'\naddr='h:1'\nrole='boss'\n", "unknown variant"),
            ("[[node]]\nname='a'\naddr='h:1'\nrole='stage'\n", "needs layers"),
            (
                "[[node]]\nname='a'\naddr='h:1'\nrole='decode'\n[[link]]\na='a'\nb='zz'\n",
                "unknown node",
            ),
            (
                "[[node]]\nname='a'\naddr='h:1'\nrole='decode'\n[[node]]\nname='a'\naddr='h:2'\nrole='decode'\n",
                "twice",
            ),
            (
                "[[node]]\nname='a'\naddr='h:1'\nrole='decode'\nport=3\n",
                "unknown field",
            ),
            ("[[node]]\nname='a'\naddr='local'\nrole='prefill'\n", "cannot be local"),
            (
                "[[node]]\nname='a'\naddr='h:1'\nrole='decode'\nslots=0\n",
                "slots must be in 1..=256",
            ),
            (
                "[[node]]\nname='a'\naddr='h:1'\nrole='decode'\nslots=100000\n",
                "slots must be in 1..=256",
            ),
            (
                "[[node]]\nname='a'\naddr='h:1'\nrole='decode'\n[[link]]\na='a'\nb='a'\ngbps=nan\n",
                "gbps must be",
            ),
        ];
        for (text, want) in bad {
            let e = ClusterFile::parse(text).map(|_| ()).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        let no_nodes = ClusterFile::parse("model='x'\n").unwrap();
        assert!(no_nodes.topology().is_err());
    }
}
