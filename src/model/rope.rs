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
        let mut keys: Vec<(f32, Scaled)> = Vec::new();
        let first = layers.start;
        let of_layer = layers
            .map(|il| {
                let key = (hp.rope_base_of(il), scaled_of(hp, il));
                keys.iter().position(|k| *k == key).unwrap_or_else(|| {
                    let freqs = hp.rope_freqs.as_deref();
                    tables.push(RopeTable::scaled(key.0, hp.n_rot, n_ctx, &key.1, freqs));
                    keys.push(key);
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

/// How layer `il` scales its angles. As llama.cpp's sliding-window graphs (Gemma 3's), a local layer's angles are
/// not position-scaled (its `rope_freq_scale_train_swa`, 1): Gemma 3 4B's linear factor 8 is for its global layers.
/// The RoPE attention factor applies to every layer; YaRN's ramp and magnitude correction have nothing to correct
/// where the scale is 1.
fn scaled_of(hp: &Hparams, il: usize) -> Scaled {
    let r = &hp.rope_scaling;
    if hp.swa_layers[il] {
        return Scaled {
            freq_scale: 1.0,
            yarn_ramp: None,
            mscale: r.attn_factor,
        };
    }
    Scaled {
        freq_scale: r.freq_scale,
        yarn_ramp: r.yarn.map(|y| y.corr_dims(hp.n_rot, hp.rope_base_of(il))),
        mscale: r.mscale(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    /// Sliding-window layers rotate unscaled (llama.cpp's gemma3), global ones by the model's scaling; layers of the
    /// same base and scaling share a table.
    #[test]
    fn local_layers_are_not_position_scaled() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/qwen3.gguf");
        let mut hp = Hparams::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        assert_eq!(hp.rope_scaling.freq_scale, 0.25);
        // Gemma 3's shape on this model: the same base for both kinds of layer, so only the scaling tells them apart.
        hp.swa_layers = vec![true, false];
        let t = RopeTables::new(&hp, 0..2, 64);
        assert_eq!(t.tables().len(), 2);
        let plain = RopeTable::new(hp.rope_base, hp.n_rot, 64);
        let quarter = Scaled {
            freq_scale: 0.25,
            ..Scaled::NONE
        };
        let scaled = RopeTable::scaled(hp.rope_base, hp.n_rot, 64, &quarter, None);
        assert_eq!(t.of(0).cos_sin(40), plain.cos_sin(40));
        assert_eq!(t.of(1).cos_sin(40), scaled.cos_sin(40));
        hp.swa_layers = vec![false, false];
        assert_eq!(RopeTables::new(&hp, 0..2, 64).tables().len(), 1);
    }
}
