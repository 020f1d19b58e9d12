//! Hidden states on the wire: `[n_rows, width]` values in one of the row types, the payload of FORWARD, RESULT and
//! PREFILL_HIDDEN.

use super::WireError;
use super::codec::{Codec, Dec, Enc, malformed};
use crate::engine::snapshot::{self, RowDtype};
use half::{bf16, f16};

/// A hidden state `[n_rows, width]` encoded for the wire.
#[derive(Clone, Debug, PartialEq)]
pub struct Hidden {
    pub dtype: RowDtype,
    pub n_rows: u32,
    pub width: u32,
    /// Row-major values (f32/f16/bf16 little-endian, or i8); for Q8 followed by `n_rows` f32 scales.
    pub data: Vec<u8>,
}

impl Hidden {
    /// Rows encoded as snapshots encode them ([`snapshot::encode_rows`]); for Q8 the row scales follow the values.
    pub fn encode(x: &[f32], width: usize, dtype: RowDtype) -> Hidden {
        let n_rows = x.len() / width;
        let (mut data, scales) = snapshot::encode_rows(x, width, dtype);
        data.extend(scales.iter().flat_map(|s| s.to_le_bytes()));
        Hidden {
            dtype,
            n_rows: n_rows as u32,
            width: width as u32,
            data,
        }
    }

    /// Decodes into f32 values; the length was checked when the frame was parsed.
    pub fn decode(&self) -> Vec<f32> {
        let (n, w) = (self.n_rows as usize, self.width as usize);
        let d = &self.data;
        match self.dtype {
            RowDtype::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            RowDtype::F16 => d
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            RowDtype::BF16 => d
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            RowDtype::Q8 => {
                let (q, s) = d.split_at(n * w);
                let mut out = Vec::with_capacity(n * w);
                for (row, sc) in q.chunks_exact(w.max(1)).zip(s.chunks_exact(4)) {
                    let sc = f32::from_le_bytes(sc.try_into().unwrap());
                    out.extend(row.iter().map(|&b| (b as i8) as f32 * sc));
                }
                out
            }
        }
    }
}

impl Codec for Hidden {
    fn put(&self, e: &mut Enc) {
        self.dtype.put(e);
        e.u32(self.n_rows);
        e.u32(self.width);
        e.u32(self.data.len() as u32);
        e.raw(&self.data);
    }

    /// The byte count must match the shape, so [`Hidden::decode`] can trust it.
    fn get(d: &mut Dec) -> Result<Self, WireError> {
        let dtype = RowDtype::get(d)?;
        let n_rows = d.u32()?;
        let width = d.u32()?;
        let len = d.u32()? as usize;
        let need = (n_rows as u64).saturating_mul(dtype.row_bytes(width as usize) as u64);
        if need != len as u64 {
            return malformed(format!(
                "hidden state of {n_rows}x{width} {} needs {need} bytes, frame says {len}",
                dtype.name()
            ));
        }
        if width == 0 {
            return malformed("hidden state of width 0");
        }
        let data = d.take(len)?.to_vec();
        Ok(Hidden {
            dtype,
            n_rows,
            width,
            data,
        })
    }
}

/// An optional hidden state: a 0/1 flag, then the state.
impl Codec for Option<Hidden> {
    fn put(&self, e: &mut Enc) {
        match self {
            None => e.u8(0),
            Some(h) => {
                e.u8(1);
                h.put(e);
            }
        }
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(if d.flag("hidden-state")? {
            Some(Hidden::get(d)?)
        } else {
            None
        })
    }
}
