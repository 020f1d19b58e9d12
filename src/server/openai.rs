//! The OpenAI wire format: request bodies (parsed and validated into a [`Request`]), response bodies and stream
//! chunks, and the error object. Unknown fields are ignored (clients send many optional ones); fields we accept are
//! type-checked, and values we cannot honour are refused with a 400 that names the parameter.

use super::reasoning::{ReasoningFormat, ReasoningSplit};
use super::tools::{self, Tools};
use crate::chat::{ChatExtras, ChatMessage, TemplateKwargs, ThinkTags};
use crate::constrain::Constraint;
use crate::engine::sampler::{SamplerField, SamplerParams};
use crate::generate::{Finish, GenParams, Outcome, Piece, Prompt};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with its HTTP status.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
        }
    }
    pub fn bad(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param),
            ..ApiError::new(StatusCode::BAD_REQUEST, message)
        }
    }
    pub fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            404 if self.code == Some("model_not_found") => "invalid_request_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        r
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StopSpec {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
struct MessageIn {
    role: String,
    content: Option<Content>,
    tool_calls: Option<Vec<ToolCallIn>>,
    tool_call_id: Option<String>,
    name: Option<String>,
    /// An assistant turn's reasoning, as this server returned it (vLLM's newer name: `reasoning`).
    #[serde(alias = "reasoning")]
    reasoning_content: Option<String>,
}

#[derive(Deserialize)]
struct ToolCallIn {
    id: Option<String>,
    function: FunctionIn,
}

#[derive(Deserialize)]
struct FunctionIn {
    name: String,
    arguments: String,
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptIn {
    One(String),
    Many(Vec<String>),
}

/// Fields shared by both endpoints.
#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    /// llama.cpp's extensions, checked like the CLI's flags.
    min_p: Option<f64>,
    top_k: Option<i64>,
    repeat_penalty: Option<f64>,
    seed: Option<i64>,
    stop: Option<StopSpec>,
    n: Option<i64>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema", "strict"}}`.
    response_format: Option<Value>,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<MessageIn>,
    max_completion_tokens: Option<i64>,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    /// Variables for the chat template (vLLM's, SGLang's and llama.cpp's field), e.g. `{"enable_thinking": false}`.
    chat_template_kwargs: Option<Value>,
    /// `none`, `deepseek` or `auto` (llama.cpp's field): whether a think block goes to `reasoning_content`.
    reasoning_format: Option<String>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: PromptIn,
    logprobs: Option<i64>,
    echo: Option<bool>,
    suffix: Option<String>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// A validated request, ready to be queued.
#[derive(Clone, Debug)]
pub struct Request {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub prompt: Prompt,
    pub stream: bool,
    pub include_usage: bool,
    /// Explicit `max_tokens`; `None` means "until the context is full".
    pub max_tokens: Option<usize>,
    pub sampler: SamplerParams,
    /// Chat: `logprobs: true` (with `top_logprobs` alternatives); completions: `logprobs: N`.
    pub logprobs: Option<usize>,
    pub stops: Vec<String>,
    /// The grammar the output must follow (`response_format`, or a forced tool call).
    pub constraint: Option<Constraint>,
    /// Tools the model may call (chat with `tools` and a `tool_choice` other than none).
    pub tools: Option<Tools>,
    /// The request's `reasoning_format` (`None`: the server's).
    pub reasoning: Option<ReasoningFormat>,
}

/// What the server sets for chat requests that do not say (`baton serve --chat-template-kwargs`,
/// `--reasoning-format`).
#[derive(Clone, Debug, Default)]
pub struct ChatDefaults {
    pub kwargs: TemplateKwargs,
    pub reasoning: ReasoningFormat,
}

impl Request {
    /// Fills in the server's defaults: its template variables under the request's own, its reasoning format when the
    /// request names none.
    pub fn with_defaults(mut self, d: &ChatDefaults) -> Request {
        if self.endpoint != Endpoint::Chat {
            return self;
        }
        self.reasoning = self.reasoning.or(Some(d.reasoning));
        if !d.kwargs.is_empty() {
            let (msgs, extras) = match self.prompt {
                Prompt::Chat(m) => (m, ChatExtras::default()),
                Prompt::ChatWith(m, e) => (m, std::sync::Arc::unwrap_or_clone(e)),
                Prompt::Text(_) => return self,
            };
            let mut extras = extras;
            for (k, v) in &d.kwargs {
                extras.kwargs.entry(k.clone()).or_insert_with(|| v.clone());
            }
            self.prompt = Prompt::ChatWith(msgs, std::sync::Arc::new(extras));
        }
        self
    }

    /// Whether the reply's think block is to be split off (a chat request whose format is not `none`).
    pub fn splits_reasoning(&self) -> bool {
        self.endpoint == Endpoint::Chat && self.reasoning.unwrap_or_default() != ReasoningFormat::None
    }

    pub fn gen_params(&self, max_tokens: usize) -> GenParams {
        GenParams {
            max_tokens,
            sampler: self.sampler,
            top_logprobs: self.logprobs.unwrap_or(0),
            constraint: self.constraint.clone(),
            request_id: String::new(),
        }
    }

    /// The prefix-affinity key: the prompt as a string that grows the way the conversation does (a chat's next
    /// turn starts with the previous turn's key plus the reply), independent of the model's template.
    pub fn affinity_key(&self) -> String {
        match (&self.prompt, self.prompt.chat()) {
            (Prompt::Text(t), _) => format!("\u{2}{t}"),
            (_, None) => String::new(),
            (_, Some((msgs, _))) => {
                let mut k = String::from("\u{1}");
                for m in msgs {
                    k.push_str(&m.role);
                    k.push('\u{1f}');
                    k.push_str(&m.content);
                    k.push('\u{1e}');
                }
                k.push_str("assistant\u{1f}");
                k
            }
        }
    }
}

pub(super) fn parse_err(e: serde_json::Error) -> ApiError {
    if e.is_syntax() || e.is_eof() {
        ApiError::new(StatusCode::BAD_REQUEST, format!("the body is not valid JSON: {e}"))
    } else {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("invalid request: {}", plain(&e.to_string())),
        )
    }
}

/// serde's message in the API's words: no Rust type names (`i64`, `untagged enum PromptIn`) reach a client.
fn plain(msg: &str) -> String {
    const ENUMS: [(&str, &str); 3] = [
        ("PromptIn", "prompt must be a string or an array of one string"),
        ("StopSpec", "stop must be a string or an array of strings"),
        ("Content", "message content must be a string or an array of text parts"),
    ];
    if let Some(rest) = msg.split_once("untagged enum ").map(|(_, r)| r) {
        let name = rest.split(|c: char| !c.is_alphanumeric()).next().unwrap_or("");
        return ENUMS
            .iter()
            .find(|(n, _)| *n == name)
            .map_or("a field has the wrong type", |(_, m)| m)
            .to_string();
    }
    let mut out = msg.to_string();
    for (rust, words) in [
        ("f64", "a number"),
        ("f32", "a number"),
        ("i64", "an integer"),
        ("u64", "a non-negative integer"),
        ("u32", "a non-negative integer"),
        ("usize", "a non-negative integer"),
    ] {
        out = out.replace(&format!("expected {rust}"), &format!("expected {words}"));
    }
    if let Some((head, _)) = out.split_once("expected struct ") {
        out = format!("{head}expected an object");
    }
    out
}

/// Rejects a body that is not a JSON object before field parsing, with a clear message.
pub(super) fn object(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(parse_err)?;
    if !v.is_object() {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "the body must be a JSON object"));
    }
    Ok(v)
}

