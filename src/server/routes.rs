//! HTTP routes: the OpenAI endpoints, `/health`, `/metrics`, `/v1/cluster`, the web page; authentication and
//! per-request accounting.

use super::metrics::Metrics;
use super::openai::{self, ApiError, Request, Responder};
use super::queue::{Event, Job, Scheduler};
use crate::generate::GenParams;
use crate::logging::request_span;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Extension, Request as HttpRequest, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tracing::Instrument;

/// Largest request body accepted.
const MAX_BODY: usize = 4 << 20;

pub struct App {
    pub sched: Arc<Scheduler>,
    pub metrics: Arc<Metrics>,
    /// The model id clients name (`/v1/models`).
    pub model_id: String,
    /// Other names requests may use for the same model.
    pub aliases: Vec<String>,
    pub api_key: Option<String>,
    pub describe: String,
    pub created: u64,
    /// Where `/slots/{id}?action=save|restore` keep sessions (`--slot-save-path`).
    pub slot_save_path: Option<std::path::PathBuf>,
    /// A request's whole body must arrive within this (`--body-timeout`).
    pub body_timeout: std::time::Duration,
    /// The served model's tokenizer (`None` for an ensemble of several vocabularies).
    pub text: Option<Arc<crate::generate::TextModel>>,
    /// Computes `/v1/embeddings` where the whole model is in this process.
    pub embedder: Option<Arc<super::embeddings::Embedder>>,
    /// Template variables and reasoning format of chat requests that do not set them.
    pub chat_defaults: openai::ChatDefaults,
}

pub type AppState = Arc<App>;

impl App {
    pub fn serves(&self, model: &str) -> bool {
        model == self.model_id || self.aliases.iter().any(|a| a == model)
    }
}

pub fn router(app: AppState) -> Router {
    Router::new()
        .route("/", get(super::web::index))
        .route("/web/{file}", get(super::web::asset))
        .route("/v1/cluster", get(cluster))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(super::embeddings::embeddings))
        .route("/tokenize", post(super::embeddings::tokenize))
        .route("/detokenize", post(super::embeddings::detokenize))
        .route("/slots/{id}", post(super::slots::slot_action))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app)
}

/// The id of one HTTP request: the client's `X-Request-Id` when it is [`crate::util::valid_request_id`], else a
/// fresh one. Returned in the `x-request-id` header, logged by every process that serves the request.
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

/// The request id, then, within its log span: bearer authentication (when an API key is set; `/health` and the
/// page's static files stay open: they hold no data, and the page asks for the key),
/// the body read within the body timeout and size limit, the route; every request counted under a label from a
/// fixed set and answered with its `x-request-id`.
async fn guard(State(app): State<AppState>, mut req: HttpRequest, next: Next) -> Response {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| crate::util::valid_request_id(v))
        .map_or_else(crate::util::new_request_id, str::to_string);
    req.extensions_mut().insert(RequestId(id.clone()));
    let (method, label) = (req.method().clone(), path_label(req.uri().path()));
    let t0 = Instant::now();
    let mut resp = guarded(&app, req, next, label).instrument(request_span(&id)).await;
    let status = resp.status().as_u16();
    app.metrics.request(label, status);
    let _s = request_span(&id).entered();
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    // Probes and scrapes would drown the requests that matter at `info`.
    if matches!(label, "/health" | "/metrics") {
        tracing::debug!("serve: {method} {label} {status} in {ms:.0} ms");
    } else {
        tracing::info!("serve: {method} {label} {status} in {ms:.0} ms");
    }
    if let Ok(v) = header::HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

async fn guarded(app: &App, req: HttpRequest, next: Next, label: &'static str) -> Response {
    if let Some(key) = &app.api_key
        && !matches!(label, "/health" | "/" | "/web")
    {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or wrong API key (Authorization: Bearer KEY)",
            )
            .code("invalid_api_key")
            .into_response();
        }
    }
    match read_body(app, req).await {
        Ok(r) => next.run(r).await,
        Err(e) => e.into_response(),
    }
}

/// The metrics label of a request path: the route, never the path itself (ids and unknown paths would add a
/// series per request).
pub fn path_label(path: &str) -> &'static str {
    match path {
        "/health" => "/health",
        "/metrics" => "/metrics",
        "/v1/models" => "/v1/models",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/embeddings" => "/v1/embeddings",
        "/tokenize" => "/tokenize",
        "/detokenize" => "/detokenize",
        "/v1/cluster" => "/v1/cluster",
        "/" => "/",
        p if p.starts_with("/web/") => "/web",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        p if p.starts_with("/slots/") => "/slots",
        _ => "other",
    }
}

