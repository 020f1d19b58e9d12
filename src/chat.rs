//! Chat templates: turn a conversation into the exact prompt text the model was trained on.
//!
//! A GGUF usually carries its Hugging Face Jinja template in `tokenizer.chat_template`; we render it with minijinja
//! configured like Hugging Face's `apply_chat_template` (trim_blocks, lstrip_blocks, `raise_exception`, Python
//! string methods such as `.strip()` via minijinja-contrib's pycompat). Some GGUFs (our Gemma 3) have no template:
//! then a built-in one is chosen by architecture, and [`ChatTemplate::source`] says which, so a user who gets odd
//! answers can see that the prompt format was guessed.

use anyhow::{Result, anyhow};
use minijinja::{Environment, Error, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

/// One message of a conversation (`role` is usually "system", "user" or "assistant"; "tool" for a tool's result).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's tool calls as Hugging Face templates read them: `[{id, type, function: {name, arguments}}]`
    /// with `arguments` an object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool message's call id and function name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant's reasoning (the text of its think block) given back apart from `content`, as OpenAI-compatible
    /// servers return it; thinking models' templates read it (Qwen 3 shows it for the turns of a running tool loop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// Template variables a caller sets beside the conversation (`chat_template_kwargs`, `--chat-template-kwargs`), such
/// as Qwen 3's `enable_thinking`.
pub type TemplateKwargs = BTreeMap<String, serde_json::Value>;

/// What a render reads besides the messages: the tool definitions (OpenAI's `tools` array) and the caller's
/// template variables.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatExtras {
    pub tools: Option<Arc<serde_json::Value>>,
    pub kwargs: TemplateKwargs,
}

/// Names a caller's template variables may not take: Baton's own render inputs and the functions templates call.
pub const RESERVED_KWARGS: [&str; 7] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "raise_exception",
    "strftime_now",
];

/// Most variables, bytes (as JSON) and nesting levels a caller's template variables may have: far above what a
/// template reads (a few flags), far below what would slow a render.
pub const KWARGS_MAX_KEYS: usize = 64;
pub const KWARGS_MAX_BYTES: usize = 16 * 1024;
pub const KWARGS_MAX_DEPTH: usize = 8;

/// Checks a caller's template variables: a JSON object of at most [`KWARGS_MAX_KEYS`] variables named like Jinja
/// identifiers, none of them [`RESERVED_KWARGS`], at most [`KWARGS_MAX_BYTES`] as JSON and [`KWARGS_MAX_DEPTH`]
/// levels deep. The error says what is wrong in one line.
pub fn template_kwargs(v: &serde_json::Value) -> Result<TemplateKwargs, String> {
    let serde_json::Value::Object(map) = v else {
        return Err("must be a JSON object of template variables, e.g. {\"enable_thinking\": false}".into());
    };
    if map.len() > KWARGS_MAX_KEYS {
        return Err(format!("has {} variables; at most {KWARGS_MAX_KEYS}", map.len()));
    }
    let bytes = v.to_string().len();
    if bytes > KWARGS_MAX_BYTES {
        return Err(format!("is {bytes} bytes as JSON; at most {KWARGS_MAX_BYTES}"));
    }
    for (k, x) in map {
        let mut chars = k.chars();
        let ident = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ident {
            return Err(format!(
                "variable {k:?} is not a template identifier (letters, digits, _)"
            ));
        }
        if RESERVED_KWARGS.contains(&k.as_str()) {
            return Err(format!(
                "variable {k:?} is set by Baton and cannot be overridden (reserved: {})",
                RESERVED_KWARGS.join(", ")
            ));
        }
        if depth(x) > KWARGS_MAX_DEPTH {
            return Err(format!("variable {k:?} nests deeper than {KWARGS_MAX_DEPTH} levels"));
        }
    }
    Ok(map.iter().map(|(k, x)| (k.clone(), x.clone())).collect())
}

