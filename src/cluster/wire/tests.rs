use super::codec::{Codec, Dec, Enc};
use super::*;
use crate::engine::snapshot::RowDtype;

fn roundtrip(m: Msg) {
    let mut buf = Vec::new();
    let n = write_msg(&mut buf, &m).unwrap();
    assert_eq!(n, buf.len());
    let (back, read) = read_msg(&mut &buf[..]).unwrap();
    assert_eq!(read, n);
    assert_eq!(back, m);
}

fn info() -> ModelInfo {
    ModelInfo {
        fingerprint: "ab".repeat(32),
        arch: "llama".into(),
        n_layer: 30,
        n_embd: 576,
        n_vocab: 49152,
        n_head: 9,
        n_head_kv: 3,
    }
}

#[test]
fn every_message_roundtrips() {
    roundtrip(Msg::Hello { nonce: [7; 32] });
    roundtrip(Msg::Challenge {
        nonce: [8; 32],
        auth_required: true,
    });
    roundtrip(Msg::Auth { mac: [9; 32] });
    roundtrip(Msg::AuthOk { mac: [1; 32] });
    roundtrip(Msg::Open(Open {
        model: info(),
        layers: (3, 17),
        n_ctx: 4096,
        n_batch: 128,
        wire: RowDtype::Q8,
        session: 0xdead_beef,
        temperature: 0.7,
        top_p: 0.9,
        seed: 42,
        top_k: 5,
        sample_top_k: 40,
        min_p: 0.05,
        repeat_penalty: 1.1,
        repeat_last_n: 64,
        request_id: "req-1".into(),
    }));
    roundtrip(Msg::Ready(Ready {
        model: info(),
        layers: (0, 30),
        n_ctx: 512,
        n_past: 12,
        backend: "gpu: NVIDIA H100 80GB HBM3".into(),
        isa: "avx2+vnni".into(),
    }));
    let h = Hidden::encode(&[1.0, -2.0, 3.5, 0.25, 8.0, -1.0], 3, RowDtype::Q8);
    roundtrip(Msg::Forward(Forward {
        req: 5,
        pos: 10,
        prefix: [3; 16],
        tokens: vec![1, 2],
        hidden: Some(h.clone()),
        want: WantOut::Sample,
        request_id: "chatcmpl:7_a.b".into(),
    }));
    roundtrip(Msg::Forward(Forward {
        req: 5,
        pos: 0,
        prefix: [0; 16],
        tokens: vec![9],
        hidden: None,
        want: WantOut::Ack,
        request_id: String::new(),
    }));
    roundtrip(Msg::Result(ResultMsg {
        req: 1,
        compute_us: 99,
        body: Body::Hidden(h),
    }));
    roundtrip(Msg::Result(ResultMsg {
        req: 1,
        compute_us: 99,
        body: Body::Sample {
            token: 4,
            logprob: -0.5,
            top: vec![(4, -0.5), (7, -1.5)],
        },
    }));
    roundtrip(Msg::Result(ResultMsg {
        req: 2,
        compute_us: 0,
        body: Body::Logits(vec![0.5; 10]),
    }));
    roundtrip(Msg::Result(ResultMsg {
        req: 2,
        compute_us: 0,
        body: Body::Ack,
    }));
    roundtrip(Msg::Mismatch { req: 3, n_past: 77 });
    roundtrip(Msg::Lookup {
        req: 5,
        tokens: vec![1, 2, 70000],
    });
    roundtrip(Msg::Cached { req: 5, n_past: 512 });
    roundtrip(Msg::Prefill(Prefill {
        req: 9,
        pos: 4,
        prefix: [5; 16],
        send_from: 6,
        kv: RowDtype::F16,
        hidden: HiddenRows::Last,
        tokens: vec![1, 2, 3],
        request_id: "r2".into(),
    }));
    roundtrip(Msg::Kv {
        req: 9,
        data: vec![1, 2, 3, 4, 5],
    });
    roundtrip(Msg::PrefillHidden(PrefillHidden {
        req: 9,
        pos: 6,
        checksum: [1; 8],
        hidden: Hidden::encode(&[1.0, 2.0], 2, RowDtype::F32),
    }));
    roundtrip(Msg::PrefillDone {
        req: 9,
        n_past: 12,
        queue_us: 7,
        compute_us: 1000,
    });
    roundtrip(Msg::Pull(Pull {
        req: 10,
        pos: 3,
        prefix: [6; 16],
        tokens: vec![4, 5, 6],
        prefill: "10.0.0.2:7070".into(),
        offload: OFFLOAD_AUTO,
        kv: RowDtype::Q8,
        timeout_ms: 10_000,
        request_id: "r3".into(),
    }));
    roundtrip(Msg::PullReport(PullReport {
        req: 10,
        layers: 30,
        n_layer: 30,
        prompt: 40,
        held: 3,
        sent: 37,
        catch_up: 1,
        connect_us: 1,
        queue_us: 2,
        remote_us: 3,
        local_us: 4,
        exposed_us: 5,
        handoff_us: 6,
        total_us: 7,
        bytes: 8,
        link_rate: 9,
        plan: "offload always".into(),
        fallback: String::new(),
    }));
    roundtrip(Msg::Error {
        message: "nope ✓".into(),
    });
    roundtrip(Msg::Experts(experts()));
    roundtrip(Msg::ExpertsOut(ExpertsOut {
        req: 9,
        compute_us: 120,
        out: Hidden::encode(&[0.5; 12], 4, RowDtype::F16),
    }));
}

