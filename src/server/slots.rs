//! `POST /slots/{id}?action=save|restore` (as llama-server names them): a slot's conversation (KV and token ids)
//! saved to a file of `--slot-save-path` and restored later, in this process or another with the same weights.
//! Clients name a file, never a path: the name is checked so nothing outside the directory can be read or written.

use super::openai::ApiError;
use super::queue::SlotOp;
use super::routes::AppState;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use std::time::Instant;

#[derive(Deserialize)]
pub struct Action {
    action: Option<String>,
}

pub async fn slot_action(
    State(app): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<Action>,
    body: Bytes,
) -> Response {
    match act(app, &id, q.action.as_deref(), &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn act(app: AppState, id: &str, action: Option<&str>, body: &[u8]) -> Result<Response, ApiError> {
    let Some(dir) = app.slot_save_path.clone() else {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "saving and restoring slots is off: start the server with --slot-save-path DIR",
        ));
    };
    let slot: usize = id
        .parse()
        .map_err(|_| ApiError::new(StatusCode::NOT_FOUND, format!("slot id {id:?} is not a number")))?;
    let body: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad("filename", format!("body is not JSON: {e}")))?;
    let name = body
        .get("filename")
        .and_then(|v| v.as_str())
        .ok_or_else(|| ApiError::bad("filename", "the body must name a file: {\"filename\": \"NAME\"}"))?;
    check_name(name).map_err(|m| ApiError::bad("filename", m))?;
    let path = dir.join(name);
    let (op, action) = match action {
        Some("save") => (SlotOp::Save(path.clone()), "save"),
        Some("restore") => (SlotOp::Restore(path.clone()), "restore"),
        other => {
            return Err(ApiError::bad(
                "action",
                format!("action must be save or restore, not {other:?}"),
            ));
        }
    };
    let t0 = Instant::now();
    let rx = app.sched.slot_op(slot, op)?;
    let res = tokio::task::spawn_blocking(move || rx.recv())
        .await
        .ok()
        .and_then(|r| r.ok())
        .ok_or_else(|| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the slot's thread died"))?;
    let n = res.map_err(|e| {
        let status = if action == "save" {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError::new(status, format!("{e:#}"))
    })?;
    let bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    tracing::info!("serve: slot {slot}: {action}d {n} positions ({bytes} bytes) as {name} in {ms:.0} ms");
    let mut out = json!({"id_slot": slot, "filename": name, "n_bytes": bytes, "timings": {}});
    out[format!("n_{action}d")] = json!(n);
    out["timings"][format!("{action}_ms")] = json!(ms);
    Ok(axum::Json(out).into_response())
}

/// A file name inside the directory: letters, digits, `.`, `_`, `-`; not starting with a dot (no `..`, no hidden
/// or temporary files); no separators.
fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "filename {name:?} must be a plain name (letters, digits, '.', '_', '-', not starting with '.'), not a path"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::check_name;

    #[test]
    fn names_cannot_leave_the_directory() {
        for bad in ["", "..", "../x", "a/b", "/etc/passwd", ".hidden", "a\\b", "x\0y", "é"] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["chat-1.kv", "session_2", "A.b.c"] {
            assert!(check_name(good).is_ok(), "{good:?} refused");
        }
    }
}
