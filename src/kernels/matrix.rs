//! A weight matrix as the kernels see it: a storage type, a shape, and its bytes, either mapped straight from
//! the GGUF file or owned (after a load-time repack or a conversion).

use crate::gguf::{GgmlType, GgufFile, TensorInfo};
use anyhow::{Context, Result, bail};
use std::ops::Range;
use std::sync::Arc;

/// How much of a matrix [`Matrix::repack_for_kernels`] takes out of the map at a time.
pub const PIECE_BYTES: usize = 4 << 20;

/// Where a matrix's bytes live.
pub enum Bytes {
    /// A slice of the mapped model file: nothing is read until a kernel touches it.
    Mapped {
        file: Arc<GgufFile>,
        offset: usize,
        len: usize,
    },
    Owned(Vec<u8>),
    /// A part of the mapping a model's matrices share ([`Matrix::own_together`]).
    Arena {
        map: Arc<memmap2::Mmap>,
        offset: usize,
        len: usize,
    },
}

impl Bytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { file, offset, len } => &file.bytes()[*offset..*offset + *len],
            Bytes::Owned(v) => v,
            Bytes::Arena { map, offset, len } => &map[*offset..*offset + *len],
        }
    }
}

/// How a matrix's rows are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Row-major, each row `ty.row_bytes(cols)` bytes: the file's layout.
    Rows,
    /// Q4_1, Q5_0, Q8_0, Q4_K or Q6_K in groups of 16 interleaved rows (see [`super::x16`], [`super::x16k`],
    /// [`super::x16q6k`]), rows past the last group row-major.
    X16,
}