pub fn parse_chat(body: &[u8]) -> Result<Request, ApiError> {
    let b: ChatBody = serde_json::from_value(object(body)?).map_err(parse_err)?;
    if b.messages.is_empty() {
        return Err(ApiError::bad("messages", "messages must not be empty"));
    }
    let mut msgs: Vec<ChatMessage> = Vec::with_capacity(b.messages.len());
    for m in b.messages {
        let role = match m.role.as_str() {
            "developer" => "system",
            r @ ("system" | "user" | "assistant" | "tool") => r,
            r => return Err(ApiError::bad("messages", format!("unknown message role {r:?}"))),
        };
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => s.push_str(&t),
                        (k, _) => {
                            return Err(ApiError::bad(
                                "messages",
                                format!("content parts of type {k:?} are not supported (text only)"),
                            ));
                        }
                    }
                }
                s
            }
        };
        let mut msg = ChatMessage::new(role, content);
        msg.reasoning_content = m.reasoning_content.filter(|_| role == "assistant");
        if let Some(calls) = m.tool_calls.filter(|c| !c.is_empty()) {
            if role != "assistant" {
                return Err(ApiError::bad("messages", "only assistant messages carry tool_calls"));
            }
            let mut hf = Vec::with_capacity(calls.len());
            for c in calls {
                let args: Value = serde_json::from_str(&c.function.arguments).map_err(|_| {
                    ApiError::bad("messages", "a tool call's arguments must be a JSON object in a string")
                })?;
                hf.push(json!({"id": c.id, "type": "function",
                               "function": {"name": c.function.name, "arguments": args}}));
            }
            msg.tool_calls = Some(Value::Array(hf));
        }
        if role == "tool" {
            // The function's name, from the call this message answers (templates and the generic form show it).
            let by_id = m.tool_call_id.as_ref().and_then(|id| {
                msgs.iter()
                    .rev()
                    .filter_map(|p| p.tool_calls.as_ref()?.as_array())
                    .flatten()
                    .find(|c| c["id"].as_str() == Some(id.as_str()))
                    .and_then(|c| c["function"]["name"].as_str().map(String::from))
            });
            msg.name = m.name.or(by_id);
            msg.tool_call_id = m.tool_call_id;
        }
        msgs.push(msg);
    }
    let tools = Tools::parse(b.tools, b.tool_choice).map_err(|(p, m)| ApiError::bad(p, m))?;
    let top = match (b.logprobs, b.top_logprobs) {
        (_, Some(n)) if !(0..=20).contains(&n) => {
            return Err(ApiError::bad("top_logprobs", "top_logprobs must be between 0 and 20"));
        }
        (Some(true), n) => Some(n.unwrap_or(0) as usize),
        _ => None,
    };
    let max = b.max_completion_tokens.or(b.common.max_tokens);
    let param = if b.max_completion_tokens.is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let kwargs = match b.chat_template_kwargs.filter(|v| !v.is_null()) {
        None => TemplateKwargs::new(),
        Some(v) => crate::chat::template_kwargs(&v)
            .map_err(|m| ApiError::bad("chat_template_kwargs", format!("chat_template_kwargs {m}")))?,
    };
    let reasoning = match b.reasoning_format.as_deref() {
        None => None,
        Some(f) => Some(ReasoningFormat::parse(f).ok_or_else(|| {
            ApiError::bad(
                "reasoning_format",
                format!("reasoning_format must be \"none\", \"deepseek\" or \"auto\", got {f:?}"),
            )
        })?),
    };
    let extras = ChatExtras {
        tools: tools.as_ref().filter(|t| t.active()).map(|t| t.defs.clone()),
        kwargs,
    };
    let prompt = if extras == ChatExtras::default() {
        Prompt::Chat(msgs)
    } else {
        Prompt::ChatWith(msgs, std::sync::Arc::new(extras))
    };
    let mut r = common(Endpoint::Chat, b.common, prompt, max, param, top)?;
    r.reasoning = reasoning;
    if let Some(t) = tools.filter(|t| t.active()) {
        if let Some(c) = t.constraint().map_err(|(p, m)| ApiError::bad(p, m))? {
            if r.constraint.is_some() {
                return Err(ApiError::bad(
                    "response_format",
                    "response_format cannot be combined with a forced tool call (tool_choice required or named)",
                ));
            }
            r.constraint = Some(c);
        }
        r.tools = Some(t);
    }
    Ok(r)
}

