//! Device buffers: f32 activations ([`Tensor`]), f16 rows packed two to a word ([`Halves`], the KV cache), and
//! weight matrices uploaded once in their GGUF block layout ([`GpuMatrix`]).
//!
//! Shaders read every buffer as 32-bit words. GGUF blocks are any even number of bytes from 18 to 210, so blocks and
//! rows start at any even byte; a weight buffer is padded to a whole number of words (plus one) and the shaders
//! assemble bytes, halves and unaligned words from the words around them (`shaders/quant.wgsl`).

use super::device::Gpu;
use crate::gguf::GgmlType;
use crate::kernels::Matrix;
use crate::kernels::matrix::Layout;
use anyhow::{Result, bail, ensure};
use half::f16;

/// Weights a shader dequantizes at a time: one 32-weight block, or a 32-weight slice of a 256-weight super-block.
pub const UNIT: usize = 32;

/// `len` f32 values on the device. A clone is another handle to the same buffer.
#[derive(Clone)]
pub struct Tensor {
    pub(super) buf: wgpu::Buffer,
    len: usize,
}

/// `len` f16 values on the device, packed two to a `u32` (low half first, as in memory): readable by every
/// adapter through `unpack2x16float`, with or without `shader-f16`.
pub struct Halves {
    pub(super) buf: wgpu::Buffer,
    len: usize,
}

/// `len` u32 values on the device: the positions of a batch's rows.
pub struct U32s {
    pub(super) buf: wgpu::Buffer,
    len: usize,
    /// The largest value, kept from the upload so ops can check positions against their tables and caches.
    max: u32,
}

impl U32s {
    pub fn max(&self) -> u32 {
        self.max
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A weight matrix on the device, its bytes as in the file: `rows` rows of `row_bytes` bytes, in one buffer or, when
/// larger than one binding may be (128 MiB on lavapipe, less than Gemma 3's Q8_0 output head), in parts of whole
/// rows.
pub struct GpuMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub(super) parts: Vec<Part>,
}

/// A mixture of experts' 3-D tensor on the device: `n_expert` matrices of `rows` × `mat.cols`, expert e's the rows
/// `e * rows..(e + 1) * rows` of the 2-D view `mat` (split into parts of whole rows like any matrix). The indexed
/// matmuls (`Pass::matmul_ids`) pick an expert on the device.
pub struct GpuExperts {
    pub mat: GpuMatrix,
    pub n_expert: usize,
    pub rows: usize,
}

/// Rows `row0..row0 + rows` of a matrix.
pub(super) struct Part {
    pub row0: usize,
    pub rows: usize,
    pub buf: wgpu::Buffer,
}

impl Tensor {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Halves {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What every buffer a shader reads or writes, and tests read back, is created with.
const USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// The GPU types [`Gpu::upload_matrix`] takes: every weight type the CPU computes with (all but the activation
/// types Q8_1 and Q8_K).
pub fn supports(ty: GgmlType) -> bool {
    use GgmlType::*;
    !matches!(ty, Q8_1 | Q8K)
}

impl Gpu {
    /// A buffer holding `src` then zeros, `bytes` long in all (rounded up to whole words, and one word more so
    /// a shader's unaligned read of the last word stays inside; then to whole 16-byte vectors, which the matmul
    /// reads its activations as).
    fn buffer_with(&self, label: &str, bytes: usize, src: &[u8]) -> Result<wgpu::Buffer> {
        let size = (bytes.div_ceil(4) + 1).next_multiple_of(4) * 4;
        if size as u64 > self.max_binding() {
            bail!(
                "{label}: {} MiB is more than one buffer of {} may hold ({} MiB)",
                size >> 20,
                self.info().name,
                self.max_binding() >> 20
            );
        }
        // Mapped at creation: the bytes go straight into the buffer (zeroed by wgpu), with no staging copy.
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: size as u64,
            usage: USAGE,
            mapped_at_creation: true,
        });
        if !src.is_empty() {
            let mut view = buf.get_mapped_range_mut(..)?;
            view.slice(..src.len()).copy_from_slice(src);
        }
        buf.unmap();
        self.check()?;
        Ok(buf)
    }

    /// `x` on the device.
    pub fn upload(&self, x: &[f32]) -> Result<Tensor> {
        let buf = self.buffer_with("tensor", x.len() * 4, bytemuck::cast_slice(x))?;
        Ok(Tensor { buf, len: x.len() })
    }

    /// Overwrites the first `x.len()` values of `t`; ordered before the passes submitted after it.
    pub fn write(&self, t: &Tensor, x: &[f32]) -> Result<()> {
        ensure!(
            x.len() <= t.len,
            "writing {} values into a tensor of {}",
            x.len(),
            t.len
        );
        self.queue.write_buffer(&t.buf, 0, bytemuck::cast_slice(x));
        self.check()
    }