fn experts() -> Experts {
    let pick = |row, expert, weight| crate::model::moe::Pick { row, expert, weight };
    Experts {
        req: 8,
        layer: 3,
        rows: Hidden::encode(&[1.5; 8], 4, RowDtype::F32),
        picks: vec![pick(0, 7, 0.25), pick(1, 2, 0.75), pick(1, 0, -1.0)],
    }
}

/// An EXPERTS pick naming a row that was not sent, or with a non-finite weight, is malformed; a count beyond the
/// bytes present is refused before allocating; every truncation fails cleanly.
#[test]
fn experts_picks_are_checked() {
    let full = Msg::Experts(experts()).encode();
    for n in 0..full.len() {
        assert!(Msg::decode(ty::EXPERTS, &full[..n]).is_err());
    }
    let mut x = experts();
    x.picks[1].row = 2;
    let err = Msg::decode(ty::EXPERTS, &Msg::Experts(x).encode()).unwrap_err();
    assert!(err.to_string().contains("row 2"), "{err}");
    let mut x = experts();
    x.picks[0].weight = f32::INFINITY;
    assert!(Msg::decode(ty::EXPERTS, &Msg::Experts(x).encode()).is_err());
    let mut p = Msg::Experts(Experts {
        picks: vec![],
        ..experts()
    })
    .encode();
    let at = p.len() - 4;
    p[at..].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(Msg::decode(ty::EXPERTS, &p).is_err());
}

#[test]
fn hidden_codecs_bound_their_error() {
    let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37).collect();
    for (code, (dt, tol)) in [
        (RowDtype::F32, 0.0),
        (RowDtype::F16, 2e-3),
        (RowDtype::BF16, 2e-2),
        (RowDtype::Q8, 0.03),
    ]
    .into_iter()
    .enumerate()
    {
        // docs/protocol.md's dtype codes.
        let mut e = Enc(Vec::new());
        dt.put(&mut e);
        assert_eq!(e.0, [code as u8]);
        assert_eq!(RowDtype::get(&mut Dec { b: &e.0, pos: 0 }).unwrap(), dt);
        let h = Hidden::encode(&x, 16, dt);
        assert_eq!(h.data.len(), 4 * dt.row_bytes(16));
        let y = h.decode();
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= tol * amax, "{dt:?}: {a} vs {b}");
        }
    }
}

#[test]
fn bad_headers_are_refused_before_allocation() {
    let mut head = [0u8; HEADER_LEN];
    head[..4].copy_from_slice(&MAGIC);
    head[4] = VERSION;
    head[5] = ty::FORWARD;
    head[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(check_header(&head), Err(WireError::Malformed(m)) if m.contains("exceeds")));
    head[5] = ty::HELLO;
    head[8..12].copy_from_slice(&(1u32 << 20).to_le_bytes());
    assert!(check_header(&head).is_err(), "handshake frames have a small limit");
    head[4] = VERSION + 1;
    assert!(
        matches!(check_header(&head), Err(WireError::Malformed(m)) if m.contains(&format!("version {}", VERSION + 1)))
    );
    let junk = b"GET / HTTP/1.1\r\n\r\n";
    assert!(matches!(read_msg(&mut &junk[..]), Err(WireError::Malformed(m)) if m.contains("magic")));
    assert!(matches!(read_msg(&mut &MAGIC[..]), Err(WireError::Closed)));
}

