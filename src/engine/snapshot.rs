//! KV snapshots: any layer range and position range of a session's cache, in a versioned, backend-neutral file
//! (safetensors with a metadata header; see docs/kv-format.md). The same encoding carries KV on the wire.
//!
//! Per layer `il`, tensors `k.{il}` `[n_head_kv, n_pos, head_dim_k]` and `v.{il}` `[n_head_kv, n_pos, head_dim_v]`,
//! K after RoPE. At 8 bits, each row (one head at one position) is stored as i8 with an f32 scale in `k.{il}.scale` /
//! `v.{il}.scale` `[n_head_kv, n_pos]`. Every tensor's checksum (SHA-256 of its bytes, first 16 hex digits) is in the
//! header, so it is checked wherever the tensor sits in the file.

use super::Session;
use super::kv_cache::KvBlock;
use crate::model::Hparams;
use anyhow::{Context, Result, bail};
use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

pub const FORMAT: &str = "baton-kv";
pub const VERSION: u32 = 1;

/// Element type of f32 rows stored or sent: KV in snapshots (by name) and on the wire (by the wire's code), and
/// hidden states on the wire (`--wire-bits`, `--kv-bits`). One type, so the two can never disagree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowDtype {
    F32,
    F16,
    BF16,
    /// i8 with one f32 scale per row (absmax / 127).
    Q8,
}

impl RowDtype {
    /// From a flag or a snapshot header: 32, 16 (f16), bf16, 8 (int8 with a per-row scale), or the names.
    pub fn parse(s: &str) -> Result<RowDtype> {
        Ok(match s {
            "f32" | "32" => RowDtype::F32,
            "f16" | "16" => RowDtype::F16,
            "bf16" => RowDtype::BF16,
            "q8" | "8" => RowDtype::Q8,
            other => bail!("unknown precision {other:?} (32 or f32, 16 or f16, bf16, 8 or q8)"),
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            RowDtype::F32 => "f32",
            RowDtype::F16 => "f16",
            RowDtype::BF16 => "bf16",
            RowDtype::Q8 => "q8",
        }
    }
    /// Bytes of one row of `width` values, including the Q8 scale.
    pub fn row_bytes(self, width: usize) -> usize {
        match self {
            RowDtype::F32 => 4 * width,
            RowDtype::F16 | RowDtype::BF16 => 2 * width,
            RowDtype::Q8 => width + 4,
        }
    }
}

/// Encodes rows of `width` f32 values; for Q8 also returns one scale per row.
pub fn encode_rows(x: &[f32], width: usize, dt: RowDtype) -> (Vec<u8>, Vec<f32>) {
    match dt {
        RowDtype::F32 => (x.iter().flat_map(|v| v.to_le_bytes()).collect(), Vec::new()),
        RowDtype::F16 => (
            x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
            Vec::new(),
        ),
        RowDtype::BF16 => (
            x.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect(),
            Vec::new(),
        ),
        RowDtype::Q8 => {
            let mut out = Vec::with_capacity(x.len());
            let mut scales = Vec::with_capacity(x.len() / width);
            for row in x.chunks(width) {
                let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let scale = amax / 127.0;
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                out.extend(row.iter().map(|&v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8));
                scales.push(scale);
            }
            (out, scales)
        }
    }
}

/// Decodes rows written by [`encode_rows`] into `out` (`out.len()` values).
pub fn decode_rows(bytes: &[u8], scales: &[f32], width: usize, dt: RowDtype, out: &mut [f32]) -> Result<()> {
    let n = out.len();
    let need = match dt {
        RowDtype::F32 => n * 4,
        RowDtype::F16 | RowDtype::BF16 => n * 2,
        RowDtype::Q8 => n,
    };
    if bytes.len() != need {
        bail!("KV data is {} bytes, expected {need}", bytes.len());
    }
    match dt {
        RowDtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes(c.try_into().unwrap());
            }
        }
        RowDtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        RowDtype::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        RowDtype::Q8 => {
            if scales.len() * width != n {
                bail!("KV scales cover {} rows, data has {}", scales.len(), n / width.max(1));
            }
            for ((row, q), &s) in out.chunks_mut(width).zip(bytes.chunks(width)).zip(scales) {
                for (o, &b) in row.iter_mut().zip(q) {
                    *o = (b as i8) as f32 * s;
                }
            }
        }
    }
    Ok(())
}

