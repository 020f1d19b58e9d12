//! The RoPE tables a layer range needs: one per distinct base (Gemma 3 alternates local and global bases), each
//! with the model's scaling applied, so the CPU session and the GPU layers rotate with the same angles.

use super::Hparams;
use crate::kernels::ops::{RopeTable, Scaled};
use std::ops::Range;

pub struct RopeTables {
    tables: Vec<RopeTable>,
    /// Index into `tables` of each layer of the range, from `first`.
    of_layer: Vec<usize>,
    first: usize,
}

impl RopeTables {
    /// Tables for the layers `layers` (global indices) at contexts up to `n_ctx`.
    pub fn new(hp: &Hparams, layers: Range<usize>, n_ctx: usize) -> RopeTables {
        let mut tables: Vec<RopeTable> = Vec::new();
        let first = layers.start;
        let of_layer = layers
            .map(|il| {
                let base = hp.rope_base_of(il);
                tables.iter().position(|t| t.base == base).unwrap_or_else(|| {
                    let freqs = hp.rope_freqs.as_deref();
                    let r = &hp.rope_scaling;
                    let scaled = Scaled {
                        freq_scale: r.freq_scale,
                        yarn_ramp: r.yarn.map(|y| y.corr_dims(hp.n_rot, base)),
                        mscale: r.mscale(),
                    };
                    tables.push(RopeTable::scaled(base, hp.n_rot, n_ctx, &scaled, freqs));
                    tables.len() - 1
                })
            })
            .collect();
        RopeTables {
            tables,
            of_layer,
            first,
        }
    }

    /// The distinct tables, in order of first use.
    pub fn tables(&self) -> &[RopeTable] {
        &self.tables
    }

    /// Which of `tables()` layer `il` (global index, inside the range) rotates with.
    pub fn index_of(&self, il: usize) -> usize {
        self.of_layer[il - self.first]
    }

    pub fn of(&self, il: usize) -> &RopeTable {
        &self.tables[self.index_of(il)]
    }
}
