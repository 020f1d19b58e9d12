//! `baton quantize`: rewrites a GGUF model with its weight matrices in another storage type (metadata, norms and
//! vectors unchanged). Converting a Q4_1 model to F16 or Q8_0 gives a same-vocabulary target for speculative decoding
//! whose weights are the dequantized originals.

use crate::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use crate::kernels::{self, Matrix, blocks32, iquants, kquants};
use anyhow::{Result, bail};
use std::path::Path;
use std::sync::Arc;

/// What `baton quantize --type` takes.
pub const TARGETS: &str = "f32, f16, q8_0, q5_0, q5_1, q4_0, q4_1, q4_k, iq4_nl, iq4_xs";

/// The type a matrix whose rows are not whole 256-weight super-blocks gets instead (SmolLM2's 576 and Gemma 3's 640
/// columns are not), as llama.cpp falls back.
pub fn fallback(target: GgmlType) -> GgmlType {
    match target {
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::IQ4XS => GgmlType::IQ4NL,
        t => t,
    }
}

/// Storage types `quantize` can write.
pub fn parse_target(s: &str) -> Result<GgmlType> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "f32" => GgmlType::F32,
        "f16" => GgmlType::F16,
        "q8_0" => GgmlType::Q8_0,
        "q5_0" => GgmlType::Q5_0,
        "q5_1" => GgmlType::Q5_1,
        "q4_0" => GgmlType::Q4_0,
        "q4_1" => GgmlType::Q4_1,
        "q4_k" => GgmlType::Q4K,
        "iq4_nl" => GgmlType::IQ4NL,
        "iq4_xs" => GgmlType::IQ4XS,
        other => bail!("cannot quantize to {other:?} ({TARGETS})"),
    })
}

/// Encodes row `x` into `dst` (exactly one row of `ty`).
fn encode_row(x: &[f32], ty: GgmlType, dst: &mut [u8]) {
    match ty {
        GgmlType::F32 => dst.copy_from_slice(&x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()),
        GgmlType::F16 => dst.copy_from_slice(
            &x.iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect::<Vec<_>>(),
        ),
        GgmlType::Q8_0 => blocks32::quantize_row_q8_0(x, dst),
        GgmlType::Q5_0 => blocks32::quantize_row_q5_0(x, dst),
        GgmlType::Q5_1 => blocks32::quantize_row_q5_1(x, dst),
        GgmlType::Q4_0 => blocks32::quantize_row_q4_0(x, dst),
        GgmlType::Q4_1 => blocks32::quantize_row_q4_1(x, dst),
        GgmlType::Q4K => kquants::quantize_row_q4_k(x, dst),
        GgmlType::IQ4NL => iquants::quantize_row_iq4_nl(x, dst),
        GgmlType::IQ4XS => iquants::quantize_row_iq4_xs(x, dst),
        _ => unreachable!("parse_target admits only the types above"),
    }
}

/// The rows of `m` re-encoded as `ty`, on every core (the IQ4 quantizers' scale search is the slow part).
fn convert(m: &Matrix, ty: GgmlType) -> Vec<u8> {
    let rb = ty.row_bytes(m.cols).expect("row length checked");
    let mut data = vec![0u8; rb * m.rows];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = m.rows.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (i, chunk) in data.chunks_mut(per * rb).enumerate() {
            s.spawn(move || {
                let mut row = vec![0.0f32; m.cols];
                for (j, dst) in chunk.chunks_exact_mut(rb).enumerate() {
                    kernels::dequantize_row(m.ty, m.row(i * per + j), &mut row);
                    encode_row(&row, ty, dst);
                }
            });
        }
    });
    data
}

/// What [`quantize_file`] did.
#[derive(Debug)]
pub struct Report {
    /// Matrices written in the target type.
    pub converted: usize,
    /// Matrices written in [`fallback`]'s type, their rows not being whole blocks of the target.
    pub fell_back: usize,
    /// Bytes of the file written.
    pub bytes: usize,
}

