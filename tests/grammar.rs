//! Constrained output and tools against a real `baton serve` with SmolLM2: every schema's reply parses and validates
//! (checked by a small validator written here, independent of the matcher: patterns by `fancy_regex`, formats by
//! their own field checks), greedy and sampled; forced tool calls come back in
//! OpenAI's shape, streamed and not; the official Python and JS `openai` clients drive both.

mod cluster_util;

use cluster_util::ServeProc;
use serde_json::{Value, json};
use std::process::Command;
use std::time::{Duration, Instant};

/// The first key given twice in one object of the JSON `text` (`serde_json::Value` keeps only the last, so a
/// validator of the parsed value cannot see it).
fn repeated_key(text: &str) -> Option<String> {
    use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
    use std::cell::RefCell;
    use std::collections::HashSet;
    struct Walk<'a>(&'a RefCell<Option<String>>);
    impl<'de> DeserializeSeed<'de> for Walk<'_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Walk<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
            let mut keys = HashSet::new();
            while let Some(k) = m.next_key::<String>()? {
                if !keys.insert(k.clone()) {
                    self.0.borrow_mut().get_or_insert(k);
                }
                m.next_value_seed(Walk(self.0))?;
            }
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<(), A::Error> {
            while s.next_element_seed(Walk(self.0))?.is_some() {}
            Ok(())
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
    }
    let found = RefCell::new(None);
    Walk(&found)
        .deserialize(&mut serde_json::Deserializer::from_str(text))
        .ok()?;
    found.into_inner()
}

