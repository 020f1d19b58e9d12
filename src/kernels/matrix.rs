//! A weight matrix as the kernels see it: a storage type, a shape, and its bytes, either mapped straight from
//! the GGUF file or owned (after a load-time repack or a conversion).

use crate::gguf::{GgmlType, GgufFile, TensorInfo};
use anyhow::{Result, bail};
use std::sync::Arc;

/// Where a matrix's bytes live.
pub enum Bytes {
    /// A slice of the mapped model file: nothing is read until a kernel touches it.
    Mapped {
        file: Arc<GgufFile>,
        offset: usize,
        len: usize,
    },
    Owned(Vec<u8>),
}

impl Bytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { file, offset, len } => &file.bytes()[*offset..*offset + *len],
            Bytes::Owned(v) => v,
        }
    }
}

/// `rows` rows of `cols` weights each, row-major, each row `ty.row_bytes(cols)` bytes.
pub struct Matrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: Bytes,
}

impl Matrix {
    /// A tensor of the file as a matrix: ggml's first dimension is the row length.
    pub fn mapped(file: &Arc<GgufFile>, info: &TensorInfo) -> Result<Matrix> {
        if info.dims.len() > 2 {
            bail!(
                "tensor {:?} has {} dimensions, a matrix needs at most 2",
                info.name,
                info.dims.len()
            );
        }
        Ok(Matrix {
            ty: info.ty,
            rows: info.n_rows(),
            cols: info.ne0(),
            data: Bytes::Mapped {
                file: file.clone(),
                offset: info.offset,
                len: info.size,
            },
        })
    }

    pub fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols).expect("row length checked at load")
    }

    /// The raw bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes()[r * rb..(r + 1) * rb]
    }

    /// Row `r` dequantized into `out` (`out.len() == cols`): the embedding lookup.
    pub fn dequantize_row_into(&self, r: usize, out: &mut [f32]) {
        super::dequantize_row(self.ty, self.row(r), out);
    }

    /// The whole matrix as f32 (small tensors: norms, tests).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, chunk) in out.chunks_mut(self.cols).enumerate() {
            self.dequantize_row_into(r, chunk);
        }
        out
    }

    /// Bytes a pass over this matrix reads.
    pub fn size_bytes(&self) -> usize {
        self.bytes().len()
    }
}

/// Weight types the matmul kernels compute with (Q8_1 and Q8_K only ever hold activations).
pub fn supports(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::Q8_1 | GgmlType::Q8K)
}