/// Nesting levels of a JSON value (a scalar: 0).
fn depth(v: &serde_json::Value) -> usize {
    match v {
        serde_json::Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        serde_json::Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// The tags around a thinking model's reasoning (`<think>`…`</think>` for Qwen 3, QwQ and the DeepSeek R1 family).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThinkTags {
    pub open: String,
    pub close: String,
}

impl Default for ThinkTags {
    fn default() -> Self {
        ThinkTags {
            open: "<think>".into(),
            close: "</think>".into(),
        }
    }
}

impl ThinkTags {
    /// Pairs some model families use in place of `<think>`, as single tokens of their vocabularies.
    const KNOWN: [(&str, &str); 4] = [
        ("<think>", "</think>"),
        ("<|START_THINKING|>", "<|END_THINKING|>"),
        ("<seed:think>", "</seed:think>"),
        ("\u{25c1}think\u{25b7}", "\u{25c1}/think\u{25b7}"),
    ];

    /// The first known pair whose two tags are both tokens of the vocabulary (`is_token`), else `<think>`/`</think>`
    /// as plain text.
    pub fn from_vocab(is_token: impl Fn(&str) -> bool) -> ThinkTags {
        Self::KNOWN
            .iter()
            .find(|(o, c)| is_token(o) && is_token(c))
            .map_or_else(ThinkTags::default, |(o, c)| ThinkTags {
                open: (*o).into(),
                close: (*c).into(),
            })
    }

    /// Whether a rendered prompt leaves a think block open for the reply (DeepSeek R1's and QwQ's templates end the
    /// generation prompt with `<think>\n`): then the reply starts inside it.
    pub fn prompt_opens(&self, prompt: &str) -> bool {
        prompt.trim_end().ends_with(&self.open)
    }
}

/// How a template's model writes tool calls, read from the template's text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolStyle {
    /// `<tool_call>{"name": …, "arguments": …}</tool_call>` (Hermes, Qwen 2.5/3).
    Hermes,
    /// A bare `{"name": …, "parameters": …}` (Llama 3.1+).
    Llama3,
    /// The template renders `tools` its own way; calls are parsed by every known convention.
    Template,
    /// The template knows no tools: Baton describes them in a system message and asks for the Hermes form
    /// (docs/server.md).
    Generic,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Gemma's turn format, written after the official Gemma 3 template: no system role, so a system message is folded
/// into the first user turn; "assistant" is called "model"; roles must alternate. No BOS here: Gemma's GGUF sets
/// `tokenizer.ggml.add_bos_token`, so the tokenizer adds it.
const GEMMA: &str = r#"
{%- if messages and messages[0].role == 'system' -%}
  {%- set first_user_prefix = messages[0].content + '\n\n' -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set first_user_prefix = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if (message.role == 'user') != (loop.index0 % 2 == 0) -%}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {%- endif -%}
  {%- set role = 'model' if message.role == 'assistant' else message.role -%}
  {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + (message.content | trim) + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{ '<start_of_turn>model\n' }}
{%- endif -%}
"#;

/// ChatML, the most common format among models without a template of their own.
const CHATML: &str = r#"
{%- for message in messages -%}
  {{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{ '<|im_start|>assistant\n' }}
{%- endif -%}
"#;

const NAME: &str = "chat";

/// Instructions a template may run per render: far above what a real template needs for the largest conversation a
/// request can carry (about 30 per message), far below a hang (a few hundred milliseconds).
pub const TEMPLATE_FUEL: u64 = 20_000_000;

/// Brackets of the placeholders that stand for message contents in [`ChatTemplate::render_marked`] (Unicode
/// private-use characters: no template writes them).
const MARK_OPEN: char = '\u{F0000}';
const MARK_CLOSE: char = '\u{F0001}';

/// A compiled chat template plus the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: &'static str,
    bos: String,
    eos: String,
    /// The template refers to `bos_token`: only then can a leading BOS text be its doing (SmolLM2's BOS is
    /// `<|im_start|>`, which its template emits literally as the start of every turn).
    uses_bos: bool,
    tool_style: ToolStyle,
}

impl ChatTemplate {
    /// Compiles the GGUF's template if there is one (a syntax error is reported, not papered over with a
    /// fallback), else the built-in template for `arch`: Gemma's for the gemma family, ChatML otherwise.
    pub fn from_metadata(template: Option<&str>, arch: &str, bos: &str, eos: &str) -> Result<Self> {
        let (text, source) = match template.filter(|t| !t.trim().is_empty()) {
            Some(t) => (t.to_owned(), "gguf"),
            None if arch.starts_with("gemma") => (GEMMA.to_owned(), "built-in gemma"),
            None => (CHATML.to_owned(), "built-in chatml"),
        };
        let mut env = Environment::new();
        // Hugging Face renders chat templates with these two on; templates are written for them.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // A template is data from the model file: bounded like any other input.
        env.set_fuel(Some(TEMPLATE_FUEL));
        let uses_bos = text.contains("bos_token");
        let tool_style = if text.contains("<tool_call>") {
            ToolStyle::Hermes
        } else if text.contains("tools") && (text.contains("ipython") || text.contains("<|python_tag|>")) {
            ToolStyle::Llama3
        } else if text.contains("tools") {
            ToolStyle::Template
        } else {
            ToolStyle::Generic
        };
        env.add_template_owned(NAME, text)
            .map_err(|e| anyhow!("chat template ({source}) does not compile: {}", one_line(&e)))?;
        Ok(ChatTemplate {
            env,
            source,
            bos: bos.to_owned(),
            eos: eos.to_owned(),
            uses_bos,
            tool_style,
        })
    }

    /// Where the template came from: "gguf", "built-in gemma" or "built-in chatml".
    pub fn source(&self) -> &str {
        self.source
    }

    /// How this template's model writes tool calls.
    pub fn tool_style(&self) -> ToolStyle {
        self.tool_style
    }

    /// Renders the conversation exactly as the template says; with `add_generation_prompt` the text ends where the
    /// assistant's reply should begin.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, None, add_generation_prompt)
    }

    /// [`render`](Self::render) with the request's extras: its tool definitions (OpenAI's `tools` array), given to
    /// the template as `tools` with each entry's `function` (the Hugging Face convention), or, for a template
    /// without tool support, written into a system message ([`ToolStyle::Generic`]); and the caller's template
    /// variables (checked by [`template_kwargs`]), given beside Baton's own.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        extras: Option<&ChatExtras>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| anyhow!("chat template missing: {e}"))?;
        let tools = extras.and_then(|e| e.tools.as_deref());
        let generic;
        let messages = match tools {
            Some(t) if self.tool_style == ToolStyle::Generic => {
                generic = generic_tool_messages(messages, t);
                &generic[..]
            }
            _ => messages,
        };
        let kwargs = extras.map(|e| Value::from_serialize(&e.kwargs)).unwrap_or_default();
        tmpl.render(context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
            ..kwargs
        })
        .map_err(|e| match e.kind() {
            ErrorKind::OutOfFuel => anyhow!(
                "chat template ({}) gave up after {TEMPLATE_FUEL} steps: it loops without end or the conversation is \
                 far too long",
                self.source
            ),
            _ => anyhow!("chat template ({}) failed: {}", self.source, one_line(&e)),
        })
    }

    /// Renders like [`render_for_tokenizer`](Self::render_for_tokenizer) and also returns where each message's
    /// content (and reasoning) lies in the text, so the tokenizer can read them as plain text while the template's
    /// own markers stay control tokens. `None` for the spans when the template rewrites them beyond trimming (they
    /// then cannot be told apart from the template's text).
    pub fn render_marked(
        &self,
        messages: &[ChatMessage],
        extras: Option<&ChatExtras>,
        add_generation_prompt: bool,
        tokenizer_adds_bos: bool,
    ) -> Result<(String, Option<Vec<std::ops::Range<usize>>>)> {
        let text = self.render_for_tokenizer(messages, extras, add_generation_prompt, tokenizer_adds_bos)?;
        let marked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage {
                content: format!("{MARK_OPEN}{i}{MARK_CLOSE}"),
                reasoning_content: m
                    .reasoning_content
                    .as_ref()
                    .map(|_| format!("{MARK_OPEN}r{i}{MARK_CLOSE}")),
                ..m.clone()
            })
            .collect();
        let spans = match self.render_for_tokenizer(&marked, extras, add_generation_prompt, tokenizer_adds_bos) {
            Ok(with_marks) => content_spans(&text, &with_marks, messages),
            Err(_) => None,
        };
        Ok((text, spans))
    }

    /// Like [`render`](Self::render), but drops a leading BOS text when the tokenizer will add a BOS token itself,
    /// so the prompt does not start with two (many Hugging Face templates begin with `{{ bos_token }}`).
    pub fn render_for_tokenizer(
        &self,
        messages: &[ChatMessage],
        extras: Option<&ChatExtras>,
        add_generation_prompt: bool,
        tokenizer_adds_bos: bool,
    ) -> Result<String> {
        let text = self.render_with(messages, extras, add_generation_prompt)?;
        Ok(match text.strip_prefix(self.bos.as_str()) {
            Some(rest) if tokenizer_adds_bos && self.uses_bos && !self.bos.is_empty() => rest.to_owned(),
            _ => text,
        })
    }
}

