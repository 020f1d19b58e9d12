// attention.wgsl's head for a decode step (one row, ROWS 1, Red f32) straight from the Q, K and V projections
// (qkv_head.wgsl's bindings): each workgroup makes its query head ready, attends to the cache's positions before
// the row's, then to the row's own K and V made ready in workgroup memory, and the first query head of each KV
// head stores them into the cache, where the next step reads them. No workgroup reads a position another writes.

const FRESH: bool = true;

// The row's query head h, biased, normalised and rotated as rope.wgsl would write it, into `qs`.
fn queries(h: u32, t0: u32, li: u32) {
    ready_head(0u, Q_HEAD, h, pos[0], li);
    for (var i = li; i < p.hdk; i += WG) {
        qs[i] = hv[i];
    }
}

// The row's own position, in the split that holds it: its K's score (of the f16 the cache keeps, as the CPU
// scores it) joins the running maximum and sum, its V's dimension d the sums of thread group g = 0 (each group's
// sum rescaled, as after a chunk).
fn fresh_position(h: u32, kvh: u32, z: u32, li: u32, g: u32, d: u32, m: ptr<function, f32>,
                  l: ptr<function, f32>, acc: ptr<function, f32>) {
    let ps = pos[0];
    if (ps / p.split != z) {
        return;
    }
    let stores = h % (p.n_head / p.n_head_kv) == 0u;
    ready_head(0u, K_HEAD, kvh, ps, li);
    var part = 0.0;
    for (var i = li; i < p.hdk; i += WG) {
        part += qs[i] * f16_round(hv[i]);
    }
    let s = reduce_sum(li, part) * p.scale;
    if (stores) {
        store_head(0u, K_HEAD, kvh, ps, li);
    }
    workgroupBarrier();
    ready_head(0u, V_HEAD, kvh, ps, li);
    if (stores) {
        store_head(0u, V_HEAD, kvh, ps, li);
    }
    let mnew = max(*m, s);
    let f = exp(*m - mnew);
    let e = exp(s - mnew);
    *l = *l * f + e;
    *m = mnew;
    if (g < WG / p.hdv) {
        *acc = *acc * f;
        if (g == 0u) {
            *acc += e * f16_round(hv[d]);
        }
    }
}
