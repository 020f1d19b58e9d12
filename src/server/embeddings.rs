//! `/v1/embeddings` (OpenAI's shape) and llama-server's `/tokenize` and `/detokenize`.
//!
//! An embedding is the mean over the input's tokens of the hidden state after the final norm (llama.cpp's mean
//! pooling), scaled to unit length as OpenAI's are. It is computed by its own session on the served model's
//! weights and thread pool, so it never evicts a chat slot's cached prefix; embedding requests take turns on it.

use super::openai::{ApiError, object, parse_err};
use super::routes::AppState;
use crate::engine::session::Session;
use crate::generate::TextModel;
use crate::kernels::ThreadPool;
use crate::model::Model;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Most inputs in one embeddings request (OpenAI's own limit).
const MAX_INPUTS: usize = 2048;

/// The session that computes embeddings, built on first use: until a client asks for one it costs no memory.
pub struct Embedder {
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    n_ctx: usize,
    n_batch: usize,
    session: Mutex<Option<Session>>,
    /// Requests waiting for the session or using it; more than `max_waiting` are answered 429.
    waiting: AtomicUsize,
    max_waiting: usize,
}

impl Embedder {
    pub fn new(model: Arc<Model>, pool: Arc<ThreadPool>, n_ctx: usize, n_batch: usize, max_waiting: usize) -> Embedder {
        Embedder {
            model,
            pool,
            n_ctx,
            n_batch,
            session: Mutex::new(None),
            waiting: AtomicUsize::new(0),
            max_waiting: max_waiting.max(1),
        }
    }

    /// Unit-length mean-pooled embeddings of each input, in order (blocking: run it off the async runtime).
    fn embed(&self, inputs: &[Vec<u32>]) -> anyhow::Result<Vec<Vec<f32>>> {
        let mut guard = self.session.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            *guard = Some(Session::new(
                self.model.clone(),
                self.pool.clone(),
                self.n_ctx,
                self.n_batch,
            )?);
        }
        let session = guard.as_mut().unwrap();
        inputs
            .iter()
            .map(|tokens| Ok(unit_length(session.mean_pooled(tokens)?)))
            .collect()
    }
}

/// `v / |v|` (a zero vector stays zero), as llama-server's default `embd_normalize` and OpenAI return them.
pub fn unit_length(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    if norm > 0.0 {
        for x in &mut v {
            *x = (*x as f64 / norm) as f32;
        }
    }
    v
}