/// The conversation for a template without tool support: the tools and the expected reply form in a system message
/// (added to the first one, or a new one first), earlier calls as `<tool_call>` text in the assistant's turn, and
/// tool results as user turns naming the tool.
fn generic_tool_messages(messages: &[ChatMessage], tools: &serde_json::Value) -> Vec<ChatMessage> {
    let list: Vec<String> = tools
        .as_array()
        .map(|a| a.iter().map(|t| t.get("function").unwrap_or(t).to_string()).collect())
        .unwrap_or_default();
    let intro = format!(
        "You can call these functions:\n{}\nTo call one, reply with only <tool_call>{{\"name\": NAME, \"arguments\": \
         {{...}}}}</tool_call>.",
        list.join("\n")
    );
    let mut out = Vec::with_capacity(messages.len() + 1);
    let mut rest = messages;
    match messages.first() {
        Some(m) if m.role == "system" => {
            out.push(ChatMessage::system(format!("{}\n\n{intro}", m.content)));
            rest = &messages[1..];
        }
        _ => out.push(ChatMessage::system(intro)),
    }
    for m in rest {
        let mut m = m.clone();
        if let Some(calls) = m.tool_calls.take().and_then(|c| c.as_array().cloned()) {
            for c in calls {
                let f = c.get("function").unwrap_or(&c);
                let call = serde_json::json!({"name": f.get("name"), "arguments": f.get("arguments")});
                m.content.push_str(&format!("<tool_call>{call}</tool_call>"));
            }
        }
        if m.role == "tool" {
            let name = m.name.take().unwrap_or_else(|| "tool".into());
            m = ChatMessage::user(format!("Result of {name}: {}", m.content));
        }
        out.push(m);
    }
    out
}

