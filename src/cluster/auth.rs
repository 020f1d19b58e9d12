//! Shared-secret challenge-response. Each end sends a fresh 32-byte nonce; each proves it knows the secret with
//! HMAC-SHA256(secret, label || nonce_coordinator || nonce_node), with a different label per direction so one
//! side's proof can never be replayed as the other's. The secret itself never crosses the wire.

use anyhow::{Context, Result, bail};
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use std::path::Path;

type HmacSha256 = Hmac<Sha256>;

pub const LABEL_COORDINATOR: &[u8] = b"baton-auth-v1 coordinator";
pub const LABEL_NODE: &[u8] = b"baton-auth-v1 node";

/// Fewest bytes a secret may have.
pub const MIN_SECRET: usize = 16;

/// A fresh nonce from the operating system's generator.
pub fn nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// The proof one side sends.
pub fn proof(secret: &[u8], label: &[u8], nonce_coordinator: &[u8; 32], nonce_node: &[u8; 32]) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(nonce_coordinator);
    m.update(nonce_node);
    m.finalize().into_bytes().into()
}

/// Checks a proof in constant time.
pub fn verify(
    secret: &[u8],
    label: &[u8],
    nonce_coordinator: &[u8; 32],
    nonce_node: &[u8; 32],
    mac: &[u8; 32],
) -> bool {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(nonce_coordinator);
    m.update(nonce_node);
    m.verify_slice(mac).is_ok()
}

/// Reads a secret file: its bytes with trailing whitespace (a final newline) removed; at least [`MIN_SECRET`] bytes.
pub fn load_secret(path: &Path) -> Result<Vec<u8>> {
    let mut s = std::fs::read(path).with_context(|| format!("cannot read secret file {}", path.display()))?;
    while s.last().is_some_and(|b| b.is_ascii_whitespace()) {
        s.pop();
    }
    if s.len() < MIN_SECRET {
        bail!(
            "secret file {} holds {} bytes, at least {MIN_SECRET} are needed",
            path.display(),
            s.len()
        );
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_secret_nonces_and_direction() {
        let (a, b) = (nonce(), nonce());
        assert_ne!(a, b);
        let p = proof(b"0123456789abcdef", LABEL_COORDINATOR, &a, &b);
        assert!(verify(b"0123456789abcdef", LABEL_COORDINATOR, &a, &b, &p));
        assert!(!verify(b"0123456789abcdeX", LABEL_COORDINATOR, &a, &b, &p));
        assert!(!verify(b"0123456789abcdef", LABEL_NODE, &a, &b, &p));
        assert!(!verify(b"0123456789abcdef", LABEL_COORDINATOR, &b, &a, &p));
    }

    #[test]
    fn secret_files_are_trimmed_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        std::fs::write(&p, "a-long-enough-secret\n").unwrap();
        assert_eq!(load_secret(&p).unwrap(), b"a-long-enough-secret");
        std::fs::write(&p, "short\n").unwrap();
        assert!(load_secret(&p).unwrap_err().to_string().contains("at least"));
    }
}