pub fn checksum(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The header fields that must agree between a snapshot and the session it is restored into.
fn model_fields(hp: &Hparams, fingerprint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("fingerprint", fingerprint.to_string()),
        ("arch", hp.arch.name().to_string()),
        ("n_layer", hp.n_layer.to_string()),
        ("n_head_kv", hp.n_head_kv.to_string()),
        ("head_dim_k", hp.head_dim_k.to_string()),
        ("head_dim_v", hp.head_dim_v.to_string()),
        ("rope_type", format!("{:?}", hp.rope_type).to_lowercase()),
        ("rope_base", hp.rope_base.to_string()),
        ("rope_base_swa", hp.rope_base_swa.to_string()),
        (
            "sliding_window",
            hp.sliding_window.map_or("none".into(), |w| w.to_string()),
        ),
    ]
}

/// Serialises a block in the snapshot format (safetensors, header with the model fields and every tensor's
/// checksum).
pub fn encode_block(hp: &Hparams, fingerprint: &str, b: &KvBlock, dt: RowDtype) -> Result<Vec<u8>> {
    if b.layers.is_empty() || b.pos.is_empty() || b.k.len() != b.layers.len() || b.v.len() != b.layers.len() {
        bail!("empty or inconsistent KV block");
    }
    let mut meta: HashMap<String, String> = HashMap::new();
    meta.insert("format".into(), FORMAT.into());
    meta.insert("version".into(), VERSION.to_string());
    for (k, v) in model_fields(hp, fingerprint) {
        meta.insert(k.into(), v);
    }
    meta.insert("layer_start".into(), b.layers.start.to_string());
    meta.insert("layer_end".into(), b.layers.end.to_string());
    meta.insert("pos_start".into(), b.pos.start.to_string());
    meta.insert("pos_end".into(), b.pos.end.to_string());
    meta.insert("dtype".into(), dt.name().into());
    if let Some(toks) = &b.tokens {
        let ids: Vec<String> = toks.iter().map(|t| t.to_string()).collect();
        meta.insert("tokens".into(), ids.join(","));
    }

    let n_pos = b.pos.len();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (i, il) in b.layers.clone().enumerate() {
        for (name, hd, rows) in [("k", hp.head_dim_k, &b.k[i]), ("v", hp.head_dim_v, &b.v[i])] {
            if rows.len() != hp.n_head_kv * n_pos * hd {
                bail!(
                    "KV block tensor {name}.{il} has {} values, expected {}",
                    rows.len(),
                    hp.n_head_kv * n_pos * hd
                );
            }
            let (bytes, scales) = encode_rows(rows, hd, dt);
            let st_dtype = match dt {
                RowDtype::F32 => Dtype::F32,
                RowDtype::F16 => Dtype::F16,
                RowDtype::BF16 => Dtype::BF16,
                RowDtype::Q8 => Dtype::I8,
            };
            tensors.push((format!("{name}.{il}"), st_dtype, vec![hp.n_head_kv, n_pos, hd], bytes));
            if dt == RowDtype::Q8 {
                let sb: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
                tensors.push((format!("{name}.{il}.scale"), Dtype::F32, vec![hp.n_head_kv, n_pos], sb));
            }
        }
    }
    for (name, _, _, bytes) in &tensors {
        meta.insert(format!("checksum.{name}"), checksum(bytes));
    }
    let views = tensors
        .iter()
        .map(|(n, d, shape, b)| Ok((n.clone(), TensorView::new(*d, shape.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    Ok(safetensors::serialize(views, &Some(meta))?)
}

/// Serialises layers `layers` and positions `pos` of the session's cache.
pub fn save_bytes(s: &Session, layers: Range<usize>, pos: Range<usize>, dt: RowDtype) -> Result<Vec<u8>> {
    let kv = s.kv();
    if layers.start < kv.layers.start || layers.end > kv.layers.end || layers.is_empty() {
        bail!(
            "layers {layers:?} are not all held by this session (it holds {:?})",
            kv.layers
        );
    }
    if pos.end > s.n_past() || pos.is_empty() {
        bail!(
            "positions {pos:?} are not all held (the session holds 0..{})",
            s.n_past()
        );
    }
    let mut block = KvBlock::from_cache(kv, layers, pos.clone());
    let toks = s.tokens();
    if toks.len() >= pos.end {
        block.tokens = Some(toks[pos].to_vec());
    }
    encode_block(&s.model().hp, s.model().fingerprint()?, &block, dt)
}

pub fn save(s: &Session, path: &Path, layers: Range<usize>, pos: Range<usize>, dt: RowDtype) -> Result<()> {
    let bytes = save_bytes(s, layers, pos, dt)?;
    crate::util::write_atomic(path, &bytes)
}

/// What a snapshot holds, from its header.
#[derive(Debug, Clone)]
pub struct SnapshotInfo {
    pub layers: Range<usize>,
    pub pos: Range<usize>,
    pub dtype: RowDtype,
    pub tokens: Option<Vec<u32>>,
}

/// Parses a snapshot-format buffer: every header field must match the model (`hp`, `fingerprint`), every tensor its
/// shape and checksum; positions must end within `n_ctx`. Returns the decoded block and its element type. Nothing is
/// trusted before every check passed.
pub fn decode_block(hp: &Hparams, fingerprint: &str, n_ctx: usize, bytes: &[u8]) -> Result<(KvBlock, RowDtype)> {
    let (_, header) = SafeTensors::read_metadata(bytes).context("not a safetensors KV snapshot")?;
    let meta = header.metadata().clone().unwrap_or_default();
    let get = |k: &str| {
        meta.get(k)
            .map(String::as_str)
            .with_context(|| format!("snapshot header lacks {k:?}"))
    };
    let num = |k: &str| -> Result<usize> {
        get(k)?
            .parse()
            .with_context(|| format!("snapshot field {k} is not a number"))
    };
    if get("format")? != FORMAT {
        bail!("not a Baton KV snapshot (format {:?})", get("format")?);
    }
    let version: u32 = get("version")?.parse().context("bad snapshot version")?;
    if version > VERSION {
        bail!("snapshot format version {version} is newer than this Baton reads ({VERSION}); upgrade Baton");
    }
    for (k, mine) in model_fields(hp, fingerprint) {
        let theirs = get(k)?;
        if theirs != mine {
            bail!("snapshot is from another model: {k} is {theirs} in the snapshot, {mine} in this session's model");
        }
    }
    let layers = num("layer_start")?..num("layer_end")?;
    if layers.is_empty() || layers.end > hp.n_layer {
        bail!(
            "snapshot layers {layers:?} are outside the model's {} layers",
            hp.n_layer
        );
    }
    let pos = num("pos_start")?..num("pos_end")?;
    if pos.is_empty() || pos.end > n_ctx {
        bail!(
            "snapshot positions {}..{} do not fit a context of {n_ctx}",
            pos.start,
            pos.end
        );
    }
    let dt = RowDtype::parse(get("dtype")?)?;
    let tokens = match meta.get("tokens") {
        Some(t) if !t.is_empty() => {
            let t = t
                .split(',')
                .map(|x| x.parse::<u32>())
                .collect::<Result<Vec<_>, _>>()
                .context("bad token list in snapshot")?;
            if t.len() != pos.len() {
                bail!("snapshot token list has {} ids for {} positions", t.len(), pos.len());
            }
            Some(t)
        }
        _ => None,
    };
    let st = SafeTensors::deserialize(bytes).context("corrupt snapshot")?;
    let n_pos = pos.len();
    let mut block = KvBlock {
        layers: layers.clone(),
        pos,
        k: Vec::new(),
        v: Vec::new(),
        tokens,
    };
    for il in layers {
        for (name, hd) in [("k", hp.head_dim_k), ("v", hp.head_dim_v)] {
            let tname = format!("{name}.{il}");
            let t = st
                .tensor(&tname)
                .with_context(|| format!("snapshot lacks tensor {tname}"))?;
            if t.shape() != [hp.n_head_kv, n_pos, hd] {
                bail!(
                    "snapshot tensor {tname} has shape {:?}, expected {:?}",
                    t.shape(),
                    [hp.n_head_kv, n_pos, hd]
                );
            }
            if checksum(t.data()) != get(&format!("checksum.{tname}"))? {
                bail!("snapshot tensor {tname} fails its checksum: the data is corrupt");
            }
            let scales: Vec<f32> = if dt == RowDtype::Q8 {
                let sname = format!("{tname}.scale");
                let st_ = st
                    .tensor(&sname)
                    .with_context(|| format!("snapshot lacks tensor {sname}"))?;
                if checksum(st_.data()) != get(&format!("checksum.{sname}"))? {
                    bail!("snapshot tensor {sname} fails its checksum: the data is corrupt");
                }
                st_.data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect()
            } else {
                Vec::new()
            };
            let mut rows = vec![0.0f32; hp.n_head_kv * n_pos * hd];
            decode_rows(t.data(), &scales, hd, dt, &mut rows).with_context(|| format!("snapshot tensor {tname}"))?;
            if name == "k" {
                block.k.push(rows);
            } else {
                block.v.push(rows);
            }
        }
    }
    Ok((block, dt))
}

/// Restores a snapshot into the session: every header field must match the session's model and layer range, its
/// positions must start at or before the session's `n_past()` (the rest of the session is rewound to its end), and
/// every checksum must hold. Nothing in the session changes unless all checks pass.
pub fn restore_bytes(s: &mut Session, bytes: &[u8]) -> Result<SnapshotInfo> {
    let (block, dt) = decode_for(s, bytes)?;
    apply(s, &block)?;
    Ok(SnapshotInfo {
        layers: block.layers,
        pos: block.pos,
        dtype: dt,
        tokens: block.tokens,
    })
}

/// The checks of [`restore_bytes`] without touching the session: the decoded block fits this session (its model,
/// its layer range, positions starting at or before `n_past()`), so a caller can check more (the disk cache: the
/// token ids) before [`apply`].
pub fn decode_for(s: &Session, bytes: &[u8]) -> Result<(KvBlock, RowDtype)> {
    let hp = &s.model().hp;
    let fp = s.model().fingerprint()?;
    let (block, dt) = decode_block(hp, fp, s.n_ctx(), bytes)?;
    let (layers, pos) = (&block.layers, &block.pos);
    if *layers != s.kv().layers {
        bail!(
            "snapshot holds layers {}..{}, this session holds {}..{}",
            layers.start,
            layers.end,
            s.kv().layers.start,
            s.kv().layers.end
        );
    }
    if pos.start > s.n_past() {
        bail!(
            "snapshot positions {}..{} cannot follow the session's {} positions (context {})",
            pos.start,
            pos.end,
            s.n_past(),
            s.n_ctx()
        );
    }
    Ok((block, dt))
}

/// Writes a block checked by [`decode_for`] into the session: rewinds it to the block's first position, then holds
/// the block's positions (with their token ids when the block and the session both know them).
pub fn apply(s: &mut Session, block: &KvBlock) -> Result<()> {
    let pos = &block.pos;
    s.rewind(pos.start);
    let mut toks = s.tokens()[..s.tokens().len().min(pos.start)].to_vec();
    match &block.tokens {
        Some(t) if toks.len() == pos.start => toks.extend_from_slice(t),
        _ => toks.clear(),
    }
    s.import_kv(block)?;
    s.hold_positions(pos.end, &toks)
}

pub fn restore(s: &mut Session, path: &Path) -> Result<SnapshotInfo> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read snapshot {}", path.display()))?;
    restore_bytes(s, &bytes).with_context(|| format!("cannot restore {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codecs_round_trip_within_their_precision() {
        let x: Vec<f32> = (0..256).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        for (dt, tol) in [
            (RowDtype::F32, 0.0),
            (RowDtype::F16, 2e-3),
            (RowDtype::BF16, 2e-2),
            (RowDtype::Q8, 3.0 / 127.0),
        ] {
            let (b, s) = encode_rows(&x, 64, dt);
            let mut y = vec![0.0; x.len()];
            decode_rows(&b, &s, 64, dt, &mut y).unwrap();
            let err = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(err <= tol, "{dt:?}: max error {err}");
        }
    }

    #[test]
    fn decode_refuses_wrong_lengths() {
        let mut y = vec![0.0; 8];
        assert!(decode_rows(&[0; 31], &[], 8, RowDtype::F32, &mut y).is_err());
        assert!(decode_rows(&[0; 8], &[1.0], 4, RowDtype::Q8, &mut y).is_err());
    }
}