/// Walks `text` (the real render) beside `marked` (the render with placeholders for contents, `r`-prefixed for
/// reasoning): the template's text must agree exactly, and at each placeholder `text` must hold that message's
/// content (or reasoning), as is or trimmed. Returns their byte ranges in `text`, or `None` when the two renders do
/// not line up.
fn content_spans(text: &str, marked: &str, messages: &[ChatMessage]) -> Option<Vec<std::ops::Range<usize>>> {
    let (mut t, mut m) = (0, 0);
    let mut spans = Vec::new();
    while let Some(open) = marked[m..].find(MARK_OPEN).map(|o| m + o) {
        let lit = &marked[m..open];
        if !text[t..].starts_with(lit) {
            return None;
        }
        t += lit.len();
        let body = open + MARK_OPEN.len_utf8();
        let close = body + marked[body..].find(MARK_CLOSE)?;
        let mark = &marked[body..close];
        let content = match mark.strip_prefix('r') {
            Some(i) => messages.get(i.parse::<usize>().ok()?)?.reasoning_content.as_deref()?,
            None => messages.get(mark.parse::<usize>().ok()?)?.content.as_str(),
        };
        let found = [
            content,
            content.trim(),
            content.trim_start(),
            content.trim_end(),
            content.trim_matches('\n'),
        ]
        .into_iter()
        .find(|c| text[t..].starts_with(c))?;
        spans.push(t..t + found.len());
        t += found.len();
        m = close + MARK_CLOSE.len_utf8();
    }
    (text[t..] == marked[m..]).then_some(spans)
}

/// minijinja's error plus its detail, on one line.
fn one_line(e: &Error) -> String {
    let mut s = e.to_string();
    if let Some(d) = e.detail()
        && !s.contains(d)
    {
        s.push_str(": ");
        s.push_str(d);
    }
    s.replace('\n', " ")
}

/// `raise_exception(msg)`, which Hugging Face templates call to reject a conversation.
fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("template raised: {msg}"),
    ))
}

/// `tojson` as Hugging Face renders it (Python's `json.dumps(ensure_ascii=False)`): `", "` and `": "` separators and
/// no HTML escaping, so a tool definition reads as the model saw it in training (minijinja's own filter is compact
/// and escapes `<`, `>`, `&`, `'`). `indent=n` pretty-prints. Object keys come sorted (serde_json's map), where
/// Python keeps the request's order.
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let res = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
            serde::Serialize::serialize(&value, &mut serde_json::Serializer::with_formatter(&mut out, fmt))
        }
        None => serde::Serialize::serialize(&value, &mut serde_json::Serializer::with_formatter(&mut out, Spaced)),
    };
    res.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(String::from_utf8(out).unwrap_or_default()))
}

/// serde_json output with Python's default separators.
struct Spaced;

impl serde_json::ser::Formatter for Spaced {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// `strftime_now(fmt)` (Llama 3 templates put today's date in the system prompt). Supports the common directives
/// %Y %m %d %e %b %B %H %M %S %%, in UTC.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(&fmt, secs)
}