/// Writes `input` to `output` with every 2-D weight matrix stored as `target` (or its [`fallback`]).
pub fn quantize_file(
    input: &Path,
    output: &Path,
    target: GgmlType,
    mut progress: impl FnMut(usize, usize),
) -> Result<Report> {
    let file = Arc::new(GgufFile::open(input)?);
    let mut w = GgufWriter::new();
    for (k, v) in &file.metadata {
        if k == "general.file_type" {
            continue;
        }
        w.meta(k, file.owned_value(v)?);
    }
    let file_type = match target {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q8_0 => 7,
        GgmlType::Q5_0 => 8,
        GgmlType::Q5_1 => 9,
        GgmlType::Q4K => 14,
        GgmlType::IQ4NL => 25,
        GgmlType::IQ4XS => 30,
        _ => 0,
    };
    w.meta("general.file_type", Value::U32(file_type));
    let (mut converted, mut fell_back) = (0, 0);
    let n = file.tensor_order.len();
    for (i, name) in file.tensor_order.iter().enumerate() {
        let info = &file.tensors[name];
        let is_matrix = info.dims.len() == 2 && info.dims[1] > 1;
        let ty = if target.row_bytes(info.ne0()).is_some() {
            Some(target)
        } else {
            Some(fallback(target)).filter(|f| f.row_bytes(info.ne0()).is_some())
        };
        if let Some(ty) = ty.filter(|&ty| is_matrix && info.ty != ty) {
            let m = Matrix::mapped(&file, info)?;
            w.tensor(name, info.dims.clone(), ty, convert(&m, ty));
            if ty == target {
                converted += 1;
            } else {
                fell_back += 1;
            }
        } else {
            w.tensor(name, info.dims.clone(), info.ty, file.tensor_data(info).to_vec());
        }
        progress(i + 1, n);
    }
    let bytes = w.to_bytes();
    crate::util::write_atomic(output, &bytes)?;
    Ok(Report {
        converted,
        fell_back,
        bytes: bytes.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Session;
    use crate::kernels::ThreadPool;
    use crate::model::Model;

    fn generated(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/models/{name}.gguf"))
    }

    fn logits(path: &Path, ids: &[u32]) -> Vec<f32> {
        let model = Arc::new(Model::load(path).unwrap());
        let mut s = Session::new(model, Arc::new(ThreadPool::new(2)), 64, 64).unwrap();
        s.eval(ids).unwrap().to_vec()
    }

    /// Q4_K, IQ4_NL and IQ4_XS files of the generated i-quant Llama (rows of 256 and 512 weights): every block matrix
    /// (and the F16 embeddings and head) converted, the file loads, and its logits stay close to the source model's;
    /// the 4-bit types' own round trips are tested beside their quantizers.
    #[test]
    fn four_bit_targets_load_and_keep_the_logits() {
        let dir = tempfile::tempdir().unwrap();
        let ids = [1u32, 300, 2000, 45, 3000, 7, 911];
        let want = logits(&generated("iquants"), &ids);
        let spread = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
        // 14 block matrices, the embeddings and the head, less the two already of the target type (copied as they are).
        for (target, converted) in [("q4_k", 16), ("iq4_nl", 14), ("iq4_xs", 14)] {
            let ty = parse_target(target).unwrap();
            let out = dir.path().join(format!("{target}.gguf"));
            let r = quantize_file(&generated("iquants"), &out, ty, |_, _| {}).unwrap();
            assert_eq!((r.converted, r.fell_back), (converted, 0), "{target}");
            let f = GgufFile::open(&out).unwrap();
            assert_eq!(f.tensors["blk.1.ffn_down.weight"].ty, ty);
            let got = logits(&out, &ids);
            let rms = (got.iter().zip(&want).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / got.len() as f32).sqrt();
            // Measured 14–17 % of the spread (the source's random sub-scales give heavy-tailed weights); a wrong
            // packing or scale moves them by about the spread itself.
            assert!(
                rms < 0.2 * spread,
                "{target}: logits moved by {rms} (rms), spread {spread}"
            );
        }
    }

    /// Rows that are not whole super-blocks (the generated llama3's 64 and 128) get the fallback type, as in
    /// llama.cpp, and the result loads.
    #[test]
    fn rows_of_partial_super_blocks_fall_back() {
        let dir = tempfile::tempdir().unwrap();
        for (target, fb) in [(GgmlType::Q4K, GgmlType::Q5_0), (GgmlType::IQ4XS, GgmlType::IQ4NL)] {
            let out = dir.path().join(format!("{target}.gguf"));
            let r = quantize_file(&generated("llama3"), &out, target, |_, _| {}).unwrap();
            assert_eq!(r.converted, 0, "{target}");
            assert_eq!(r.fell_back, 16, "{target}: 14 block matrices, embeddings, head");
            assert_eq!(GgufFile::open(&out).unwrap().tensors["blk.0.attn_q.weight"].ty, fb);
            Model::load(&out).unwrap();
        }
        assert!(parse_target("iq2_xxs").unwrap_err().to_string().contains("iq4_xs"));
    }
}