    /// `n` zeros on the device.
    pub fn zeros(&self, n: usize) -> Result<Tensor> {
        let buf = self.buffer_with("tensor", n * 4, &[])?;
        Ok(Tensor { buf, len: n })
    }

    /// `x` on the device.
    pub fn upload_u32(&self, x: &[u32]) -> Result<U32s> {
        let buf = self.buffer_with("u32", x.len() * 4, bytemuck::cast_slice(x))?;
        Ok(U32s {
            buf,
            len: x.len(),
            max: x.iter().copied().max().unwrap_or(0),
        })
    }

    /// Overwrites `u` with `x` (no longer than the buffer `u` was made with), which is then its length and
    /// largest value; ordered before the passes submitted after it. A session writes each batch's positions into
    /// one buffer this way, so the ops' bind groups that hold it stay valid.
    pub fn write_u32(&self, u: &mut U32s, x: &[u32]) -> Result<()> {
        let cap = (u.buf.size() / 4 - 1) as usize;
        ensure!(x.len() <= cap, "writing {} values into a buffer of {cap}", x.len());
        self.queue.write_buffer(&u.buf, 0, bytemuck::cast_slice(x));
        u.len = x.len();
        u.max = x.iter().copied().max().unwrap_or(0);
        self.check()
    }

    /// `x` as f16 on the device.
    pub fn upload_halves(&self, x: &[f16]) -> Result<Halves> {
        let buf = self.buffer_with("halves", x.len() * 2, bytemuck::cast_slice(&bits_of(x)))?;
        Ok(Halves { buf, len: x.len() })
    }

    /// `n` f16 zeros on the device (a KV cache).
    pub fn zero_halves(&self, n: usize) -> Result<Halves> {
        let buf = self.buffer_with("halves", n * 2, &[])?;
        Ok(Halves { buf, len: n })
    }

    /// Uploads a matrix once, its rows as the file stores them. A matrix repacked for the CPU kernels
    /// ([`Layout::X16`]) is refused: upload before repacking.
    pub fn upload_matrix(&self, m: &Matrix) -> Result<GpuMatrix> {
        self.upload_matrix_in_parts(m, self.max_binding() as usize)
    }

    /// The `n_expert` experts of `m`, a 3-D expert tensor's 2-D view (expert e's rows follow expert e - 1's).
    pub fn upload_experts(&self, m: &Matrix, n_expert: usize) -> Result<GpuExperts> {
        self.upload_experts_in_parts(m, n_expert, self.max_binding() as usize)
    }

    /// [`Gpu::upload_experts`] in parts of at most `part_bytes` bytes (tests ask for small parts).
    pub(super) fn upload_experts_in_parts(&self, m: &Matrix, n_expert: usize, part_bytes: usize) -> Result<GpuExperts> {
        ensure!(
            n_expert > 0 && m.rows.is_multiple_of(n_expert),
            "{} rows are not {n_expert} experts of equal size",
            m.rows
        );
        Ok(GpuExperts {
            mat: self.upload_matrix_in_parts(m, part_bytes)?,
            n_expert,
            rows: m.rows / n_expert,
        })
    }