/// The constraint of a `response_format` (`None` for plain text).
fn response_format(v: Option<Value>) -> Result<Option<Constraint>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = |m: String| ApiError::bad("response_format", m);
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::json_object())),
        Some("json_schema") => {
            let js = v
                .get("json_schema")
                .ok_or_else(|| bad("json_schema response_format needs a json_schema object".into()))?;
            let schema = js
                .get("schema")
                .ok_or_else(|| bad("json_schema.schema is missing".into()))?;
            Constraint::schema(schema)
                .map(Some)
                .map_err(|e| bad(format!("json_schema.schema: {} (keyword {:?})", e.message, e.keyword)))
        }
        _ => Err(bad(
            "response_format.type must be \"text\", \"json_object\" or \"json_schema\"".into(),
        )),
    }
}

pub fn parse_completion(body: &[u8]) -> Result<Request, ApiError> {
    let b: CompletionBody = serde_json::from_value(object(body)?).map_err(parse_err)?;
    let prompt = match b.prompt {
        PromptIn::One(s) => s,
        PromptIn::Many(mut v) if v.len() == 1 => v.remove(0),
        PromptIn::Many(_) => {
            return Err(ApiError::bad("prompt", "only one prompt per request is supported"));
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::bad("prompt", "the prompt is empty"));
    }
    if b.echo == Some(true) {
        return Err(ApiError::bad("echo", "echo is not supported"));
    }
    if b.suffix.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad("suffix", "suffix is not supported"));
    }
    let top = match b.logprobs {
        Some(n) if !(0..=20).contains(&n) => {
            return Err(ApiError::bad("logprobs", "logprobs must be between 0 and 20"));
        }
        Some(n) => Some(n as usize),
        None => None,
    };
    let max = b.common.max_tokens;
    common(
        Endpoint::Completion,
        b.common,
        Prompt::Text(prompt),
        max,
        "max_tokens",
        top,
    )
}

fn common(
    endpoint: Endpoint,
    c: Common,
    prompt: Prompt,
    max_tokens: Option<i64>,
    max_param: &'static str,
    logprobs: Option<usize>,
) -> Result<Request, ApiError> {
    if let Some(n) = c.n
        && n != 1
    {
        return Err(ApiError::bad("n", "only n = 1 is supported"));
    }
    let max_tokens = match max_tokens {
        Some(m) if m <= 0 => {
            return Err(ApiError::bad(
                max_param,
                format!("{max_param} must be at least 1, got {m}"),
            ));
        }
        Some(m) => Some(m as usize),
        None => None,
    };
    let temp = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temp) {
        return Err(ApiError::bad("temperature", "temperature must be between 0 and 2"));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&top_p) {
        return Err(ApiError::bad("top_p", "top_p must be between 0 and 1"));
    }
    let top_k = match c.top_k {
        Some(k) if k < 0 => return Err(ApiError::bad("top_k", format!("top_k must be at least 0, got {k}"))),
        Some(k) => k as usize,
        None => 0,
    };
    let sampler = SamplerParams {
        temp: temp as f32,
        top_k,
        top_p: top_p as f32,
        min_p: c.min_p.unwrap_or(0.0) as f32,
        repeat_penalty: c.repeat_penalty.unwrap_or(1.0) as f32,
        repeat_last_n: if c.repeat_penalty.is_some() { 64 } else { 0 },
        seed: c.seed.map(|s| s as u64),
    };
    sampler
        .check(SamplerField::json)
        .map_err(|(f, m)| ApiError::bad(f.json(), m))?;
    let stops = match c.stop {
        None => Vec::new(),
        Some(StopSpec::One(s)) => vec![s],
        Some(StopSpec::Many(v)) => v,
    };
    if stops.len() > 16 || stops.iter().any(|s| s.len() > 256) {
        return Err(ApiError::bad(
            "stop",
            "at most 16 stop strings of at most 256 bytes each",
        ));
    }
    let constraint = response_format(c.response_format)?;
    Ok(Request {
        endpoint,
        constraint,
        tools: None,
        reasoning: None,
        model: c.model,
        prompt,
        stream: c.stream.unwrap_or(false),
        include_usage: c.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
        max_tokens,
        sampler,
        logprobs,
        stops,
    })
}