/// What an embeddings request may hold: one text, several, token ids, or several lists of them.
#[derive(Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
struct EmbeddingsBody {
    input: Option<Input>,
    model: Option<String>,
    encoding_format: Option<String>,
    dimensions: Option<u64>,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Encoding {
    Float,
    Base64,
}

/// A parsed embeddings request: its inputs still as text or ids, tokenized once the model is known.
struct EmbeddingsRequest {
    inputs: Vec<Input1>,
    model: Option<String>,
    encoding: Encoding,
}

enum Input1 {
    Text(String),
    Tokens(Vec<u32>),
}

fn parse_embeddings(body: &[u8]) -> Result<EmbeddingsRequest, ApiError> {
    let v = object(body)?;
    let b: EmbeddingsBody = serde_json::from_value(v).map_err(|e| {
        if e.to_string().contains("untagged enum Input") {
            ApiError::bad(
                "input",
                "input must be a string, an array of strings, an array of token ids or an array of such arrays",
            )
        } else {
            parse_err(e)
        }
    })?;
    if b.dimensions.is_some() {
        return Err(ApiError::bad(
            "dimensions",
            "dimensions is not supported: embeddings have the model's width",
        ));
    }
    let encoding = match b.encoding_format.as_deref() {
        None | Some("float") => Encoding::Float,
        Some("base64") => Encoding::Base64,
        Some(f) => {
            return Err(ApiError::bad(
                "encoding_format",
                format!("encoding_format must be \"float\" or \"base64\", not {f:?}"),
            ));
        }
    };
    let inputs: Vec<Input1> = match b.input.ok_or_else(|| ApiError::bad("input", "input is required"))? {
        Input::Text(t) => vec![Input1::Text(t)],
        Input::Texts(ts) => ts.into_iter().map(Input1::Text).collect(),
        Input::Tokens(ids) => vec![Input1::Tokens(ids)],
        Input::TokenLists(ls) => ls.into_iter().map(Input1::Tokens).collect(),
    };
    if inputs.is_empty() || inputs.len() > MAX_INPUTS {
        return Err(ApiError::bad(
            "input",
            format!("input must hold between 1 and {MAX_INPUTS} items"),
        ));
    }
    Ok(EmbeddingsRequest {
        inputs,
        model: b.model,
        encoding,
    })
}

/// Token ids of each input, each non-empty, in the vocabulary and within `n_ctx`.
fn tokenize_inputs(text: &TextModel, inputs: Vec<Input1>, n_ctx: usize) -> Result<Vec<Vec<u32>>, ApiError> {
    let n_vocab = text.vocab.n_tokens();
    let mut out = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.into_iter().enumerate() {
        let tokens = match input {
            // As llama-server tokenizes embedding inputs: special tokens added and parsed.
            Input1::Text(t) => text.vocab.tokenize(&t, true, true),
            Input1::Tokens(ids) => {
                if let Some(id) = ids.iter().find(|&&id| id as usize >= n_vocab) {
                    return Err(ApiError::bad(
                        "input",
                        format!("input {i}: token id {id} is not in the vocabulary of {n_vocab} tokens"),
                    ));
                }
                ids
            }
        };
        if tokens.is_empty() {
            return Err(ApiError::bad("input", format!("input {i} is empty")));
        }
        if tokens.len() > n_ctx {
            return Err(ApiError::bad(
                "input",
                format!(
                    "input {i} is {} tokens, more than the context of {n_ctx} (raise -c)",
                    tokens.len()
                ),
            )
            .code("context_length_exceeded"));
        }
        out.push(tokens);
    }
    Ok(out)
}

pub async fn embeddings(State(app): State<AppState>, body: Bytes) -> Response {
    match run_embeddings(app, &body).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn run_embeddings(app: AppState, body: &[u8]) -> Result<Value, ApiError> {
    let req = parse_embeddings(body)?;
    if let Some(m) = &req.model
        && !app.serves(m)
    {
        return Err(super::routes::unknown_model(&app, m));
    }
    let (Some(embedder), Some(text)) = (app.embedder.clone(), app.text.clone()) else {
        return Err(ApiError::bad(
            "model",
            format!(
                "embeddings need the whole model in this process (serve --model without --pipeline, --cluster, \
                 --prefill-node, --draft or --ensemble); this server runs {}",
                app.describe
            ),
        ));
    };
    let inputs = tokenize_inputs(&text, req.inputs, embedder.n_ctx)?;
    if embedder.waiting.fetch_add(1, Ordering::SeqCst) >= embedder.max_waiting {
        embedder.waiting.fetch_sub(1, Ordering::SeqCst);
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "the server is busy with embeddings; retry later",
        )
        .code("queue_full"));
    }
    let n_tokens: usize = inputs.iter().map(Vec::len).sum();
    let e = embedder.clone();
    let result = tokio::task::spawn_blocking(move || {
        let r = e.embed(&inputs);
        e.waiting.fetch_sub(1, Ordering::SeqCst);
        r
    })
    .await;
    let vectors = match result {
        Ok(Ok(v)) => v,
        Ok(Err(err)) => {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("embedding failed: {err:#}"),
            ));
        }
        Err(_) => {
            // The session may be half-updated; the next request builds a fresh one.
            *embedder.session.lock().unwrap_or_else(|p| p.into_inner()) = None;
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the embedding computation crashed; it was reset",
            ));
        }
    };
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| json!({"object": "embedding", "index": i, "embedding": encode(v, req.encoding)}))
        .collect();
    Ok(json!({
        "object": "list",
        "data": data,
        "model": app.model_id,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }))
}