    /// [`Gpu::upload_matrix`] in parts of at most `part_bytes` bytes (tests ask for small parts).
    pub(super) fn upload_matrix_in_parts(&self, m: &Matrix, part_bytes: usize) -> Result<GpuMatrix> {
        ensure!(
            supports(m.ty),
            "the GPU backend has no {} matmul (it takes every weight type but the activation types Q8_1 and Q8_K)",
            m.ty
        );
        ensure!(
            m.layout == Layout::Rows,
            "a {} matrix repacked for the CPU kernels cannot go to the GPU: upload it before repacking",
            m.ty
        );
        let row_bytes =
            m.ty.row_bytes(m.cols)
                .ok_or_else(|| anyhow::anyhow!("{} rows of {} weights are not whole blocks", m.ty, m.cols))?;
        let bytes = m.bytes();
        ensure!(
            bytes.len() == m.rows * row_bytes,
            "a {}×{} {} matrix should hold {} bytes, not {}",
            m.rows,
            m.cols,
            m.ty,
            m.rows * row_bytes,
            bytes.len()
        );
        // The shaders dequantize whole 32-weight units. Every block type's rows are whole units; a float matrix's
        // rows that are not (glm4moe's generated experts are 16 wide) are padded with zeros to the next unit, and
        // the matmuls stop at `cols`.
        let padded;
        let (bytes, row_bytes) = if m.cols.is_multiple_of(UNIT) {
            (bytes, row_bytes)
        } else {
            ensure!(
                matches!(m.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16),
                "the GPU matmul needs {} rows of a multiple of {UNIT} weights, not {}",
                m.ty,
                m.cols
            );
            let wide = m.cols.next_multiple_of(UNIT) * (row_bytes / m.cols);
            padded = bytes
                .chunks_exact(row_bytes)
                .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0, wide - row_bytes)))
                .collect::<Vec<u8>>();
            (&padded[..], wide)
        };
        ensure!(
            m.rows <= u32::MAX as usize && bytes.len() < u32::MAX as usize,
            "a {}×{} matrix is too large for 32-bit offsets",
            m.rows,
            m.cols
        );
        // Each part is padded by up to a word and one more (`buffer_with`).
        let part_rows = part_bytes.saturating_sub(8) / row_bytes.max(1);
        ensure!(
            part_rows > 0 || m.rows == 0,
            "one {} row of {} bytes is more than one GPU buffer may hold ({part_bytes} bytes)",
            m.ty,
            row_bytes
        );
        let mut parts = Vec::new();
        for row0 in (0..m.rows).step_by(part_rows.max(1)) {
            let rows = part_rows.min(m.rows - row0);
            let src = &bytes[row0 * row_bytes..(row0 + rows) * row_bytes];
            let buf = self.buffer_with(&format!("{} matrix", m.ty), src.len(), src)?;
            parts.push(Part { row0, rows, buf });
        }
        Ok(GpuMatrix {
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
            row_bytes,
            parts,
        })
    }

    /// The bytes of `buf`'s first `bytes` bytes, copied back to the host.
    fn read_bytes(&self, buf: &wgpu::Buffer, bytes: usize) -> Result<Vec<u8>> {
        let size = (bytes.div_ceil(4) * 4).max(4) as u64;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buf, 0, &staging, 0, size);
        let idx = self.queue.submit([enc.finish()]);
        self.map_read(&staging, idx, bytes)
    }

    /// The first `bytes` bytes of `staging`, once the submission `idx` that fills it is done. Only those are
    /// mapped: a session's kept buffer may be larger (`Binds`).
    pub(super) fn map_read(&self, staging: &wgpu::Buffer, idx: wgpu::SubmissionIndex, bytes: usize) -> Result<Vec<u8>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let span = (bytes as u64).next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT).max(4);
        ensure!(
            span <= staging.size(),
            "reading {bytes} bytes back through a buffer of {}",
            staging.size()
        );
        staging.map_async(wgpu::MapMode::Read, ..span, move |r| {
            let _ = tx.send(r);
        });
        self.wait(idx)?;
        // The map callback runs within a poll: usually this wait's, but another thread's poll may have taken the
        // finished work and be about to call it. A lost device drops it instead.
        let deadline = std::time::Instant::now() + super::device::WAIT;
        loop {
            match rx.recv_timeout(std::time::Duration::from_millis(1)) {
                Ok(Ok(())) => break,
                Ok(Err(e)) => bail!("reading back from the GPU: {e}"),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    bail!("reading back from the GPU: the buffer was never mapped (device lost?)")
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    ensure!(
                        std::time::Instant::now() < deadline,
                        "reading back from the GPU: not mapped within {:?}",
                        super::device::WAIT
                    );
                    self.poll()?;
                }
            }
        }
        let out = staging.get_mapped_range(..span)?[..bytes].to_vec();
        staging.unmap();
        Ok(out)
    }

    /// Overwrites `x.len()` f16 values of `h` from `at` (even, as `x.len()`: whole words); ordered before the
    /// passes submitted after it.
    pub fn write_halves(&self, h: &Halves, at: usize, x: &[f16]) -> Result<()> {
        ensure!(
            at.is_multiple_of(2) && x.len().is_multiple_of(2) && at + x.len() <= h.len,
            "writing {} halves at {at} of {}",
            x.len(),
            h.len
        );
        self.queue
            .write_buffer(&h.buf, 2 * at as u64, bytemuck::cast_slice(&bits_of(x)));
        self.check()
    }

    /// `t` copied back to the host.
    pub fn read(&self, t: &Tensor) -> Result<Vec<f32>> {
        let b = self.read_bytes(&t.buf, t.len * 4)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// `h` copied back to the host.
    pub fn read_halves(&self, h: &Halves) -> Result<Vec<f16>> {
        let b = self.read_bytes(&h.buf, h.len * 2)?;
        Ok(b.chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect())
    }
}

/// The bit patterns of `x`, as the device stores them.
fn bits_of(x: &[f16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}