/// Why a completion ended, in OpenAI's words.
pub fn finish_reason(finish: Finish, stop_matched: bool) -> &'static str {
    match finish {
        _ if stop_matched => "stop",
        Finish::Eog | Finish::Stopped => "stop",
        Finish::Length | Finish::ContextFull => "length",
    }
}

/// Builds response bodies and stream chunks for one request.
pub struct Responder {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub logprobs: Option<usize>,
    /// Bytes of completion text so far (completions' `text_offset`).
    offset: usize,
    /// Tools the reply may call: its text is held back until the end, then sent as calls or as content.
    tools: Option<Tools>,
    held: Vec<Piece>,
    /// The split of a thinking model's reply, once the job said the reply may hold a think block.
    reasoning: Option<ReasoningSplit>,
    /// With the split: the answer held back for tool calls, and the pieces whose log-probabilities have not gone
    /// out yet (they go with the next chunk sent).
    held_text: String,
    lp_wait: Vec<Piece>,
}

fn bytes_of(s: &str) -> Value {
    json!(s.as_bytes())
}

impl Responder {
    pub fn new(endpoint: Endpoint, model: &str, logprobs: Option<usize>) -> Responder {
        let n: u64 = rand::random::<u64>() & 0xffff_ffff_ffff;
        let prefix = if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
        Responder {
            endpoint,
            id: format!("{prefix}-{n:012x}"),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: model.to_string(),
            logprobs,
            offset: 0,
            tools: None,
            held: Vec::new(),
            reasoning: None,
            held_text: String::new(),
            lp_wait: Vec::new(),
        }
    }

    /// The reply may open a think block with `tags` (`prompt_opens`: it starts inside one): from now on its
    /// reasoning goes to `reasoning_content`. A chat reply only, set once (a retried job says it again).
    pub fn think(&mut self, tags: ThinkTags, prompt_opens: bool) {
        if self.endpoint == Endpoint::Chat && self.reasoning.is_none() {
            self.reasoning = Some(ReasoningSplit::new(tags, prompt_opens));
        }
    }

    /// A chat reply that may call `tools`.
    pub fn with_tools(mut self, tools: Option<Tools>) -> Responder {
        self.tools = tools.filter(|t| t.active());
        self
    }