/// A vector as a JSON array of numbers, or as base64 of its little-endian f32 bytes (what the official clients
/// ask for by default).
fn encode(v: &[f32], encoding: Encoding) -> Value {
    match encoding {
        Encoding::Float => json!(v),
        Encoding::Base64 => {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeBody {
    content: String,
    #[serde(default)]
    add_special: bool,
    #[serde(default = "yes")]
    parse_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeBody {
    tokens: Vec<u32>,
}

fn text_model(app: &AppState) -> Result<Arc<TextModel>, ApiError> {
    app.text.clone().ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "this server's models have several vocabularies (an ensemble): tokenize against one member's server",
        )
    })
}

/// `POST /tokenize {"content", "add_special"?, "parse_special"?, "with_pieces"?}` → `{"tokens": [...]}`, each token
/// an id, or `{"id", "piece"}` with `with_pieces` (the piece a string when it is valid UTF-8, else its bytes).
pub async fn tokenize(State(app): State<AppState>, body: Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        let b: TokenizeBody = serde_json::from_value(object(&body)?).map_err(parse_err)?;
        let text = text_model(&app)?;
        let ids = text.vocab.tokenize(&b.content, b.add_special, b.parse_special);
        if !b.with_pieces {
            return Ok(json!({"tokens": ids}));
        }
        let tokens: Vec<Value> = ids
            .iter()
            .map(|&id| {
                let bytes = text.vocab.token_bytes(id);
                let piece = match std::str::from_utf8(bytes) {
                    Ok(s) => json!(s),
                    Err(_) => json!(bytes),
                };
                json!({"id": id, "piece": piece})
            })
            .collect();
        Ok(json!({ "tokens": tokens }))
    };
    match run() {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize {"tokens": [...]}` → `{"content": text}` (bytes that are not UTF-8 replaced by U+FFFD).
pub async fn detokenize(State(app): State<AppState>, body: Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        let b: DetokenizeBody = serde_json::from_value(object(&body)?).map_err(parse_err)?;
        let text = text_model(&app)?;
        let n = text.vocab.n_tokens();
        if let Some(id) = b.tokens.iter().find(|&&id| id as usize >= n) {
            return Err(ApiError::bad(
                "tokens",
                format!("token id {id} is not in the vocabulary of {n} tokens"),
            ));
        }
        Ok(json!({"content": text.vocab.detokenize(&b.tokens)}))
    };
    match run() {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_of_every_shape_parse() {
        let one = parse_embeddings(br#"{"input": "hi", "model": "m"}"#).unwrap();
        assert_eq!(one.inputs.len(), 1);
        assert_eq!(one.encoding, Encoding::Float);
        let many = parse_embeddings(br#"{"input": ["a", "b", "c"], "encoding_format": "base64"}"#).unwrap();
        assert_eq!(many.inputs.len(), 3);
        assert_eq!(many.encoding, Encoding::Base64);
        let ids = parse_embeddings(br#"{"input": [1, 2, 3]}"#).unwrap();
        assert!(matches!(&ids.inputs[..], [Input1::Tokens(t)] if t == &[1, 2, 3]));
        let lists = parse_embeddings(br#"{"input": [[1], [2, 3]]}"#).unwrap();
        assert_eq!(lists.inputs.len(), 2);
    }

    #[test]
    fn bad_requests_name_the_parameter() {
        for (body, param) in [
            (&br#"{"model": "m"}"#[..], "input"),
            (br#"{"input": []}"#, "input"),
            (br#"{"input": {"text": "x"}}"#, "input"),
            (br#"{"input": [1.5]}"#, "input"),
            (br#"{"input": "x", "dimensions": 64}"#, "dimensions"),
            (br#"{"input": "x", "encoding_format": "int8"}"#, "encoding_format"),
        ] {
            let e = parse_embeddings(body).err().expect("refused");
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.param, Some(param), "{}: {}", String::from_utf8_lossy(body), e.message);
            assert!(!e.message.contains("untagged"), "{}", e.message);
        }
        let too_many = format!(r#"{{"input": [{}]}}"#, vec!["\"x\""; MAX_INPUTS + 1].join(","));
        assert_eq!(
            parse_embeddings(too_many.as_bytes()).err().unwrap().param,
            Some("input")
        );
    }

    #[test]
    fn unit_length_scales_and_keeps_zero() {
        let v = unit_length(vec![3.0, 4.0]);
        assert!((v[0] - 0.6).abs() < 1e-6 && (v[1] - 0.8).abs() < 1e-6);
        assert_eq!(unit_length(vec![0.0; 3]), vec![0.0; 3]);
    }

    #[test]
    fn base64_is_little_endian_f32() {
        let Value::String(s) = encode(&[1.0, -2.5], Encoding::Base64) else {
            panic!("not a string")
        };
        let bytes = base64::engine::general_purpose::STANDARD.decode(s).unwrap();
        assert_eq!(bytes, [1.0f32.to_le_bytes(), (-2.5f32).to_le_bytes()].concat());
    }
}
