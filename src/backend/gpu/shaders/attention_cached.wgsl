// attention.wgsl's head for queries rotated already (rope.wgsl's) and every position's K and V in the cache.

const FRESH: bool = false;

@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(4) var<storage, read> kc: array<u32>;
@group(0) @binding(5) var<storage, read> vc: array<u32>;

// The workgroup's rows' query head h into `qs`.
fn queries(h: u32, t0: u32, li: u32) {
    for (var i = li; i < p.hdk; i += WG) {
        var qv = Red(0.0);
        for (var r = 0u; r < ROWS; r++) {
            if (t0 + r < p.n_tok) {
                lane(&qv, r, q[((t0 + r) * p.n_head + h) * p.hdk + i]);
            }
        }
        qs[i] = qv;
    }
}

// Never called: the cache holds every position.
fn fresh_position(h: u32, kvh: u32, z: u32, li: u32, g: u32, d: u32, m: ptr<function, Red>,
                  l: ptr<function, Red>, acc: ptr<function, Red>) {}