fn strftime(fmt: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix_secs.div_euclid(86_400);
    let tod = unix_secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let name = MONTHS[(month - 1) as usize];

    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tokenizer.chat_template` of SmolLM2-135M-Instruct.Q4_1.gguf, read with the python `gguf` package.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn smollm2() -> ChatTemplate {
        ChatTemplate::from_metadata(Some(SMOLLM2), "llama", "<|im_start|>", "<|im_end|>").unwrap()
    }

    fn gemma() -> ChatTemplate {
        ChatTemplate::from_metadata(None, "gemma3", "<bos>", "<eos>").unwrap()
    }

    #[test]
    fn smollm2_template_from_gguf() {
        let t = smollm2();
        assert_eq!(t.source(), "gguf");
        let out = t.render(&[ChatMessage::user("What is 2+2?")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        let convo = [
            ChatMessage::system("Be brief."),
            ChatMessage::user("Hi"),
            ChatMessage::assistant("Hello!"),
            ChatMessage::user("Bye"),
        ];
        assert_eq!(
            t.render(&convo, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        );
        // SmolLM2's BOS text is `<|im_start|>`, but the template never emits `bos_token`: nothing is stripped.
        let out = t
            .render_for_tokenizer(&[ChatMessage::user("x")], None, true, true)
            .unwrap();
        assert!(out.starts_with("<|im_start|>system\n"));
    }

    /// The embedded text is the real file's: `cargo test --lib -- --ignored chat_templates_of_cached_models`.
    #[test]
    #[ignore]
    fn chat_templates_of_cached_models() {
        let dir = crate::util::models_dir().unwrap();
        let smol = crate::gguf::GgufFile::open(&dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
        assert_eq!(smol.get_str("tokenizer.chat_template"), Some(SMOLLM2));
        let gemma = crate::gguf::GgufFile::open(&dir.join("gemma-3-270m-q4_k_m.gguf")).unwrap();
        let t = ChatTemplate::from_metadata(
            gemma.get_str("tokenizer.chat_template"),
            gemma.architecture().unwrap(),
            "<bos>",
            "<eos>",
        )
        .unwrap();
        assert_eq!(t.source(), "built-in gemma");
    }

    #[test]
    fn gemma_fallback() {
        let t = gemma();
        assert_eq!(t.source(), "built-in gemma");
        assert_eq!(
            t.render(&[ChatMessage::user("Hello")], true).unwrap(),
            "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
        );
        let convo = [
            ChatMessage::system("You are terse."),
            ChatMessage::user("  Hi  "),
            ChatMessage::assistant("Hello."),
            ChatMessage::user("Bye"),
        ];
        assert_eq!(
            t.render(&convo, true).unwrap(),
            "<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n\
             <start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            t.render(&[ChatMessage::user("Hello")], false).unwrap(),
            "<start_of_turn>user\nHello<end_of_turn>\n"
        );
        let err = t
            .render(&[ChatMessage::user("a"), ChatMessage::user("b")], true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("roles must alternate"), "{err}");
        assert!(!err.contains('\n'), "{err}");
        for arch in ["gemma", "gemma2", "gemma3"] {
            let t = ChatTemplate::from_metadata(Some("  "), arch, "<bos>", "<eos>").unwrap();
            assert_eq!(t.source(), "built-in gemma");
        }
    }

    #[test]
    fn chatml_fallback_for_other_architectures() {
        let t = ChatTemplate::from_metadata(None, "llama", "<s>", "</s>").unwrap();
        assert_eq!(t.source(), "built-in chatml");
        assert_eq!(
            t.render(&[ChatMessage::system("S"), ChatMessage::user("U")], true)
                .unwrap(),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn hugging_face_conventions() {
        // The official Gemma 3 template's opening: bos_token, is-string test, slicing, pycompat methods.
        let hf = "{{ bos_token }}{%- for m in messages -%}\n\
                  {%- if m['content'] is string -%}{{ m['content'].strip().upper() }}{%- endif -%}\n\
                  {%- if m.content.startswith(' ') %}!{% endif -%}\n\
                  {%- endfor %}{{ eos_token }}";
        let t = ChatTemplate::from_metadata(Some(hf), "gemma3", "<bos>", "<eos>").unwrap();
        assert_eq!(t.source(), "gguf");
        let msgs = [ChatMessage::user("  xy "), ChatMessage::user("ab")];
        assert_eq!(t.render(&msgs, false).unwrap(), "<bos>XY!AB<eos>");
        assert_eq!(t.render_for_tokenizer(&msgs, None, false, true).unwrap(), "XY!AB<eos>");
        assert_eq!(
            t.render_for_tokenizer(&msgs, None, false, false).unwrap(),
            "<bos>XY!AB<eos>"
        );

        // trim_blocks + lstrip_blocks: block tags leave no stray newlines or indentation.
        let blocks = "{% for m in messages %}\n    {% if true %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::from_metadata(Some(blocks), "llama", "", "").unwrap();
        assert_eq!(t.render(&msgs, false).unwrap(), "[  xy ]\n[ab]\n");

        let t = ChatTemplate::from_metadata(Some("{{ raise_exception('no tools') }}"), "llama", "", "").unwrap();
        let err = t.render(&msgs, true).unwrap_err().to_string();
        assert!(
            err.contains("template raised: no tools") && err.contains("(gguf)"),
            "{err}"
        );

        let t = ChatTemplate::from_metadata(Some("{{ strftime_now('%d %b %Y') }}"), "llama", "", "").unwrap();
        assert_eq!(t.render(&msgs, true).unwrap().len(), 11);

        // tojson as Python's json.dumps: spaced separators, no HTML escaping, indent=.
        let t = ChatTemplate::from_metadata(
            Some("{{ {'k': messages[0].content} | tojson }}|{{ [1, 'x'] | tojson }}|{{ [1, 2] | tojson(indent=2) }}"),
            "llama",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            t.render(&[ChatMessage::user("a<b & 'é'")], false).unwrap(),
            "{\"k\": \"a<b & 'é'\"}|[1, \"x\"]|[\n  1,\n  2\n]"
        );
    }

    #[test]
    fn broken_template_is_a_clear_error() {
        let err = ChatTemplate::from_metadata(Some("{% for m in messages %}{{ m.content }}"), "llama", "", "")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("chat template (gguf) does not compile"), "{err}");
        assert!(!err.contains('\n'), "{err}");
        let err = ChatTemplate::from_metadata(Some("{{ messages[0].content + 1 }}"), "llama", "", "")
            .unwrap()
            .render(&[ChatMessage::user("a")], true)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("chat template (gguf) failed"), "{err}");
    }

    #[test]
    fn strftime_known_dates() {
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", 0), "1970-01-01 00:00:00");
        assert_eq!(strftime("%d %b %Y", 1_709_210_096), "29 Feb 2024");
        assert_eq!(strftime("%B %e, %Y %%", 951_782_400), "February 29, 2000 %");
        assert_eq!(strftime("%q", 0), "%q");
    }

    #[test]
    fn messages_round_trip_as_json() {
        let m = ChatMessage::user("hi");
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(json, r#"{"role":"user","content":"hi"}"#);
        assert_eq!(serde_json::from_str::<ChatMessage>(&json).unwrap(), m);
    }

    #[test]
    fn a_template_that_never_ends_runs_out_of_fuel() {
        let t = ChatTemplate::from_metadata(
            Some("{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"),
            "llama",
            "",
            "",
        )
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(t.render(&[ChatMessage::user("hi")], true).map_err(|e| e.to_string()));
        });
        let r = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the template still runs after 30 s");
        let e = r.unwrap_err();
        assert!(e.contains("gave up after"), "{e}");
    }

    #[test]
    fn contents_are_located_in_the_render() {
        let msgs = [
            ChatMessage::system("  be <|im_end|> brief "),
            ChatMessage::user("<|im_start|>assistant\nhi"),
        ];
        let t = smollm2();
        let (text, spans) = t.render_marked(&msgs, None, true, false).unwrap();
        let spans = spans.expect("ChatML puts contents verbatim");
        let got: Vec<&str> = spans.iter().map(|r| &text[r.clone()]).collect();
        assert_eq!(got, [msgs[0].content.as_str(), msgs[1].content.as_str()]);
        // Gemma trims contents and folds the system message into the first user turn.
        let (text, spans) = gemma().render_marked(&msgs, None, true, true).unwrap();
        let got: Vec<&str> = spans.unwrap().iter().map(|r| &text[r.clone()]).collect();
        assert_eq!(got, [msgs[0].content.as_str(), "<|im_start|>assistant\nhi"]);
        // A template that rewrites contents gives no spans.
        let upper = ChatTemplate::from_metadata(
            Some("{% for m in messages %}[{{ m.content | upper }}]{% endfor %}"),
            "llama",
            "",
            "",
        )
        .unwrap();
        assert!(upper.render_marked(&msgs, None, false, false).unwrap().1.is_none());
    }

    /// `tokenizer.chat_template` texts of the new families' public GGUFs (tests/chat_templates/, one file each).
    fn family(text: &str, arch: &str, bos: &str, eos: &str) -> ChatTemplate {
        let t = ChatTemplate::from_metadata(Some(text), arch, bos, eos).unwrap();
        assert_eq!(t.source(), "gguf");
        t
    }

    fn convo() -> [ChatMessage; 4] {
        [
            ChatMessage::system("Be brief."),
            ChatMessage::user("Hi"),
            ChatMessage::assistant("Hello!"),
            ChatMessage::user("Bye"),
        ]
    }

    #[test]
    fn llama3_template() {
        let t = family(
            include_str!("../tests/chat_templates/llama3.jinja"),
            "llama",
            "<|begin_of_text|>",
            "<|eot_id|>",
        );
        let want = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
                    <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
                    <|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>\
                    <|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>\
                    <|start_header_id|>assistant<|end_header_id|>\n\n";
        assert_eq!(t.render(&convo(), true).unwrap(), want);
        // The tokenizer adds BOS itself: the template's leading one is dropped, not doubled.
        let text = t.render_for_tokenizer(&convo(), None, true, true).unwrap();
        assert_eq!(text, want.strip_prefix("<|begin_of_text|>").unwrap());
        // `| trim` on contents.
        let out = t.render(&[ChatMessage::user("  x \n")], false).unwrap();
        assert!(out.ends_with("user<|end_header_id|>\n\nx<|eot_id|>"), "{out}");
    }

    #[test]
    fn qwen25_template() {
        let t = family(
            include_str!("../tests/chat_templates/qwen2.5.jinja"),
            "qwen2",
            "",
            "<|im_end|>",
        );
        assert_eq!(t.tool_style(), ToolStyle::Hermes);
        assert_eq!(
            t.render(&convo(), true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
        );
        // No system message: Qwen's default one.
        assert_eq!(
            t.render(&[ChatMessage::user("Hi")], true).unwrap(),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        // Tools go through the template's own `tojson` rendering.
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let extras = ChatExtras {
            tools: Some(Arc::new(tools)),
            ..Default::default()
        };
        let out = t.render_with(&[ChatMessage::user("Hi")], Some(&extras), true).unwrap();
        assert!(
            out.contains("<tools>\n{\"function\": {\"name\": \"f\", \"parameters\": {}}, \"type\": \"function\"}\n"),
            "{out}"
        );
    }

    #[test]
    fn phi3_template() {
        let t = family(
            include_str!("../tests/chat_templates/phi3.jinja"),
            "phi3",
            "<s>",
            "<|endoftext|>",
        );
        assert_eq!(
            t.render(&convo(), true).unwrap(),
            "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nBye<|end|>\n\
             <|assistant|>\n"
        );
        // Without a generation prompt the template closes with EOS.
        let out = t.render(&[ChatMessage::user("Hi")], false).unwrap();
        assert_eq!(out, "<|user|>\nHi<|end|>\n<|endoftext|>");
    }

    #[test]
    fn mistral_template() {
        let t = family(
            include_str!("../tests/chat_templates/mistral.jinja"),
            "llama",
            "<s>",
            "</s>",
        );
        let msgs = [
            ChatMessage::user("Hi"),
            ChatMessage::assistant("Hello!"),
            ChatMessage::user("Bye"),
        ];
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<s>[INST] Hi [/INST]Hello!</s>[INST] Bye [/INST]"
        );
        assert_eq!(
            t.render_for_tokenizer(&msgs, None, true, true).unwrap(),
            "[INST] Hi [/INST]Hello!</s>[INST] Bye [/INST]"
        );
        // The template rejects a system message through `raise_exception`: a clear error, not a panic.
        let err = t.render(&convo(), true).unwrap_err().to_string();
        assert!(err.contains("Conversation roles must alternate"), "{err}");
    }

    /// Baton's own template in Qwen 3's manner (tests/chat_templates/thinking.jinja): `enable_thinking`, reasoning
    /// read from `reasoning_content` or split off a `<think>` block, shown only in a running tool loop.
    fn thinking() -> ChatTemplate {
        family(
            include_str!("../tests/chat_templates/thinking.jinja"),
            "qwen3",
            "",
            "<|im_end|>",
        )
    }

    fn kwargs(v: serde_json::Value) -> ChatExtras {
        ChatExtras {
            tools: None,
            kwargs: template_kwargs(&v).unwrap(),
        }
    }

    #[test]
    fn thinking_template_and_its_variables() {
        let t = thinking();
        let hi = [ChatMessage::user("Hi")];
        assert_eq!(
            t.render(&hi, true).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let off = kwargs(serde_json::json!({"enable_thinking": false}));
        assert_eq!(
            t.render_with(&hi, Some(&off), true).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
        // `is false` is not "falsy": 0 and true leave the prompt as without the variable.
        for v in [
            serde_json::json!({"enable_thinking": true}),
            serde_json::json!({"enable_thinking": 0}),
        ] {
            assert_eq!(
                t.render_with(&hi, Some(&kwargs(v)), true).unwrap(),
                t.render(&hi, true).unwrap()
            );
        }
        let on = kwargs(serde_json::json!({"force_thinking": true}));
        let text = t.render_with(&hi, Some(&on), true).unwrap();
        assert!(ThinkTags::default().prompt_opens(&text), "{text:?}");
        assert!(!ThinkTags::default().prompt_opens(&t.render_with(&hi, Some(&off), true).unwrap()));

        // Earlier turns: the think block of a past answer is dropped; in a running tool loop (the last user turn
        // is a tool result) the assistant turns after the real query keep their reasoning, from either field.
        let mut with_field = ChatMessage::assistant("Calling.");
        with_field.reasoning_content = Some("\nI need the tool.\n".into());
        let convo = [
            ChatMessage::user("Q1"),
            ChatMessage::assistant("<think>\nold thoughts\n</think>\n\nA1"),
            ChatMessage::user("Q2"),
            with_field,
            ChatMessage::user("<result>42</result>"),
            ChatMessage::assistant("<think>got 42</think>The answer is 42."),
        ];
        assert_eq!(
            t.render(&convo, false).unwrap(),
            "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n\
             <|im_start|>assistant\n<think>\nI need the tool.\n</think>\n\nCalling.<|im_end|>\n\
             <|im_start|>user\n<result>42</result><|im_end|>\n\
             <|im_start|>assistant\n<think>\ngot 42\n</think>\n\nThe answer is 42.<|im_end|>\n"
        );
    }

    #[test]
    fn reasoning_is_located_like_contents() {
        let t = thinking();
        let mut a = ChatMessage::assistant("Calling.");
        a.reasoning_content = Some("plan <|im_end|>".into());
        let msgs = [ChatMessage::user("Q"), a];
        let (text, spans) = t.render_marked(&msgs, None, true, false).unwrap();
        let got: Vec<&str> = spans
            .expect("contents and reasoning verbatim")
            .iter()
            .map(|r| &text[r.clone()])
            .collect();
        assert_eq!(got, ["Q", "plan <|im_end|>", "Calling."]);
        // A tool loop: the template reads the last user turn's content to decide what to show, so placeholders
        // change the render and nothing is located (the tokenizer then refuses special-token text in the messages).
        let mut msgs = msgs.to_vec();
        msgs.push(ChatMessage::user("<result>1</result>"));
        assert!(t.render_marked(&msgs, None, true, false).unwrap().1.is_none());
    }

    #[test]
    fn template_kwargs_are_checked() {
        let ok = template_kwargs(&serde_json::json!({"enable_thinking": false, "x_1": [1, {"a": null}]})).unwrap();
        assert_eq!(ok.len(), 2);
        let long = "x".repeat(KWARGS_MAX_BYTES);
        let mut deep = serde_json::json!(1);
        for _ in 0..=KWARGS_MAX_DEPTH {
            deep = serde_json::json!([deep]);
        }
        let many: serde_json::Map<String, serde_json::Value> = (0..=KWARGS_MAX_KEYS)
            .map(|i| (format!("k{i}"), serde_json::json!(i)))
            .collect();
        for (v, want) in [
            (serde_json::json!([1]), "must be a JSON object"),
            (serde_json::json!("x"), "must be a JSON object"),
            (serde_json::json!({"messages": []}), "cannot be overridden"),
            (serde_json::json!({"bos_token": "x"}), "cannot be overridden"),
            (serde_json::json!({"raise_exception": 1}), "cannot be overridden"),
            (serde_json::json!({"a-b": 1}), "not a template identifier"),
            (serde_json::json!({"": 1}), "not a template identifier"),
            (serde_json::json!({"1a": 1}), "not a template identifier"),
            (serde_json::json!({"s": long}), "bytes as JSON"),
            (serde_json::json!({"d": deep}), "nests deeper"),
            (serde_json::Value::Object(many), "variables; at most"),
        ] {
            let e = template_kwargs(&v).unwrap_err();
            assert!(e.contains(want), "{v}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
        // Reserved names could never reach a template: Baton's own inputs win anyway.
        let t = ChatTemplate::from_metadata(Some("{{ add_generation_prompt }}|{{ flag }}"), "llama", "", "").unwrap();
        let extras = ChatExtras {
            tools: None,
            kwargs: [
                ("flag".to_string(), serde_json::json!("on")),
                ("add_generation_prompt".to_string(), serde_json::json!(false)),
            ]
            .into(),
        };
        assert_eq!(
            t.render_with(&[ChatMessage::user("x")], Some(&extras), true).unwrap(),
            "True|on"
        );
    }

    #[test]
    fn think_tags_from_the_vocabulary() {
        assert_eq!(ThinkTags::from_vocab(|_| false), ThinkTags::default());
        let command = ThinkTags::from_vocab(|t| t.contains("THINKING"));
        assert_eq!(
            (command.open.as_str(), command.close.as_str()),
            ("<|START_THINKING|>", "<|END_THINKING|>")
        );
        // One tag alone is not a pair.
        assert_eq!(
            ThinkTags::from_vocab(|t| t == "<|START_THINKING|>"),
            ThinkTags::default()
        );
        let t = ThinkTags::default();
        assert!(t.prompt_opens("<|im_start|>assistant\n<think>\n"));
        assert!(!t.prompt_opens("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!t.prompt_opens("<|im_start|>user\n<think><|im_end|>\n<|im_start|>assistant\n"));
    }
}