/// Compares a presented secret with ours in time independent of where they differ (both hashed first, so their
/// lengths do not show either).
fn same_secret(given: &[u8], ours: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    let (a, b) = (Sha256::digest(given), Sha256::digest(ours));
    a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads the whole body within the body timeout and [`MAX_BODY`]: a declared length over the limit is refused
/// before a byte is read, a slow body with 408.
async fn read_body(app: &App, req: HttpRequest) -> Result<HttpRequest, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    let (parts, body) = req.into_parts();
    let t = app.body_timeout;
    match tokio::time::timeout(t, axum::body::to_bytes(body, MAX_BODY)).await {
        Ok(Ok(bytes)) => Ok(HttpRequest::from_parts(parts, Body::from(bytes))),
        Ok(Err(_)) => Err(too_large()),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {:.1} s", t.as_secs_f64()),
        )),
    }
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the request body is larger than {} MiB", MAX_BODY >> 20),
    )
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such route")
}

/// 200 while every slot can serve; 503 when no node is up, or when a slot crashed and could not be restarted
/// (`dead_slots` says why): such a server needs its operator, even while its other slots still answer.
async fn health(State(app): State<AppState>) -> Response {
    let g = app.sched.gauges();
    let up = g.nodes.iter().any(|n| n.1) && g.dead.is_empty();
    let nodes: Vec<Value> = g
        .nodes
        .iter()
        .map(|(n, up, busy, slots)| json!({"node": n, "up": up, "busy": busy, "slots": slots}))
        .collect();
    let body = json!({"status": if up { "ok" } else { "unavailable" }, "model": app.model_id, "generator": app.describe,
                      "slots": g.slots, "busy": g.busy, "queue": g.queue_depth, "nodes": nodes,
                      "dead_slots": g.dead});
    let code = if up {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(body)).into_response()
}

/// Nodes, links and recent requests (`docs/server.md` has the schema).
async fn cluster(State(app): State<AppState>) -> Response {
    let g = app.sched.gauges();
    axum::Json(app.sched.status.view(&g, &app.model_id, &app.describe)).into_response()
}

async fn metrics(State(app): State<AppState>) -> Response {
    let text = app.metrics.render(&app.sched.gauges());
    ([(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)], text).into_response()
}

fn model_obj(app: &App) -> Value {
    json!({"id": app.model_id, "object": "model", "created": app.created, "owned_by": "baton"})
}

async fn models(State(app): State<AppState>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_obj(&app)]})).into_response()
}

async fn model(State(app): State<AppState>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    if app.serves(&id) {
        axum::Json(model_obj(&app)).into_response()
    } else {
        unknown_model(&app, &id).into_response()
    }
}

pub fn unknown_model(app: &App, id: &str) -> ApiError {
    ApiError {
        param: Some("model"),
        ..ApiError::new(
            StatusCode::NOT_FOUND,
            format!("the model {id:?} does not exist; this server serves {:?}", app.model_id),
        )
    }
    .code("model_not_found")
}

async fn chat(
    State(app): State<AppState>,
    Extension(id): Extension<RequestId>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    match body {
        Ok(b) => handle(app, openai::parse_chat(&b), id).await,
        Err(e) => ApiError::new(e.status(), e.body_text()).into_response(),
    }
}

async fn completions(
    State(app): State<AppState>,
    Extension(id): Extension<RequestId>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    match body {
        Ok(b) => handle(app, openai::parse_completion(&b), id).await,
        Err(e) => ApiError::new(e.status(), e.body_text()).into_response(),
    }
}