/// `rows` rows of `cols` weights each, row-major (see [`Layout`]), each row `ty.row_bytes(cols)` bytes.
pub struct Matrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: Bytes,
    pub layout: Layout,
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
            layout: Layout::Rows,
        })
    }

    /// Rows `r` of a row-major matrix as a matrix of its own, sharing the mapped bytes: the parts of a fused tensor
    /// (Phi-3's Q/K/V and gate/up projections), which then load, repack and multiply as separate matrices.
    pub fn row_range(&self, r: Range<usize>) -> Result<Matrix> {
        let rb = self.row_bytes();
        if self.layout != Layout::Rows || r.start > r.end || r.end > self.rows {
            bail!("rows {r:?} of a {}-row {:?} matrix", self.rows, self.layout);
        }
        let (start, len) = (r.start * rb, r.len() * rb);
        let data = match &self.data {
            Bytes::Mapped { file, offset, .. } => Bytes::Mapped {
                file: file.clone(),
                offset: offset + start,
                len,
            },
            Bytes::Arena { map, offset, .. } => Bytes::Arena {
                map: map.clone(),
                offset: offset + start,
                len,
            },
            Bytes::Owned(v) => Bytes::Owned(v[start..start + len].to_vec()),
        };
        Ok(Matrix {
            rows: r.len(),
            data,
            ..*self
        })
    }

    /// Whether [`Matrix::repack_for_kernels`] rearranges this matrix: the fastest kernel of this CPU wants another
    /// layout for its type (Q4_1, Q5_0, Q8_0 and Q4_K on AVX2 and AVX-512, Q6_K on AVX2: [`super::interleaved::wanted`]).
    pub fn repacks(&self) -> bool {
        self.layout == Layout::Rows && super::interleaved::wanted(self.ty) && self.rows >= super::interleaved::ROWS
    }

    /// Rearranges the weights for the fastest kernel this CPU has where it wants another layout ([`Matrix::repacks`]).
    /// Such a matrix no longer gives out rows (`row`, embedding lookups): repack only matrices that are multiplied.
    /// The mapped pages it leaves are dropped from memory.
    pub fn repack_for_kernels(&mut self) {
        if self.repacks() {
            self.make_owned(true);
        }
    }

    /// Copies a mapped matrix into owned memory and drops its file pages. A model with repacked matrices does this
    /// to the others it multiplies: Linux (6.18 on ext4) maps a whole large page-cache folio on a fault, so a matrix
    /// read in place brings back the file pages of the repacked matrices around it. Gemma 3's Q6_K matrices pulled
    /// in 8 MiB of their repacked neighbours, and how much varied from run to run with the page cache.
    pub fn copy_out_of_map(&mut self) {
        if matches!(self.data, Bytes::Mapped { .. }) {
            self.make_owned(false);
        }
    }

    /// The matrix in owned memory, interleaved or as it is (see [`Matrix::write_owned`]).
    fn make_owned(&mut self, interleave: bool) {
        let Some(len) = self.owned_len(interleave) else {
            return;
        };
        let mut owned = vec![0u8; len];
        self.write_owned(interleave, &mut owned);
        self.own(Bytes::Owned(owned), interleave);
    }

    /// Repacks ([`Matrix::repacks`]) or copies out of the map every matrix of `ms` that [`Matrix::repack_for_kernels`]
    /// or [`Matrix::copy_out_of_map`] would, into one anonymous mapping the matrices then share, asked to be backed by
    /// 2 MiB pages; `done` is called after each matrix (a progress bar). Decode reads every weight once a token; with
    /// 4 KiB pages each 4 KiB of it is a TLB miss, and Debian's default gives huge pages only on request (`madvise`).
    /// Decode on Zen 3 gained 4–14% from it (docs/performance.md). Matrices already owned are left as they are.
    pub fn own_together(ms: &mut [&mut Matrix], mut done: impl FnMut()) -> Result<()> {
        // Each matrix's place in the mapping: whether it is interleaved, and its bytes (empty: it stays as it is).
        let mut total = 0;
        let plan: Vec<(bool, std::ops::Range<usize>)> = ms
            .iter()
            .map(|m| {
                let interleave = m.repacks();
                let moves = interleave || matches!(m.data, Bytes::Mapped { .. });
                let len = if moves { m.owned_len(interleave).unwrap_or(0) } else { 0 };
                total += len;
                (interleave, total - len..total)
            })
            .collect();
        if total == 0 {
            return Ok(());
        }
        let mut map = memmap2::MmapMut::map_anon(total)
            .with_context(|| format!("cannot allocate {} MiB for the weights", total >> 20))?;
        #[cfg(target_os = "linux")]
        if let Err(e) = map.advise(memmap2::Advice::HugePage) {
            tracing::debug!("no transparent huge pages for the weights: {e}");
        }
        for (m, (interleave, at)) in ms.iter().zip(&plan) {
            if !at.is_empty() {
                m.write_owned(*interleave, &mut map[at.clone()]);
            }
            done();
        }
        let arena = Arc::new(map.make_read_only().context("cannot protect the weights")?);
        for (m, (interleave, at)) in ms.iter_mut().zip(plan) {
            if !at.is_empty() {
                let (offset, len) = (at.start, at.len());
                m.own(
                    Bytes::Arena {
                        map: arena.clone(),
                        offset,
                        len,
                    },
                    interleave,
                );
            }
        }
        Ok(())
    }

    /// Bytes of this matrix in owned memory, interleaved or as it is; `None` for an empty one.
    fn owned_len(&self, interleave: bool) -> Option<usize> {
        let (rb, nb) = (self.row_bytes(), self.cols / self.ty.block_size());
        if rb == 0 || self.rows == 0 {
            return None;
        }
        Some(if interleave {
            super::interleaved::packed_len(self.ty, self.rows, nb)
        } else {
            self.rows * rb
        })
    }

    /// Writes the matrix, interleaved or as it is, into `out` ([`Matrix::owned_len`] bytes). The work goes
    /// [`PIECE_BYTES`] at a time, each piece's file pages dropped as soon as it is done: a matrix held twice, mapped
    /// and owned, would add its whole size to the peak memory of loading (170 MiB for Gemma 3's embedding table, which
    /// is also its output head).
    fn write_owned(&self, interleave: bool, out: &mut [u8]) {
        let (rb, nb) = (self.row_bytes(), self.cols / self.ty.block_size());
        // Whole groups of interleaved rows, so that the pieces' layouts join into the matrix's.
        let piece = (PIECE_BYTES / rb)
            .next_multiple_of(super::interleaved::ROWS)
            .max(super::interleaved::ROWS);
        let mut at = 0;
        for r0 in (0..self.rows).step_by(piece) {
            let r1 = (r0 + piece).min(self.rows);
            let src = &self.bytes()[r0 * rb..r1 * rb];
            let n = if interleave {
                let packed = super::interleaved::repack(self.ty, src, r1 - r0, nb);
                out[at..at + packed.len()].copy_from_slice(&packed);
                packed.len()
            } else {
                out[at..at + src.len()].copy_from_slice(src);
                src.len()
            };
            at += n;
            if let Bytes::Mapped { file, offset, .. } = &self.data {
                file.release(offset + r0 * rb, (r1 - r0) * rb);
            }
        }
        assert_eq!(at, out.len(), "{} repacked to an unexpected length", self.ty);
        if let Bytes::Mapped { file, offset, len } = &self.data {
            // The pages the pieces shared.
            file.release(*offset, *len);
        }
    }

    fn own(&mut self, data: Bytes, interleaved: bool) {
        self.data = data;
        if interleaved {
            self.layout = Layout::X16;
        }
    }

    pub fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols).expect("row length checked at load")
    }

    /// The raw bytes of row `r` (row-major matrices only).
    pub fn row(&self, r: usize) -> &[u8] {
        assert_eq!(
            self.layout,
            Layout::Rows,
            "rows of a repacked matrix are not contiguous"
        );
        let rb = self.row_bytes();
        &self.bytes()[r * rb..(r + 1) * rb]
    }

    /// Row `r` dequantized into `out` (`out.len() == cols`): the embedding lookup.
    pub fn dequantize_row_into(&self, r: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        let grouped = self.rows / super::interleaved::ROWS * super::interleaved::ROWS;
        if self.layout == Layout::X16 && r < grouped {
            // Gather the row's blocks out of its group, one at a time (the lookup of a tied output head's rows).
            let bs = self.ty.block_size();
            let nb = self.cols / bs;
            let gbb = super::interleaved::group_block(self.ty);
            let g = &self.bytes()[(r / super::interleaved::ROWS) * nb * gbb..];
            let mut blk = [0u8; super::interleaved::MAX_BLOCK];
            for (b, o) in out.chunks_exact_mut(bs).enumerate() {
                let n = super::interleaved::unpack_block_into(
                    self.ty,
                    &g[b * gbb..],
                    r % super::interleaved::ROWS,
                    &mut blk,
                );
                super::dequantize_row(self.ty, &blk[..n], o);
            }
            return;
        }
        let off = if self.layout == Layout::X16 {
            self.interleaved_tail_offset(r)
        } else {
            r * rb
        };
        super::dequantize_row(self.ty, &self.bytes()[off..off + rb], out);
    }

    /// Where row `r` (one past the last whole group) starts in an interleaved matrix: the rows that do not fill a
    /// group follow the groups row-major, and a group may take more bytes than its 16 rows did (Q4_K).
    pub fn interleaved_tail_offset(&self, r: usize) -> usize {
        let groups = self.rows / super::interleaved::ROWS;
        debug_assert!(r >= groups * super::interleaved::ROWS);
        let nb = self.cols / self.ty.block_size();
        groups * nb * super::interleaved::group_block(self.ty)
            + (r - groups * super::interleaved::ROWS) * self.row_bytes()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufWriter;

    /// Repacking in pieces gives the bytes of one whole repack, and copying gives the file's bytes, for matrices of
    /// several pieces with ragged ends; an empty matrix is left as it is.
    #[test]
    fn repack_in_pieces_matches_the_whole() {
        if !super::super::interleaved::available() {
            eprintln!("SKIPPED: this CPU's kernels use the weights in place");
            return;
        }
        let cols = 1024;
        let mut rng = 7u32;
        let mut bytes = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    rng = rng.wrapping_mul(1664525).wrapping_add(1013904223);
                    // Keep every f16 scale finite: bits 10-14 of a byte pair never all set.
                    (rng >> 24) as u8 & 0x3f
                })
                .collect()
        };
        let cases = [
            (GgmlType::Q8_0, true),
            (GgmlType::Q4K, true),
            (GgmlType::Q6K, super::super::interleaved::wanted(GgmlType::Q6K)),
            (GgmlType::Q5K, false),
        ];
        let mut w = GgufWriter::new();
        let mut datas = Vec::new();
        for (i, &(ty, _)) in cases.iter().enumerate() {
            let rb = ty.row_bytes(cols).unwrap();
            let rows = 2 * (PIECE_BYTES / rb).next_multiple_of(super::super::interleaved::ROWS) + 21;
            let data = bytes(rows * rb);
            w.tensor(&format!("m{i}"), vec![cols as u64, rows as u64], ty, data.clone());
            datas.push((rows, data));
        }
        w.tensor("empty", vec![0, 32], GgmlType::F32, Vec::new());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        w.write(&path).unwrap();
        let file = Arc::new(GgufFile::open(&path).unwrap());
        for (i, &(ty, interleaved)) in cases.iter().enumerate() {
            let mut m = Matrix::mapped(&file, file.tensor_info(&format!("m{i}")).unwrap()).unwrap();
            assert_eq!(m.repacks(), interleaved, "{ty}");
            m.repack_for_kernels();
            m.copy_out_of_map();
            let (rows, data) = &datas[i];
            assert!(matches!(m.data, Bytes::Owned(_)), "{ty} still mapped");
            if interleaved {
                assert_eq!(m.layout, Layout::X16);
                let whole = super::super::interleaved::repack(ty, data, *rows, cols / ty.block_size());
                assert!(m.bytes() == &whole[..], "{ty}: pieces differ from one repack");
            } else {
                assert_eq!(m.layout, Layout::Rows);
                assert!(m.bytes() == &data[..], "{ty}: copy differs from the file");
            }
        }
        let mut empty = Matrix::mapped(&file, file.tensor_info("empty").unwrap()).unwrap();
        empty.repack_for_kernels();
        empty.copy_out_of_map();
        assert!(empty.bytes().is_empty());

        // All of them at once in one shared mapping (a model's load): the same bytes, each in its own part.
        let mut ms: Vec<Matrix> = (0..cases.len())
            .map(|i| Matrix::mapped(&file, file.tensor_info(&format!("m{i}")).unwrap()).unwrap())
            .chain([Matrix::mapped(&file, file.tensor_info("empty").unwrap()).unwrap()])
            .collect();
        Matrix::own_together(&mut ms.iter_mut().collect::<Vec<_>>(), || {}).unwrap();
        for (i, &(ty, interleaved)) in cases.iter().enumerate() {
            let (rows, data) = &datas[i];
            assert!(
                matches!(ms[i].data, Bytes::Arena { .. }),
                "{ty} not in the shared mapping"
            );
            let want = if interleaved {
                super::super::interleaved::repack(ty, data, *rows, cols / ty.block_size())
            } else {
                data.clone()
            };
            assert!(ms[i].bytes() == &want[..], "{ty}: shared mapping differs");
        }
        assert!(ms[cases.len()].bytes().is_empty());
    }
}