#[test]
fn repeated_keys_are_found() {
    assert_eq!(repeated_key(r#"{"a":[{"b":1,"b":2}],"c":3}"#).as_deref(), Some("b"));
    assert_eq!(repeated_key(r#"{"a":{"a":1},"b":[1.5,null,"x",true]}"#), None);
}

/// Validates `v` against the schema subset the server enforces (docs/server.md); `root` resolves `$ref`s.
fn validate(v: &Value, s: &Value, root: &Value) -> Result<(), String> {
    let Some(m) = s.as_object() else {
        return if s == &json!(true) {
            Ok(())
        } else {
            Err(format!("schema {s}"))
        };
    };
    if let Some(r) = m.get("$ref").and_then(Value::as_str) {
        let target = if r == "#" {
            root
        } else {
            let (sec, name) = r[2..].split_once('/').unwrap();
            &root[sec][name]
        };
        return validate(v, target, root);
    }
    if let Some(c) = m.get("const") {
        return if v == c {
            Ok(())
        } else {
            Err(format!("{v} is not const {c}"))
        };
    }
    if let Some(e) = m.get("enum").and_then(Value::as_array) {
        return if e.contains(v) {
            Ok(())
        } else {
            Err(format!("{v} not in enum"))
        };
    }
    for a in m.get("allOf").and_then(Value::as_array).into_iter().flatten() {
        validate(v, a, root)?;
    }
    if let Some(alts) = m.get("anyOf").and_then(Value::as_array) {
        return if alts.iter().any(|a| validate(v, a, root).is_ok()) {
            Ok(())
        } else {
            Err(format!("{v} matches no anyOf branch"))
        };
    }
    if let Some(alts) = m.get("oneOf").and_then(Value::as_array) {
        let n = alts.iter().filter(|a| validate(v, a, root).is_ok()).count();
        return if n == 1 {
            Ok(())
        } else {
            Err(format!("{v} matches {n} oneOf branches"))
        };
    }
    let types: Vec<&str> = match m.get("type") {
        Some(Value::String(t)) => vec![t],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    let nullable = m.get("nullable") == Some(&json!(true));
    if v.is_null() && nullable {
        return Ok(());
    }
    let ty = match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        // JSON Schema's integer is any number with no fractional part: `-0` (which serde_json reads as the float
        // -0.0) is one, and the grammar's `-?(0|[1-9][0-9]*)` may write it.
        Value::Number(n) if n.is_i64() || n.is_u64() || n.as_f64().is_some_and(|f| f.fract() == 0.0) => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    let allowed = types.is_empty() || types.contains(&ty) || (ty == "integer" && types.contains(&"number"));
    if !allowed {
        return Err(format!("{v} is {ty}, not {types:?}"));
    }
    let num = |k: &str| m.get(k).and_then(Value::as_u64);
    match v {
        Value::String(s) => {
            let n = s.chars().count() as u64;
            if num("minLength").is_some_and(|x| n < x) || num("maxLength").is_some_and(|x| n > x) {
                return Err(format!("{v}: length {n}"));
            }
            if let Some(p) = m.get("pattern").and_then(Value::as_str)
                && !fancy_regex::Regex::new(p).unwrap().is_match(s).unwrap()
            {
                return Err(format!("{v} does not match {p}"));
            }
            if let Some(f) = m.get("format").and_then(Value::as_str)
                && !format_ok(f, s)
            {
                return Err(format!("{v} is not a {f}"));
            }
        }
        Value::Number(n) => {
            let x = n.as_f64().unwrap();
            let bound = |k: &str| m.get(k).and_then(Value::as_f64);
            if bound("minimum").is_some_and(|b| x < b)
                || bound("maximum").is_some_and(|b| x > b)
                || bound("exclusiveMinimum").is_some_and(|b| x <= b)
                || bound("exclusiveMaximum").is_some_and(|b| x >= b)
            {
                return Err(format!("{v} is out of bounds"));
            }
        }
        Value::Array(a) => {
            let n = a.len() as u64;
            if num("minItems").is_some_and(|x| n < x) || num("maxItems").is_some_and(|x| n > x) {
                return Err(format!("{v}: {n} items"));
            }
            if let Some(items) = m.get("items") {
                for x in a {
                    validate(x, items, root)?;
                }
            }
        }
        Value::Object(o) => {
            let props = m.get("properties").and_then(Value::as_object);
            for r in m.get("required").and_then(Value::as_array).into_iter().flatten() {
                if !o.contains_key(r.as_str().unwrap()) {
                    return Err(format!("{v}: {r} missing"));
                }
            }
            for (k, x) in o {
                match props.and_then(|p| p.get(k)) {
                    Some(ps) => validate(x, ps, root)?,
                    None => match m.get("additionalProperties") {
                        Some(Value::Bool(false)) => return Err(format!("{v}: extra key {k}")),
                        Some(a @ Value::Object(_)) => validate(x, a, root)?,
                        _ => {}
                    },
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// `format`s checked field by field (not by the server's patterns): RFC 3339 date, time, date-time; uuid; email.
fn format_ok(f: &str, s: &str) -> bool {
    let n = |t: &str, len: usize, max: u32| {
        t.len() == len && t.bytes().all(|b| b.is_ascii_digit()) && t.parse::<u32>().is_ok_and(|v| v <= max)
    };
    let date = |d: &str| {
        let p: Vec<&str> = d.split('-').collect();
        p.len() == 3 && n(p[0], 4, 9999) && n(p[1], 2, 12) && p[1] != "00" && n(p[2], 2, 31) && p[2] != "00"
    };
    let time = |t: &str| {
        let (clock, zone) = match t.find(['Z', '+', '-']) {
            Some(i) => t.split_at(i),
            None => return false,
        };
        let zone_ok = zone == "Z" || {
            let z: Vec<&str> = zone[1..].split(':').collect();
            z.len() == 2 && n(z[0], 2, 23) && n(z[1], 2, 59)
        };
        let (hms, frac) = clock.split_once('.').unwrap_or((clock, "0"));
        let c: Vec<&str> = hms.split(':').collect();
        zone_ok
            && c.len() == 3
            && n(c[0], 2, 23)
            && n(c[1], 2, 59)
            && n(c[2], 2, 60)
            && !frac.is_empty()
            && frac.bytes().all(|b| b.is_ascii_digit())
    };
    match f {
        "date" => date(s),
        "time" => time(s),
        "date-time" => s.split_once('T').is_some_and(|(d, t)| date(d) && time(t)),
        "uuid" => {
            let groups: Vec<&str> = s.split('-').collect();
            groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
                && groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_hexdigit()))
        }
        "email" => s.split_once('@').is_some_and(|(local, domain)| {
            !local.is_empty()
                && !domain.contains('@')
                && domain.contains('.')
                && domain
                    .split('.')
                    .all(|l| !l.is_empty() && !l.starts_with('-') && !l.ends_with('-'))
        }),
        _ => panic!("no check for format {f}"),
    }
}

fn obj(props: Value, required: &[&str]) -> Value {
    json!({"type": "object", "properties": props, "required": required, "additionalProperties": false})
}

/// (prompt, schema) pairs: every keyword of the subset, alone and combined.
fn schemas() -> Vec<(&'static str, Value)> {
    let short = json!({"type": "string", "maxLength": 16});
    vec![
        (
            "Describe a person as JSON.",
            obj(json!({"name": short, "age": {"type": "integer"}}), &["name", "age"]),
        ),
        (
            "Pick a color.",
            json!({"type": "string", "enum": ["red", "green", "blue"]}),
        ),
        ("Is the sky blue?", json!({"type": "boolean"})),
        ("How many legs has a cat?", json!({"type": "integer"})),
        (
            "Price of a coffee as JSON.",
            obj(json!({"price": {"type": "number"}}), &["price"]),
        ),
        (
            "List some numbers.",
            json!({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4}),
        ),
        (
            "List fruits.",
            json!({"type": "array", "items": short, "minItems": 2, "maxItems": 3}),
        ),
        (
            "Where does Ann live?",
            obj(
                json!({"name": short, "address": obj(json!({"city": short, "zip": {"type": "string", "maxLength": 8}}),
                                                       &["city", "zip"])}),
                &["name", "address"],
            ),
        ),
        (
            "Give a nickname or null.",
            obj(
                json!({"nick": {"type": ["string", "null"], "maxLength": 12}}),
                &["nick"],
            ),
        ),
        (
            "Status as JSON.",
            obj(
                json!({"version": {"const": 2}, "ok": {"type": "boolean"}}),
                &["version", "ok"],
            ),
        ),
        (
            "Describe a pet.",
            json!({"anyOf": [obj(json!({"cat": short}), &["cat"]), obj(json!({"dog": {"type": "integer"}}), &["dog"])]}),
        ),
        (
            "A number or a word.",
            json!({"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}),
        ),
        (
            "A line from one point to another.",
            json!({"type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
                   "required": ["from", "to"], "additionalProperties": false,
                   "$defs": {"pt": obj(json!({"x": {"type": "integer"}, "y": {"type": "integer"}}), &["x", "y"])}}),
        ),
        (
            "A shopping list.",
            json!({"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/definitions/it"},
                   "maxItems": 3}}, "required": ["items"], "additionalProperties": false,
                   "definitions": {"it": obj(json!({"what": short, "n": {"type": "integer"}}), &["what", "n"])}}),
        ),
        (
            "A parent and children.",
            json!({"$ref": "#/$defs/parent", "$defs": {
                "parent": obj(json!({"v": {"type": "integer"}, "kids": {"type": "array",
                    "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2}}), &["v"]),
                "leaf": obj(json!({"v": {"type": "integer"}}), &["v"])}}),
        ),
        ("Pick anything.", json!({"enum": [1, "two", null, true]})),
        (
            "A short word.",
            json!({"type": "string", "minLength": 3, "maxLength": 6}),
        ),
        (
            "Some events.",
            json!({"type": "array", "maxItems": 3, "items": obj(json!({"kind": {"enum": ["start", "stop"]},
                   "at": {"type": "integer"}}), &["kind", "at"])}),
        ),
        (
            "A count or nothing.",
            obj(json!({"count": {"type": "integer", "nullable": true}}), &["count"]),
        ),
        (
            "Flags.",
            json!({"properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}, "additionalProperties": false}),
        ),
        (
            "A product code like ABC-123.",
            json!({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}),
        ),
        (
            "When is the meeting?",
            obj(
                json!({"day": {"type": "string", "format": "date"}, "start": {"type": "string", "format": "time"}}),
                &["day", "start"],
            ),
        ),
        (
            "A log entry with a timestamp, an id and a birth date.",
            obj(
                json!({"at": {"type": "string", "format": "date-time"}, "id": {"type": "string", "format": "uuid"},
                       "born": {"type": "string", "format": "date"}}),
                &["at", "id", "born"],
            ),
        ),
        (
            "Rate the film from 1 to 5.",
            json!({"type": "integer", "minimum": 1, "maximum": 5}),
        ),
        (
            "A temperature reading.",
            obj(
                json!({"celsius": {"type": "integer", "exclusiveMinimum": -274, "exclusiveMaximum": 100},
                       "label": {"type": "string", "pattern": "^[a-z]{1,8}$"}}),
                &["celsius", "label"],
            ),
        ),
        (
            "A person with an id.",
            json!({"allOf": [obj(json!({"id": {"type": "integer", "minimum": 0}, "name": short}), &["id"]),
                             {"required": ["name"]}]}),
        ),
        (
            "A circle or a square.",
            json!({"oneOf": [
                obj(json!({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1}}), &["kind", "r"]),
                obj(json!({"kind": {"const": "square"}, "side": {"type": "integer"}}), &["kind", "side"])]}),
        ),
        (
            "A book.",
            obj(
                json!({"title": short, "year": {"type": "integer"}, "tags": {"type": "array", "items":
                       {"enum": ["fiction", "poetry", "history"]}, "maxItems": 2}, "rating": {"type": "number"},
                       "series": {"type": ["string", "null"], "maxLength": 10}}),
                &["title", "year", "tags"],
            ),
        ),
    ]
}

fn request(prompt: &str, schema: &Value, sampled: bool) -> Value {
    let mut b = json!({"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 160,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}});
    if sampled {
        b["temperature"] = json!(0.9);
        b["seed"] = json!(7);
    } else {
        b["temperature"] = json!(0);
    }
    b
}

#[test]
fn constrained_replies_follow_every_schema() {
    let srv = ServeProc::start(&["-c", "512", "--parallel", "2"]);
    let t0 = Instant::now();
    let list = schemas();
    assert!(list.len() >= 28);
    let mut jobs = Vec::new();
    for (prompt, schema) in &list {
        for sampled in [false, true] {
            jobs.push((*prompt, schema.clone(), sampled));
        }
    }
    // Two clients at once, one per slot.
    let run = |part: &[(&str, Value, bool)]| {
        part.iter()
            .map(|(p, sc, sampled)| {
                let (code, r) = srv.post("/v1/chat/completions", &request(p, sc, *sampled));
                (p.to_string(), sc.clone(), *sampled, code, r)
            })
            .collect::<Vec<_>>()
    };
    let (a, b) = jobs.split_at(jobs.len() / 2);
    let run = &run;
    let results: Vec<(String, Value, bool, u16, Value)> = std::thread::scope(|s| {
        let ha = s.spawn(move || run(a));
        let hb = s.spawn(move || run(b));
        let mut v = ha.join().unwrap();
        v.extend(hb.join().unwrap());
        v
    });
    let mut failures = Vec::new();
    for (prompt, schema, sampled, code, r) in &results {
        assert_eq!(*code, 200, "{prompt}: {r}");
        let text = r["choices"][0]["message"]["content"].as_str().unwrap();
        let fin = &r["choices"][0]["finish_reason"];
        let checked = if fin != "stop" {
            Err(format!("finish_reason {fin}"))
        } else {
            serde_json::from_str::<Value>(text)
                .map_err(|e| e.to_string())
                .and_then(|v| validate(&v, schema, schema))
                .and_then(|()| repeated_key(text).map_or(Ok(()), |k| Err(format!("key {k:?} repeated"))))
        };
        if let Err(e) = checked {
            failures.push(format!("{prompt} (sampled {sampled}): {e}: {text}"));
        }
    }
    eprintln!(
        "{} of {} constrained replies over {} schemas valid in {:.1} s",
        results.len() - failures.len(),
        results.len(),
        list.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{failures:#?}");

    // json_object: any object.
    let mut b = request("Describe the moon as JSON.", &json!({}), true);
    b["response_format"] = json!({"type": "json_object"});
    b["max_tokens"] = json!(60);
    let (code, r) = srv.post("/v1/chat/completions", &b);
    assert_eq!(code, 200, "{r}");
    let text = r["choices"][0]["message"]["content"].as_str().unwrap();
    if r["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(text).unwrap().is_object(), "{text}");
        assert_eq!(repeated_key(text), None, "{text}");
    } else {
        assert!(text.trim_start().starts_with('{'), "{text}");
    }

    // Unsupported keywords, bad formats and a hostile schema (deep nesting, refused, not compiled) are 400s that
    // name them.
    // 40 levels: past the schema's limit of 32, within serde_json's 128 (a deeper body is refused as JSON, below).
    let nest = |levels: usize| {
        let mut deep = json!({"type": "string"});
        for _ in 0..levels {
            deep = json!({"type": "array", "items": deep});
        }
        deep
    };
    let schema = |s: Value| json!({"type": "json_schema", "json_schema": {"schema": s}});
    for (rf, word) in [
        (schema(json!({"type": "string", "pattern": "(?<=a)b"})), "pattern"),
        (schema(json!({"type": "string", "format": "hostname"})), "format"),
        (schema(json!({"type": "number", "minimum": 1})), "minimum"),
        (schema(json!({"type": "integer", "multipleOf": 2})), "multipleOf"),
        (schema(json!({"allOf": []})), "allOf"),
        (
            schema(json!({"oneOf": [{"type": "integer"}, {"type": "number"}]})),
            "oneOf",
        ),
        (schema(json!({"not": {"type": "string"}})), "not"),
        (schema(nest(40)), "nests deeper"),
        (json!({"type": "yaml"}), "response_format.type"),
    ] {
        let mut b = request("x", &json!({}), false);
        b["response_format"] = rf;
        let (code, r) = srv.post("/v1/chat/completions", &b);
        assert_eq!(code, 400, "{r}");
        assert_eq!(r["error"]["param"], "response_format", "{r}");
        assert!(r["error"]["message"].as_str().unwrap().contains(word), "{word}: {r}");
    }
    let (code, r) = srv.post("/v1/chat/completions", &request("x", &nest(200), false));
    assert_eq!(code, 400, "{r}");
    assert!(t0.elapsed() < Duration::from_secs(400));
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
                "additionalProperties": false}}},
        {"type": "function", "function": {"name": "add", "description": "Adds two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"], "additionalProperties": false}}}
    ])
}

fn check_call(call: &Value, name: Option<&str>) {
    assert_eq!(call["type"], "function", "{call}");
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
    let n = call["function"]["name"].as_str().unwrap();
    if let Some(want) = name {
        assert_eq!(n, want);
    }
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    let tools = weather_tools();
    let t = tools
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["function"]["name"] == n)
        .unwrap();
    let schema = &t["function"]["parameters"];
    validate(&args, schema, schema).unwrap_or_else(|e| panic!("{call}: {e}"));
}

#[test]
fn forced_tool_calls_come_back_in_openai_shape() {
    let srv = ServeProc::start(&["-c", "1024"]);
    let base = json!({"model": "smollm2", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                      "tools": weather_tools(), "tool_choice": "required", "max_tokens": 80, "temperature": 0});
    let (code, r) = srv.post("/v1/chat/completions", &base);
    assert_eq!(code, 200, "{r}");
    let c = &r["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{r}");
    assert!(c["message"]["content"].is_null(), "{r}");
    check_call(&c["message"]["tool_calls"][0], None);

    // A named function, sampled.
    let mut b = base.clone();
    b["tool_choice"] = json!({"type": "function", "function": {"name": "add"}});
    b["messages"] = json!([{"role": "user", "content": "Add 2 and 3."}]);
    b["temperature"] = json!(0.8);
    b["seed"] = json!(3);
    let (code, r) = srv.post("/v1/chat/completions", &b);
    assert_eq!(code, 200, "{r}");
    check_call(&r["choices"][0]["message"]["tool_calls"][0], Some("add"));

    // Streamed: the call arrives as tool_calls deltas, then finish_reason tool_calls.
    let mut s = base.clone();
    s["stream"] = json!(true);
    let (code, raw) = post_raw(&srv.addr, &s.to_string());
    assert_eq!(code, 200, "{raw}");
    let chunks: Vec<Value> = raw
        .split("data: ")
        .filter_map(|e| serde_json::from_str(e.trim()).ok())
        .collect();
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
        .collect();
    assert_eq!(deltas.len(), 1, "{raw}");
    assert_eq!(deltas[0]["index"], 0);
    check_call(deltas[0], None);
    assert!(
        chunks.iter().any(|c| c["choices"][0]["finish_reason"] == "tool_calls"),
        "{raw}"
    );

    // The call and its result in the history, then a plain answer (tool_choice none).
    let call = r["choices"][0]["message"]["tool_calls"][0].clone();
    let mut h = base.clone();
    h["tool_choice"] = json!("none");
    h["max_tokens"] = json!(8);
    h["messages"] = json!([
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "5"}
    ]);
    let (code, r) = srv.post("/v1/chat/completions", &h);
    assert_eq!(code, 200, "{r}");
    assert!(r["choices"][0]["message"]["content"].is_string(), "{r}");
    assert!(r["choices"][0]["message"].get("tool_calls").is_none(), "{r}");

    // Bad tools are 400s naming the field.
    let mut bad = base.clone();
    bad["tool_choice"] = json!({"type": "function", "function": {"name": "nope"}});
    let (code, r) = srv.post("/v1/chat/completions", &bad);
    assert_eq!((code, r["error"]["param"].as_str()), (400, Some("tool_choice")), "{r}");
}

/// A POST whose answer may be chunked (a stream): status and the body, chunk framing removed.
fn post_raw(addr: &str, body: &str) -> (u16, String) {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let code = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut chunked = false;
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        if line.trim().is_empty() {
            break;
        }
        chunked |= line.to_ascii_lowercase().starts_with("transfer-encoding: chunked");
    }
    let mut out = Vec::new();
    if !chunked {
        r.read_to_end(&mut out).unwrap();
    } else {
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            let n = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut buf = vec![0; n + 2];
            r.read_exact(&mut buf).unwrap();
            out.extend_from_slice(&buf[..n]);
        }
    }
    (code, String::from_utf8(out).unwrap())
}

/// A speculative pair samples from drafts: a constraint cannot be applied there, so the request is refused.
#[test]
fn topologies_that_cannot_constrain_refuse() {
    let srv = ServeProc::start(&["-c", "256", "--draft", "smollm2", "--draft-tokens", "2"]);
    let mut b = request("Pick a color.", &json!({"enum": ["red", "blue"]}), false);
    b["max_tokens"] = json!(8);
    let (code, r) = srv.post("/v1/chat/completions", &b);
    assert_eq!(code, 400, "{r}");
    assert_eq!(r["error"]["param"], "response_format", "{r}");
}

const PY: &str = r#"
import sys, json, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="k", max_retries=0, timeout=120)
tools = json.loads(sys.argv[2])
r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                              tools=tools, tool_choice="required", max_tokens=80, temperature=0)
call = r.choices[0].message.tool_calls[0]
assert r.choices[0].finish_reason == "tool_calls", r
args = json.loads(call.function.arguments)
assert call.type == "function" and call.id.startswith("call_"), call
print("CALL", call.function.name, json.dumps(args))
schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Is it sunny in Rome?"}],
    response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}},
    max_tokens=60, temperature=0)
