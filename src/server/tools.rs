//! Tools in chat completions: the `tools`/`tool_choice` request fields, the grammar that forces a call, and the
//! calls read back from the model's text by the conventions of [`ToolStyle`].

use crate::constrain::{Constraint, Grammar};
use serde_json::{Value, json};
use std::sync::Arc;

/// Most tools one request may define, and the longest function name.
const MAX_TOOLS: usize = 64;
const MAX_NAME: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools: names and parameter schemas, the original array (for the template), and the choice.
#[derive(Clone, Debug)]
pub struct Tools {
    pub defs: Arc<Value>,
    pub names: Vec<String>,
    params: Vec<Value>,
    pub choice: Choice,
}

/// One call read from the output.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    /// The arguments object as JSON text (OpenAI sends a string).
    pub arguments: String,
}

/// A refusal: the request field at fault and why (the caller makes it a 400).
pub type Refusal = (&'static str, String);

fn bad(param: &'static str, m: impl Into<String>) -> Refusal {
    (param, m.into())
}

impl Tools {
    /// Validates `tools` and `tool_choice`; `None` when no tools are given.
    pub fn parse(tools: Option<Value>, choice: Option<Value>) -> Result<Option<Tools>, Refusal> {
        let list = match tools {
            None | Some(Value::Null) => {
                return match choice {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::String(s)) if s == "none" || s == "auto" => Ok(None),
                    Some(_) => Err(bad("tool_choice", "tool_choice needs tools")),
                };
            }
            Some(Value::Array(a)) => a,
            Some(_) => return Err(bad("tools", "tools must be an array")),
        };
        if list.len() > MAX_TOOLS {
            return Err(bad("tools", format!("at most {MAX_TOOLS} tools")));
        }
        let (mut names, mut params) = (Vec::new(), Vec::new());
        for t in &list {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad("tools", "each tool must have type \"function\""));
            }
            let f = t
                .get("function")
                .ok_or_else(|| bad("tools", "each tool needs a function"))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("tools", "each function needs a name"))?;
            if name.is_empty()
                || name.len() > MAX_NAME
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            {
                return Err(bad(
                    "tools",
                    format!("function names are 1 to {MAX_NAME} of a-z, A-Z, 0-9, _ and -; got {name:?}"),
                ));
            }
            if names.iter().any(|n| n == name) {
                return Err(bad("tools", format!("two tools are named {name:?}")));
            }
            names.push(name.to_string());
            params.push(f.get("parameters").cloned().unwrap_or(json!({"type":"object"})));
        }
        let choice = match choice {
            None | Some(Value::Null) => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => Choice::None,
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                _ => return Err(bad("tool_choice", format!("unknown tool_choice {s:?}"))),
            },
            Some(o) => {
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                    .ok_or_else(|| {
                        bad(
                            "tool_choice",
                            "tool_choice must be none, auto, required or {\"type\":\"function\",\"function\":{\"name\":…}}",
                        )
                    })?;
                if !names.iter().any(|n| n == name) {
                    return Err(bad("tool_choice", format!("no tool is named {name:?}")));
                }
                Choice::Named(name.to_string())
            }
        };
        let t = Tools {
            defs: Arc::new(Value::Array(list)),
            names,
            params,
            choice,
        };
        // Every parameters schema must be one we can enforce, whatever the choice: refused now, not at a call.
        t.grammar(None)?;
        Ok(Some(t))
    }

    /// Whether the model may call tools in this request.
    pub fn active(&self) -> bool {
        self.choice != Choice::None
    }

    /// A constraint forcing one valid call, for `required` or a named function.
    pub fn constraint(&self) -> Result<Option<Constraint>, Refusal> {
        let only = match &self.choice {
            Choice::None | Choice::Auto => return Ok(None),
            Choice::Required => None,
            Choice::Named(n) => Some(n.as_str()),
        };
        Ok(Some(Constraint {
            grammar: Arc::new(self.grammar(only)?),
        }))
    }

    fn grammar(&self, only: Option<&str>) -> Result<Grammar, Refusal> {
        let list: Vec<(&str, &Value)> = self
            .names
            .iter()
            .zip(&self.params)
            .filter(|(n, _)| only.is_none_or(|o| o == n.as_str()))
            .map(|(n, p)| (n.as_str(), p))
            .collect();
        Grammar::tool_call(&list).map_err(|e| {
            bad(
                "tools",
                format!("a function's parameters: {} ({})", e.message, e.keyword),
            )
        })
    }

    /// The calls in `text`, and the text outside them; `None` when it holds no call of a known tool. Reads
    /// `<tool_call>…</tool_call>` blocks (Hermes, Qwen, and Baton's generic form), a leading `<|python_tag|>`, and
    /// a reply that is only a call object `{"name", "arguments"|"parameters"}` or an array of them (Llama 3).
    pub fn parse_calls(&self, text: &str) -> Option<(String, Vec<Call>)> {
        let mut calls = Vec::new();
        let mut rest = String::new();
        let mut s = text;
        while let Some(open) = s.find("<tool_call>") {
            rest.push_str(&s[..open]);
            let body = &s[open + "<tool_call>".len()..];
            let (inner, after) = match body.find("</tool_call>") {
                Some(c) => (&body[..c], &body[c + "</tool_call>".len()..]),
                None => (body, ""),
            };
            calls.extend(self.calls_in(inner)?);
            s = after;
        }
        if !calls.is_empty() {
            rest.push_str(s);
            return Some((rest.trim().to_string(), calls));
        }
        let t = text.trim();
        let t = t.strip_prefix("<|python_tag|>").unwrap_or(t).trim();
        let calls = self.calls_in(t)?;
        Some((String::new(), calls))
    }

    fn calls_in(&self, json_text: &str) -> Option<Vec<Call>> {
        let v: Value = serde_json::from_str(json_text.trim()).ok()?;
        let items = match v {
            Value::Array(a) => a,
            o => vec![o],
        };
        let mut out = Vec::new();
        for it in items {
            let name = it.get("name")?.as_str()?;
            if !self.names.iter().any(|n| n == name) {
                return None;
            }
            let args = it
                .get("arguments")
                .or_else(|| it.get("parameters"))
                .cloned()
                .unwrap_or(json!({}));
            let arguments = match args {
                Value::String(s) if serde_json::from_str::<Value>(&s).is_ok() => s,
                Value::Object(_) => args.to_string(),
                _ => return None,
            };
            out.push(Call {
                name: name.to_string(),
                arguments,
            });
        }
        (!out.is_empty()).then_some(out)
    }
}