async fn handle(app: AppState, req: Result<Request, ApiError>, id: RequestId) -> Response {
    match run(app, req, id).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(app: AppState, req: Result<Request, ApiError>, id: RequestId) -> Result<Response, ApiError> {
    let req = req?.with_defaults(&app.chat_defaults);
    if let Some(m) = &req.model
        && !app.serves(m)
    {
        return Err(unknown_model(&app, m));
    }
    let (tx, mut rx) = unbounded_channel();
    let job = Job {
        prompt: req.prompt.clone(),
        max_tokens: req.max_tokens,
        params: GenParams {
            request_id: id.0,
            ..req.gen_params(0)
        },
        stops: req.stops.clone(),
        reasoning: req.splits_reasoning(),
        key: req.affinity_key(),
        tx,
        arrived: Instant::now(),
        tried: Vec::new(),
        last_error: None,
    };
    app.sched.submit(job)?;
    let mut resp = Responder::new(req.endpoint, &app.model_id, req.logprobs).with_tools(req.tools.clone());
    // The first event decides the HTTP status: an error before any text is a plain error response.
    let mut first = rx.recv().await.ok_or_else(dropped)?;
    if let Event::Thinking { tags, prompt_opens } = first {
        resp.think(tags, prompt_opens);
        first = rx.recv().await.ok_or_else(dropped)?;
    }
    if let Event::Error(e) = first {
        return Err(e);
    }
    if !req.stream {
        let mut pieces = Vec::new();
        let mut ev = first;
        loop {
            match ev {
                Event::Piece(p) => pieces.push(p),
                Event::Done { outcome, stop_matched } => {
                    let fin = openai::finish_reason(outcome.finish, stop_matched);
                    return Ok(axum::Json(resp.full(&pieces, fin, &outcome)).into_response());
                }
                Event::Error(e) => return Err(e),
                Event::Thinking { tags, prompt_opens } => resp.think(tags, prompt_opens),
            }
            ev = rx.recv().await.ok_or_else(dropped)?;
        }
    }
    let mut pending = VecDeque::new();
    if let Some(c) = resp.role_chunk() {
        pending.push_back(sse(&c));
    }
    let mut st = Sse {
        rx,
        resp,
        include_usage: req.include_usage,
        pending,
        finished: false,
    };
    st.on(first);
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(b) = st.pending.pop_front() {
                return Some((Ok::<Bytes, Infallible>(b), st));
            }
            if st.finished {
                return None;
            }
            match st.rx.recv().await {
                Some(ev) => st.on(ev),
                None => st.on(Event::Error(dropped())),
            }
        }
    });
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(stream))
        .expect("static headers"))
}

fn dropped() -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the generation ended without a result",
    )
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// State of one SSE stream: events in, `data:` lines out.
struct Sse {
    rx: UnboundedReceiver<Event>,
    resp: Responder,
    include_usage: bool,
    pending: VecDeque<Bytes>,
    finished: bool,
}

impl Sse {
    fn on(&mut self, ev: Event) {
        match ev {
            Event::Piece(p) => {
                for c in self.resp.piece_chunk(&p) {
                    self.pending.push_back(sse(&c));
                }
            }
            // A job retried on another slot says it again before its first piece.
            Event::Thinking { tags, prompt_opens } => self.resp.think(tags, prompt_opens),
            Event::Done { outcome, stop_matched } => {
                let fin = openai::finish_reason(outcome.finish, stop_matched);
                for c in self.resp.finish_chunks(fin) {
                    self.pending.push_back(sse(&c));
                }
                if self.include_usage {
                    self.pending.push_back(sse(&self.resp.usage_chunk(&outcome)));
                }
                self.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                self.finished = true;
            }
            Event::Error(e) => {
                // The OpenAI clients raise on a `data:` object carrying `error`.
                self.pending.push_back(sse(&e.body()));
                self.finished = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::queue::tests::{crashed, fake_scheduler, submit};

    async fn health_of(sched: Arc<Scheduler>) -> (StatusCode, Value) {
        let app = Arc::new(App {
            sched,
            metrics: Arc::new(Metrics::default()),
            model_id: "fake".into(),
            aliases: Vec::new(),
            api_key: None,
            describe: "fake".into(),
            created: 0,
            slot_save_path: None,
            body_timeout: std::time::Duration::from_secs(1),
            text: None,
            embedder: None,
            chat_defaults: Default::default(),
        });
        let resp = health(State(app)).await;
        let code = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), MAX_BODY).await.unwrap();
        (code, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test]
    async fn health_fails_when_a_slot_cannot_be_restarted() {
        let s = fake_scheduler(1);
        let (code, _) = health_of(s.clone()).await;
        assert_eq!(code, StatusCode::OK);
        // "boom" crashes and the slot is rebuilt: still healthy.
        crashed(&mut submit(&s, "boom").unwrap()).await;
        let (code, body) = health_of(s.clone()).await;
        assert_eq!(code, StatusCode::OK, "{body}");
        // "break" crashes and the rebuild fails.
        crashed(&mut submit(&s, "break").unwrap()).await;
        let (code, body) = health_of(s).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(body["status"], "unavailable", "{body}");
        let why = body["dead_slots"][0].as_str().unwrap_or_default();
        assert!(
            why.contains("could not be restarted") && why.contains("the model file is gone"),
            "{body}"
        );
    }
}
