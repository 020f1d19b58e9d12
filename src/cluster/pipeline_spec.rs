//! `--pipeline` specs: `ADDR=A:B,local=B:end,...`. Ranges are `A:B` with B exclusive (like `--layers`), `end`
//! meaning the last layer; together they must cover every layer exactly once. Stages run in layer order.

use anyhow::{Context, Result, bail};
use std::ops::Range;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSpec {
    /// `host:port` of a node, or `None` for a stage computed in this process (`local`).
    pub addr: Option<String>,
    pub layers: Range<usize>,
}

impl StageSpec {
    pub fn label(&self) -> String {
        match &self.addr {
            Some(a) => format!("{a} [{}:{}]", self.layers.start, self.layers.end),
            None => format!("local [{}:{}]", self.layers.start, self.layers.end),
        }
    }
}

/// Parses and checks a pipeline spec against a model of `n_layer` layers; stages come back sorted by layer.
pub fn parse_pipeline(spec: &str, n_layer: usize) -> Result<Vec<StageSpec>> {
    let mut stages = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (addr, range) = part
            .rsplit_once('=')
            .with_context(|| format!("pipeline stage {part:?} must look like HOST:PORT=A:B or local=A:B"))?;
        let layers =
            crate::model::parse_layer_range(range, n_layer).with_context(|| format!("pipeline stage {part:?}"))?;
        let addr = match addr.trim() {
            "local" => None,
            a if a.contains(':') => Some(a.to_string()),
            a => bail!("pipeline stage address {a:?} must be HOST:PORT or local"),
        };
        stages.push(StageSpec { addr, layers });
    }
    if stages.is_empty() {
        bail!("empty pipeline spec");
    }
    stages.sort_by_key(|s| (s.layers.start, s.layers.end));
    let mut count = vec![0usize; n_layer];
    for s in &stages {
        for il in s.layers.clone() {
            count[il] += 1;
        }
    }
    let missing = runs(&count, |c| c == 0);
    let doubled = runs(&count, |c| c > 1);
    if !missing.is_empty() || !doubled.is_empty() {
        let mut msg = Vec::new();
        if !missing.is_empty() {
            msg.push(format!("layers {} are not covered by any stage", missing.join(", ")));
        }
        if !doubled.is_empty() {
            msg.push(format!("layers {} are covered more than once", doubled.join(", ")));
        }
        bail!(
            "pipeline {spec:?} does not cover the model's {n_layer} layers exactly once: {} (ranges are A:B with B \
             exclusive, e.g. 0:15,15:end)",
            msg.join("; ")
        );
    }
    let locals = stages.iter().filter(|s| s.addr.is_none()).count();
    if locals > 1 {
        bail!("pipeline {spec:?} has {locals} local stages; merge them into one range");
    }
    Ok(stages)
}

/// Maximal runs of layers whose count satisfies `pred`, as "a..b" (inclusive) or "a".
fn runs(count: &[usize], pred: impl Fn(usize) -> bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < count.len() {
        if pred(count[i]) {
            let s = i;
            while i < count.len() && pred(count[i]) {
                i += 1;
            }
            out.push(if i - s == 1 {
                format!("{s}")
            } else {
                format!("{s}..={}", i - 1)
            });
        } else {
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_sorts() {
        let s = parse_pipeline("local=15:end, 10.0.0.2:7070=0:15", 30).unwrap();
        assert_eq!(
            s[0],
            StageSpec {
                addr: Some("10.0.0.2:7070".into()),
                layers: 0..15
            }
        );
        assert_eq!(
            s[1],
            StageSpec {
                addr: None,
                layers: 15..30
            }
        );
        let s = parse_pipeline("[::1]:7070=0:10,[::1]:7071=10:20,local=20:30", 30).unwrap();
        assert_eq!(s.len(), 3);
    }

    #[test]
    fn names_missing_and_doubled_layers() {
        let e = parse_pipeline("10.0.0.2:7070=0:14,local=15:end", 30)
            .unwrap_err()
            .to_string();
        assert!(e.contains("layers 14 are not covered"), "{e}");
        let e = parse_pipeline("a:1=0:20,b:2=10:end", 30).unwrap_err().to_string();
        assert!(e.contains("layers 10..=19 are covered more than once"), "{e}");
        let e = parse_pipeline("a:1=0:5,b:2=10:20", 30).unwrap_err().to_string();
        assert!(e.contains("5..=9, 20..=29"), "{e}");
        assert!(parse_pipeline("nohost=0:30", 30).is_err());
        assert!(parse_pipeline("a:1=0:31", 30).is_err());
        assert!(parse_pipeline("local=0:10,local=10:end", 30).is_err());
    }
}