#[test]
fn inner_lengths_are_checked() {
    // A FORWARD that claims a billion tokens in a 40-byte payload.
    let mut p = Vec::new();
    p.extend_from_slice(&1u64.to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(&[0; 16]);
    p.push(0);
    p.extend_from_slice(&1_000_000_000u32.to_le_bytes());
    assert!(Msg::decode(ty::FORWARD, &p).is_err());
    // A hidden state whose byte count disagrees with its shape.
    let mut h = Hidden::encode(&[1.0; 8], 4, RowDtype::F16);
    h.data.pop();
    let f = Msg::Forward(Forward {
        req: 1,
        pos: 0,
        prefix: [0; 16],
        tokens: vec![1, 2],
        hidden: Some(h),
        want: WantOut::Hidden,
        request_id: String::new(),
    });
    assert!(Msg::decode(ty::FORWARD, &f.encode()).is_err());
    // Trailing bytes.
    let mut ok = Msg::Mismatch { req: 1, n_past: 2 }.encode();
    ok.push(0);
    assert!(Msg::decode(ty::MISMATCH, &ok).is_err());
    // Every truncation of a valid message fails cleanly.
    let full = Msg::Open(Open {
        request_id: "r".into(),
        ..Open::unsampled(info(), (0, 1), 1, 1, 1)
    })
    .encode();
    for n in 0..full.len() {
        assert!(Msg::decode(ty::OPEN, &full[..n]).is_err());
    }
}

#[test]
fn request_ids_are_bounded_and_plain() {
    let forward = |id: &str| {
        Msg::Forward(Forward {
            req: 1,
            pos: 0,
            prefix: [0; 16],
            tokens: vec![1],
            hidden: None,
            want: WantOut::Ack,
            request_id: id.into(),
        })
        .encode()
    };
    let max = "a".repeat(crate::util::MAX_REQUEST_ID);
    assert!(Msg::decode(ty::FORWARD, &forward(&max)).is_ok());
    for bad in [format!("{max}a"), "a\nb".into(), "a b".into(), "caf\u{e9}".into()] {
        let e = Msg::decode(ty::FORWARD, &forward(&bad));
        assert!(
            matches!(&e, Err(WireError::Malformed(m)) if m.contains("request id")),
            "{bad:?}: {e:?}"
        );
    }
}

#[test]
fn ready_labels_are_bounded_and_without_control_characters() {
    let ready = |backend: &str| Ready {
        model: info(),
        layers: (0, 30),
        n_ctx: 512,
        n_past: 0,
        backend: backend.into(),
        isa: "avx2".into(),
    };
    // The encoder cleans what it sends: control characters become `?`, the label is cut to MAX_LABEL bytes.
    let sent = Msg::decode(
        ty::READY,
        &Msg::Ready(ready(&format!("gpu: a\x1b[31m{}", "é".repeat(40)))).encode(),
    );
    let Ok(Msg::Ready(r)) = sent else { panic!("{sent:?}") };
    assert!(
        r.backend.starts_with("gpu: a?[31m") && r.backend.len() <= MAX_LABEL,
        "{:?}",
        r.backend
    );
    // The decoder refuses what a peer's own encoder would not send.
    let mut raw = Msg::Ready(ready("cpu")).encode();
    let at = raw.len() - (2 + 4) - (2 + 3);
    assert_eq!(&raw[at + 2..at + 5], b"cpu");
    raw[at + 3] = b'\n';
    let e = Msg::decode(ty::READY, &raw);
    assert!(
        matches!(&e, Err(WireError::Malformed(m)) if m.contains("control")),
        "{e:?}"
    );
    let mut e = Enc(Vec::new());
    ready("").model.put(&mut e);
    for v in [0u32, 30, 512, 0] {
        e.u32(v);
    }
    e.str(&"x".repeat(MAX_LABEL + 1));
    e.str("avx2");
    let r = Msg::decode(ty::READY, &e.0);
    assert!(
        matches!(&r, Err(WireError::Malformed(m)) if m.contains("exceeds")),
        "{r:?}"
    );
}

#[test]
fn a_lookup_beyond_its_bound_is_refused() {
    let m = Msg::Lookup {
        req: 1,
        tokens: vec![0; MAX_LOOKUP_TOKENS + 1],
    };
    let e = Msg::decode(ty::LOOKUP, &m.encode()).unwrap_err();
    assert!(matches!(&e, WireError::Malformed(s) if s.contains("at most")), "{e}");
}
