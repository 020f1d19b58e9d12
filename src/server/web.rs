//! The page at `/`: chat and cluster view, static files compiled into the binary (no build step, nothing fetched
//! from elsewhere). They hold no data, so they are served without the API key; the page sends the key the user
//! enters with its API calls.

use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("web/index.html");
const FILES: [(&str, &str, &str); 2] = [
    ("app.js", "text/javascript; charset=utf-8", include_str!("web/app.js")),
    ("style.css", "text/css; charset=utf-8", include_str!("web/style.css")),
];

/// Only this origin's own files and API: nothing else may load, even if a model's reply held markup.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; \
                   base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn page(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

pub async fn index() -> Response {
    page("text/html; charset=utf-8", INDEX)
}

pub async fn asset(Path(file): Path<String>) -> Response {
    match FILES.iter().find(|(name, _, _)| *name == file) {
        Some((_, ct, body)) => page(ct, body),
        None => (StatusCode::NOT_FOUND, "no such file").into_response(),
    }
}