/// A fresh call id in OpenAI's shape.
pub fn call_id() -> String {
    format!("call_{:016x}", rand::random::<u64>())
}

/// `message.tool_calls` (streaming: with `index`).
pub fn tool_calls_json(calls: &[Call], stream: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({"id": call_id(), "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}});
                if stream {
                    v["index"] = json!(i);
                }
                v
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Tools {
        Tools::parse(
            Some(
                json!([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object",
                "properties":{"city":{"type":"string"}},"required":["city"]}}}]),
            ),
            Some(json!("required")),
        )
        .unwrap()
        .unwrap()
    }

    #[test]
    fn calls_are_read_by_each_convention() {
        let t = weather();
        let want = vec![Call {
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        }];
        for text in [
            r#"<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>"#,
            r#"{"name":"get_weather","parameters":{"city":"Paris"}}"#,
            r#"<|python_tag|>{"name":"get_weather","arguments":{"city":"Paris"}}"#,
            r#"[{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}]"#,
        ] {
            let (rest, calls) = t.parse_calls(text).unwrap_or_else(|| panic!("{text}"));
            assert_eq!(calls, want, "{text}");
            assert_eq!(rest, "");
        }
        assert!(t.parse_calls("The weather is fine.").is_none());
        assert!(t.parse_calls(r#"{"name":"other","arguments":{}}"#).is_none());
        let (rest, _) = t
            .parse_calls("Let me check.<tool_call>{\"name\":\"get_weather\",\"arguments\":{}}</tool_call>")
            .unwrap();
        assert_eq!(rest, "Let me check.");
    }

    #[test]
    fn bad_tools_are_refused_by_field() {
        for (tools, choice, param) in [
            (json!("x"), json!("auto"), "tools"),
            (
                json!([{"type":"function","function":{"name":"a b"}}]),
                json!("auto"),
                "tools",
            ),
            (
                json!([{"type":"function","function":{"name":"f","parameters":{"type":"string","format":"hostname"}}}]),
                json!("auto"),
                "tools",
            ),
            (
                json!([{"type":"function","function":{"name":"f"}}]),
                json!("sometimes"),
                "tool_choice",
            ),
            (
                json!([{"type":"function","function":{"name":"f"}}]),
                json!({"type":"function","function":{"name":"g"}}),
                "tool_choice",
            ),
        ] {
            let e = Tools::parse(Some(tools), Some(choice)).unwrap_err();
            assert_eq!(e.0, param, "{}", e.1);
        }
    }

    #[test]
    fn a_forced_call_grammar_accepts_only_valid_calls() {
        let c = weather().constraint().unwrap().unwrap();
        let g = &c.grammar;
        let ok = |s: &str| {
            let mut m = crate::constrain::Matcher::new(g);
            m.advance_bytes(g, s.as_bytes()) && m.is_complete(g)
        };
        assert!(ok(r#"{"name":"get_weather","arguments":{"city":"Rome"}}"#));
        assert!(ok(r#"{"arguments":{"city":"Rome"},"name":"get_weather"}"#));
        assert!(!ok(r#"{"name":"get_weather","arguments":{}}"#));
        assert!(!ok(r#"{"name":"other","arguments":{"city":"Rome"}}"#));
    }
}