v = json.loads(r.choices[0].message.content)
assert set(v) == {"city", "sunny"} and isinstance(v["sunny"], bool), v
parts = []
for ch in c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                    tools=tools, tool_choice="required", max_tokens=80, temperature=0, stream=True):
    for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
        parts.append(d.function.arguments or "")
assert json.loads("".join(parts)) == args, parts
print("ok")
"#;

#[test]
fn official_python_client_tools_and_schema() {
    let probe = Command::new("python3").args(["-c", "import openai"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!("SKIPPED: python3 cannot import the openai package (scripts/test installs it with pip)");
        return;
    }
    let srv = ServeProc::start(&["-c", "1024", "--api-key", "k"]);
    let out = Command::new("python3")
        .args(["-c", PY, &format!("http://{}", srv.addr), &weather_tools().to_string()])
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && so.contains("ok"),
        "{so}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn official_js_client_tools_and_schema() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/js");
    if Command::new("node").arg("--version").output().is_err() {
        eprintln!("SKIPPED: node is not installed");
        return;
    }
    if !dir.join("node_modules/openai").exists() {
        eprintln!("SKIPPED: tests/js/node_modules is missing (run npm ci --prefix tests/js)");
        return;
    }
    let srv = ServeProc::start(&["-c", "1024", "--api-key", "k"]);
    let out = Command::new("node")
        .arg(dir.join("tools.mjs"))
        .arg(format!("http://{}", srv.addr))
        .arg(weather_tools().to_string())
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && so.contains("ok"),
        "{so}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