    /// The calls in a reply, when tools were offered and it made some.
    fn calls(&self, text: &str) -> Option<(String, Vec<tools::Call>)> {
        self.tools.as_ref()?.parse_calls(text)
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    /// The `logprobs` object of a choice for these pieces (`null` when not asked for).
    fn logprobs_of(&mut self, pieces: &[Piece]) -> Value {
        if self.logprobs.is_none() {
            return Value::Null;
        }
        match self.endpoint {
            Endpoint::Chat => {
                let content: Vec<Value> = pieces
                    .iter()
                    .map(|p| {
                        let top: Vec<Value> = p
                            .top
                            .iter()
                            .map(|(t, l)| json!({"token": t, "logprob": l, "bytes": bytes_of(t)}))
                            .collect();
                        json!({"token": p.text, "logprob": p.logprob.unwrap_or(0.0), "bytes": bytes_of(&p.text),
                               "top_logprobs": top})
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Endpoint::Completion => {
                let (mut tokens, mut lps, mut tops, mut offs) = (vec![], vec![], vec![], vec![]);
                for p in pieces {
                    tokens.push(json!(p.text));
                    lps.push(json!(p.logprob));
                    let m: serde_json::Map<String, Value> = p.top.iter().map(|(t, l)| (t.clone(), json!(l))).collect();
                    tops.push(Value::Object(m));
                    offs.push(json!(self.offset));
                    self.offset += p.text.len();
                }
                json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
            }
        }
    }

    fn usage(o: &Outcome) -> Value {
        json!({"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
               "total_tokens": o.prompt_tokens + o.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": o.cached_tokens}})
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({"id": self.id, "object": self.object(chunk), "created": self.created, "model": self.model,
               "system_fingerprint": "baton", "choices": choices})
    }

    /// The whole response of a non-streaming request.
    pub fn full(&mut self, pieces: &[Piece], finish: &str, o: &Outcome) -> Value {
        let text: String = pieces.iter().map(|p| p.text.as_str()).collect();
        let (reasoning, text) = match self.reasoning.take() {
            Some(split) => split.split_all(&text),
            None => (None, text),
        };
        let lp = self.logprobs_of(pieces);
        let mut choice = match (self.endpoint, self.calls(&text)) {
            (Endpoint::Chat, Some((rest, calls))) => {
                let content = if rest.is_empty() { Value::Null } else { json!(rest) };
                json!({"index": 0, "message": {"role": "assistant", "content": content, "refusal": null,
                                               "tool_calls": tools::tool_calls_json(&calls, false)},
                       "logprobs": lp, "finish_reason": "tool_calls"})
            }
            (Endpoint::Chat, None) => {
                json!({"index": 0, "message": {"role": "assistant", "content": text, "refusal": null},
                       "logprobs": lp, "finish_reason": finish})
            }
            (Endpoint::Completion, _) => json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}),
        };
        if let Some(r) = reasoning {
            choice["message"]["reasoning_content"] = json!(r);
        }
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = Self::usage(o);
        v
    }

    /// The first chunk of a chat stream: the role.
    pub fn role_chunk(&self) -> Option<Value> {
        (self.endpoint == Endpoint::Chat).then(|| {
            self.envelope(
                true,
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": null, "finish_reason": null}]),
            )
        })
    }

    /// The chunks one piece of text makes: none while a reply that may call tools is held back (or while the
    /// reasoning split holds text that may be a tag), else its text as content, reasoning, or both in turn.
    pub fn piece_chunk(&mut self, p: &Piece) -> Vec<Value> {
        if let Some(split) = self.reasoning.as_mut() {
            let s = split.push(&p.text);
            self.lp_wait.push(p.clone());
            return self.split_chunks(s);
        }
        if self.tools.is_some() {
            self.held.push(p.clone());
            return Vec::new();
        }
        vec![self.text_chunk(p)]
    }

    /// Chunks of a step of the reasoning split: a `reasoning_content` delta, then a `content` delta (held back
    /// instead when tools may be called).
    fn split_chunks(&mut self, s: super::reasoning::Split) -> Vec<Value> {
        let mut out = Vec::new();
        if !s.reasoning.is_empty() {
            out.push(self.delta_chunk(json!({"reasoning_content": s.reasoning})));
        }
        if !s.content.is_empty() {
            if self.tools.is_some() {
                self.held_text.push_str(&s.content);
            } else {
                out.push(self.delta_chunk(json!({"content": s.content})));
            }
        }
        out
    }

    /// A chat chunk with `delta`, carrying the log-probabilities of the pieces not yet reported.
    fn delta_chunk(&mut self, delta: Value) -> Value {
        let pieces = std::mem::take(&mut self.lp_wait);
        let lp = self.logprobs_of(&pieces);
        self.envelope(
            true,
            json!([{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": null}]),
        )
    }

    fn text_chunk(&mut self, p: &Piece) -> Value {
        let lp = self.logprobs_of(std::slice::from_ref(p));
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({"index": 0, "delta": {"content": p.text}, "logprobs": lp, "finish_reason": null})
            }
            Endpoint::Completion => json!({"index": 0, "text": p.text, "logprobs": lp, "finish_reason": null}),
        };
        self.envelope(true, json!([choice]))
    }

    /// The chunks that close the choice: a held-back reply (as tool-call deltas, or as its text), then the finish
    /// reason.
    pub fn finish_chunks(&mut self, finish: &str) -> Vec<Value> {
        if let Some(mut split) = self.reasoning.take() {
            let mut out = self.split_chunks(split.finish());
            let text = std::mem::take(&mut self.held_text);
            let mut finish = finish;
            match self.calls(&text) {
                Some((rest, calls)) => {
                    let content = if rest.is_empty() { Value::Null } else { json!(rest) };
                    let delta = json!({"content": content, "tool_calls": tools::tool_calls_json(&calls, true)});
                    out.push(self.delta_chunk(delta));
                    finish = "tool_calls";
                }
                None if !text.is_empty() => out.push(self.delta_chunk(json!({"content": text}))),
                None => {}
            }
            let lp = std::mem::take(&mut self.lp_wait);
            let mut end = self.finish_chunk(finish);
            if !lp.is_empty() && self.logprobs.is_some() {
                end["choices"][0]["logprobs"] = self.logprobs_of(&lp);
            }
            out.push(end);
            return out;
        }
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return vec![self.finish_chunk(finish)];
        }
        let text: String = held.iter().map(|p| p.text.as_str()).collect();
        match self.calls(&text) {
            Some((rest, calls)) => {
                let content = if rest.is_empty() { Value::Null } else { json!(rest) };
                let delta = json!([{"index": 0, "delta": {"content": content,
                                    "tool_calls": tools::tool_calls_json(&calls, true)},
                                    "logprobs": null, "finish_reason": null}]);
                vec![self.envelope(true, delta), self.finish_chunk("tool_calls")]
            }
            None => {
                let lp = self.logprobs_of(&held);
                let whole = json!([{"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": null}]);
                vec![self.envelope(true, whole), self.finish_chunk(finish)]
            }
        }
    }

    fn finish_chunk(&self, finish: &str) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish}),
            Endpoint::Completion => json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish}),
        };
        self.envelope(true, json!([choice]))
    }

    /// The final usage chunk (`stream_options.include_usage`): no choices, the usage.
    pub fn usage_chunk(&self, o: &Outcome) -> Value {
        let mut v = self.envelope(true, json!([]));
        v["usage"] = Self::usage(o);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_request_parses_and_validates() {
        let r = parse_chat(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
                 "max_completion_tokens":5,"stop":"x","logprobs":true,"top_logprobs":2,"seed":3,"temperature":0,
                 "stream":true,"stream_options":{"include_usage":true},"user":"ignored"}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.stops, vec!["x"]);
        assert_eq!(r.logprobs, Some(2));
        assert!(r.stream && r.include_usage);
        assert_eq!(r.sampler.seed, Some(3));
        assert!(r.affinity_key().contains("user\u{1f}hi"));
    }

    #[test]
    fn bad_inputs_are_400_with_the_parameter() {
        for (body, param) in [
            (
                &br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":0}"#[..],
                Some("max_tokens"),
            ),
            (
                br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":"5"}"#,
                None,
            ),
            (br#"{"messages":[]}"#, Some("messages")),
            (
                br#"{"messages":[{"role":"user","content":"hi"}],"temperature":3}"#,
                Some("temperature"),
            ),
            (br#"{"messages":[{"role":"user","content":"hi"}],"n":2}"#, Some("n")),
            (br#"{"messages":[{"role":"user","content":"hi"}"#, None),
            (br#"[1,2]"#, None),
        ] {
            let e = parse_chat(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(body));
            assert_eq!(e.param, param, "{}", e.message);
        }
        for (field, body) in [
            ("min_p", r#""min_p":1.5"#),
            ("min_p", r#""min_p":-0.5"#),
            ("top_p", r#""top_p":1.5"#),
            ("temperature", r#""temperature":-1"#),
            ("repeat_penalty", r#""repeat_penalty":0"#),
            ("top_k", r#""top_k":-3"#),
        ] {
            let e = parse_completion(format!(r#"{{"prompt":"a",{body}}}"#).as_bytes()).unwrap_err();
            assert_eq!(
                (e.status, e.param),
                (StatusCode::BAD_REQUEST, Some(field)),
                "{}",
                e.message
            );
            assert!(e.message.starts_with(field), "{}", e.message);
        }
        // serde's wording without Rust type names.
        for body in [
            &br#"{"prompt":5}"#[..],
            br#"{"prompt":"a","max_tokens":1.5}"#,
            br#"{"prompt":"a","stop":7}"#,
            br#"{"prompt":"a","temperature":"hot"}"#,
            br#"{"prompt":"a","stream_options":3}"#,
        ] {
            let e = parse_completion(body).unwrap_err();
            for rust in ["PromptIn", "StopSpec", "i64", "f64", "struct", "enum"] {
                assert!(!e.message.contains(rust), "{}", e.message);
            }
        }
        assert!(parse_completion(br#"{"prompt":"a","logprobs":50}"#).is_err());
        assert!(parse_completion(br#"{"prompt":["a","b"]}"#).is_err());
        assert!(parse_completion(br#"{"prompt":"a","max_tokens":-1}"#).is_err());
    }

    #[test]
    fn completion_logprobs_have_offsets() {
        let mut r = Responder::new(Endpoint::Completion, "m", Some(1));
        let p = |t: &str| Piece {
            text: t.into(),
            token: Some(1),
            logprob: Some(-1.0),
            top: vec![(t.into(), -1.0)],
        };
        let o = Outcome {
            prompt_tokens: 3,
            cached_tokens: 1,
            completion_tokens: 2,
            finish: Finish::Length,
            t_prompt: Default::default(),
            t_gen: Default::default(),
            detail: vec![],
        };
        let v = r.full(&[p("ab"), p("c")], "length", &o);
        assert_eq!(v["choices"][0]["text"], "abc");
        assert_eq!(v["choices"][0]["logprobs"]["text_offset"], json!([0, 2]));
        assert_eq!(v["usage"]["total_tokens"], 5);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
    }

    #[test]
    fn response_format_and_tools_parse() {
        let r = parse_chat(
            br#"{"messages":[{"role":"user","content":"hi"}],
                 "response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"integer"}}}}"#,
        )
        .unwrap();
        assert!(r.constraint.is_some() && r.tools.is_none());
        let e = parse_completion(
            br#"{"prompt":"a","response_format":{"type":"json_schema","json_schema":
            {"schema":{"type":"string","format":"hostname"}}}}"#,
        )
        .unwrap_err();
        assert_eq!(e.param, Some("response_format"));
        assert!(e.message.contains("format"), "{}", e.message);
        let r = parse_chat(
            br#"{"messages":[{"role":"user","content":"add"},
                 {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
                   "function":{"name":"add","arguments":"{\"a\":1}"}}]},
                 {"role":"tool","tool_call_id":"c1","content":"2"}],
                 "tools":[{"type":"function","function":{"name":"add","parameters":{"type":"object"}}}],
                 "tool_choice":"required"}"#,
        )
        .unwrap();
        assert!(r.constraint.is_some());
        let Prompt::ChatWith(msgs, extras) = &r.prompt else {
            panic!("{:?}", r.prompt)
        };
        assert_eq!(extras.tools.as_ref().unwrap()[0]["function"]["name"], "add");
        assert_eq!(msgs[1].tool_calls.as_ref().unwrap()[0]["function"]["arguments"]["a"], 1);
        assert_eq!(msgs[2].name.as_deref(), Some("add"));
        // A forced call shapes the reply: tool_calls, finish_reason tool_calls.
        let mut resp = Responder::new(Endpoint::Chat, "m", None).with_tools(r.tools.clone());
        let piece = Piece {
            text: r#"{"name":"add","arguments":{"a":1,"b":2}}"#.into(),
            ..Default::default()
        };
        assert!(resp.piece_chunk(&piece).is_empty(), "held back");
        let chunks = resp.finish_chunks("stop");
        assert_eq!(
            chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"],
            "add"
        );
        assert_eq!(chunks[1]["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn template_kwargs_and_reasoning_fields_parse() {
        let r = parse_chat(
            br#"{"messages":[{"role":"user","content":"hi"},
                 {"role":"assistant","content":"A","reasoning_content":"because"},
                 {"role":"assistant","content":"B","reasoning":"why"},
                 {"role":"user","content":"more","reasoning_content":"ignored on a user turn"}],
                 "chat_template_kwargs":{"enable_thinking":false,"depth":{"a":[1,2]}},"reasoning_format":"none"}"#,
        )
        .unwrap();
        let Prompt::ChatWith(msgs, extras) = &r.prompt else {
            panic!("{:?}", r.prompt)
        };
        assert_eq!(extras.kwargs["enable_thinking"], json!(false));
        assert_eq!(extras.kwargs["depth"], json!({"a": [1, 2]}));
        assert!(extras.tools.is_none());
        let reasoning: Vec<Option<&str>> = msgs.iter().map(|m| m.reasoning_content.as_deref()).collect();
        assert_eq!(reasoning, [None, Some("because"), Some("why"), None]);
        assert_eq!(r.reasoning, Some(ReasoningFormat::None));
        assert!(!r.splits_reasoning());
        // The server's defaults: its variables under the request's, its format when the request names none.
        let d = ChatDefaults {
            kwargs: [
                ("enable_thinking".to_string(), json!(true)),
                ("x".to_string(), json!(1)),
            ]
            .into(),
            reasoning: ReasoningFormat::Deepseek,
        };
        let r = r.with_defaults(&d);
        let Prompt::ChatWith(_, extras) = &r.prompt else {
            panic!("{:?}", r.prompt)
        };
        assert_eq!(
            (&extras.kwargs["enable_thinking"], &extras.kwargs["x"]),
            (&json!(false), &json!(1))
        );
        assert_eq!(r.reasoning, Some(ReasoningFormat::None));
        let plain =
            parse_chat(br#"{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":null}"#).unwrap();
        assert!(matches!(plain.prompt, Prompt::Chat(_)), "{:?}", plain.prompt);
        let plain = plain.with_defaults(&d);
        assert!(plain.splits_reasoning());
        let Prompt::ChatWith(_, extras) = &plain.prompt else {
            panic!("{:?}", plain.prompt)
        };
        assert_eq!(extras.kwargs.len(), 2);
        // A completion is never split and takes no template variables.
        let c = parse_completion(br#"{"prompt":"a"}"#).unwrap().with_defaults(&d);
        assert!(!c.splits_reasoning() && matches!(c.prompt, Prompt::Text(_)));
    }

    #[test]
    fn bad_template_kwargs_and_reasoning_format_are_400() {
        for (extra, param, words) in [
            (
                r#""chat_template_kwargs":{"messages":[]}"#,
                "chat_template_kwargs",
                "cannot be overridden",
            ),
            (
                r#""chat_template_kwargs":{"add_generation_prompt":false}"#,
                "chat_template_kwargs",
                "reserved",
            ),
            (r#""chat_template_kwargs":{"tools":1}"#, "chat_template_kwargs", "tools"),
            (
                r#""chat_template_kwargs":{"eos_token":""}"#,
                "chat_template_kwargs",
                "eos_token",
            ),
            (r#""chat_template_kwargs":[1]"#, "chat_template_kwargs", "JSON object"),
            (
                r#""chat_template_kwargs":"enable_thinking""#,
                "chat_template_kwargs",
                "JSON object",
            ),
            (
                r#""chat_template_kwargs":{"a b":1}"#,
                "chat_template_kwargs",
                "identifier",
            ),
            (
                r#""reasoning_format":"deepseek-legacy""#,
                "reasoning_format",
                "\"none\", \"deepseek\" or \"auto\"",
            ),
        ] {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],{extra}}}"#);
            let e = parse_chat(body.as_bytes()).unwrap_err();
            assert_eq!(
                (e.status, e.param),
                (StatusCode::BAD_REQUEST, Some(param)),
                "{extra}: {}",
                e.message
            );
            assert!(e.message.contains(words), "{extra}: {}", e.message);
        }
        let big = format!(r#"{{"s":"{}"}}"#, "x".repeat(crate::chat::KWARGS_MAX_BYTES));
        let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],"chat_template_kwargs":{big}}}"#);
        assert_eq!(
            parse_chat(body.as_bytes()).unwrap_err().param,
            Some("chat_template_kwargs")
        );
    }

    fn outcome(n: usize) -> Outcome {
        Outcome {
            prompt_tokens: 3,
            cached_tokens: 0,
            completion_tokens: n,
            finish: Finish::Eog,
            t_prompt: Default::default(),
            t_gen: Default::default(),
            detail: vec![],
        }
    }

    fn pieces(texts: &[&str]) -> Vec<Piece> {
        texts
            .iter()
            .map(|t| Piece {
                text: t.to_string(),
                token: Some(1),
                logprob: Some(-0.5),
                top: vec![],
            })
            .collect()
    }

    const REPLY: [&str; 7] = ["<think>", "\nadd", " them", "\n</think>", "\n\n", "Four", "."];

    #[test]
    fn reasoning_is_split_off_whole_replies() {
        let ps = pieces(&REPLY);
        let mut r = Responder::new(Endpoint::Chat, "m", Some(0));
        r.think(ThinkTags::default(), false);
        let v = r.full(&ps, "stop", &outcome(ps.len()));
        let msg = &v["choices"][0]["message"];
        assert_eq!(
            (msg["reasoning_content"].as_str(), msg["content"].as_str()),
            (Some("add them"), Some("Four."))
        );
        assert_eq!(v["usage"]["completion_tokens"], 7);
        assert_eq!(v["choices"][0]["logprobs"]["content"].as_array().unwrap().len(), 7);
        // Without the job's word (format none, a completion), the reply is untouched.
        let v = Responder::new(Endpoint::Chat, "m", None).full(&ps, "stop", &outcome(7));
        assert_eq!(v["choices"][0]["message"]["content"], REPLY.concat());
        assert!(v["choices"][0]["message"].get("reasoning_content").is_none());
        let mut c = Responder::new(Endpoint::Completion, "m", None);
        c.think(ThinkTags::default(), true);
        assert_eq!(c.full(&ps, "stop", &outcome(7))["choices"][0]["text"], REPLY.concat());
        // A reply without a block has no reasoning_content; a prompt that opened one makes it all reasoning.
        let mut r = Responder::new(Endpoint::Chat, "m", None);
        r.think(ThinkTags::default(), false);
        let v = r.full(&pieces(&["Hi", "!"]), "stop", &outcome(2));
        assert!(v["choices"][0]["message"].get("reasoning_content").is_none(), "{v}");
        let mut r = Responder::new(Endpoint::Chat, "m", None);
        r.think(ThinkTags::default(), true);
        let v = r.full(&pieces(&["\nhmm", " so"]), "length", &outcome(2));
        assert_eq!(v["choices"][0]["message"]["reasoning_content"], "hmm so");
        assert_eq!(v["choices"][0]["message"]["content"], "");
    }

    #[test]
    fn reasoning_is_split_off_streams() {
        let ps = pieces(&REPLY);
        let mut r = Responder::new(Endpoint::Chat, "m", Some(0));
        r.think(ThinkTags::default(), false);
        let mut chunks: Vec<Value> = ps.iter().flat_map(|p| r.piece_chunk(p)).collect();
        chunks.extend(r.finish_chunks("stop"));
        let field = |k: &str| -> String {
            chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"][k].as_str())
                .collect()
        };
        assert_eq!(
            (field("reasoning_content"), field("content")),
            ("add them".into(), "Four.".into())
        );
        // No delta carries both; every piece's log-probability is reported once.
        assert!(chunks.iter().all(|c| {
            let d = &c["choices"][0]["delta"];
            d.get("content").is_none() || d.get("reasoning_content").is_none()
        }));
        let lps: usize = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
            .map(Vec::len)
            .sum();
        assert_eq!(lps, 7);
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");

        // With tools: reasoning streams, the answer is held and parsed as a call.
        let r2 = parse_chat(
            br#"{"messages":[{"role":"user","content":"add"}],
                 "tools":[{"type":"function","function":{"name":"add","parameters":{"type":"object"}}}]}"#,
        )
        .unwrap();
        let mut resp = Responder::new(Endpoint::Chat, "m", None).with_tools(r2.tools.clone());
        resp.think(ThinkTags::default(), false);
        let call = r#"<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>"#;
        let mut chunks: Vec<Value> = pieces(&["<think>I will call.</think>\n", call])
            .iter()
            .flat_map(|p| resp.piece_chunk(p))
            .collect();
        assert_eq!(chunks.len(), 1, "{chunks:?}");
        assert_eq!(chunks[0]["choices"][0]["delta"]["reasoning_content"], "I will call.");
        chunks = resp.finish_chunks("stop");
        assert_eq!(
            chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"],
            "add"
        );
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
    }
}
