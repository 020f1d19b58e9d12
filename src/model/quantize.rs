//! `baton quantize`: rewrites a GGUF model with its weight matrices in another storage type (metadata, norms and
//! vectors unchanged). Converting a Q4_1 model to F16 or Q8_0 gives a same-vocabulary target for speculative decoding
//! whose weights are the dequantized originals.

use crate::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use crate::kernels::{self, Matrix, blocks32};
use anyhow::{Result, bail};
use std::path::Path;
use std::sync::Arc;

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
        other => bail!("cannot quantize to {other:?} (f32, f16, q8_0, q5_0, q5_1, q4_0, q4_1)"),
    })
}

fn encode_row(x: &[f32], ty: GgmlType, out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + ty.row_bytes(x.len()).expect("row length checked"), 0);
    let dst = &mut out[start..];
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
        _ => unreachable!("parse_target admits only the types above"),
    }
}

/// Writes `input` to `output` with every 2-D weight matrix stored as `target`. Returns (tensors converted, bytes).
pub fn quantize_file(
    input: &Path,
    output: &Path,
    target: GgmlType,
    mut progress: impl FnMut(usize, usize),
) -> Result<(usize, usize)> {
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
        _ => 0,
    };
    w.meta("general.file_type", Value::U32(file_type));
    let mut converted = 0;
    let n = file.tensor_order.len();
    for (i, name) in file.tensor_order.iter().enumerate() {
        let info = &file.tensors[name];
        let is_matrix = info.dims.len() == 2 && info.dims[1] > 1;
        let fits = target.row_bytes(info.ne0()).is_some();
        if is_matrix && fits && info.ty != target {
            let m = Matrix::mapped(&file, info)?;
            let mut row = vec![0.0f32; m.cols];
            let mut data = Vec::with_capacity(target.row_bytes(m.cols).unwrap() * m.rows);
            for r in 0..m.rows {
                kernels::dequantize_row(m.ty, m.row(r), &mut row);
                encode_row(&row, target, &mut data);
            }
            w.tensor(name, info.dims.clone(), target, data);
            converted += 1;
        } else {
            w.tensor(name, info.dims.clone(), info.ty, file.tensor_data(info).to_vec());
        }
        progress(i + 1, n);
    }
    let bytes = w.to_bytes();
    crate::util::write_atomic(output, &bytes)?;
    Ok((converted, bytes.len()))
}
