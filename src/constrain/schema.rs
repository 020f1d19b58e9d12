//! JSON schema → [`Grammar`]: a small graph of value shapes the matcher walks. Bounded against hostile schemas.

use super::pattern::Pattern;
use serde_json::{Map, Value};
use std::collections::HashMap;

pub type NodeId = u32;

/// Most nodes a schema may compile to.
const MAX_NODES: usize = 4096;
/// Deepest nesting of schema objects (through properties, items, anyOf...).
const MAX_DEPTH: usize = 32;
/// Most values in one `enum`, and most bytes of all `enum`/`const` values together.
const MAX_ENUM: usize = 256;
const MAX_LITERAL_BYTES: usize = 64 * 1024;
/// Most `properties` of one object (a bit each in the matcher's "seen" set).
pub(crate) const MAX_PROPS: usize = 64;
/// Most distinct `$ref` targets, and most alternatives a value can start as (after flattening `anyOf`s).
const MAX_REFS: usize = 128;
pub(crate) const MAX_ALTS: usize = 64;
/// Largest schema, as compact JSON.
const MAX_SCHEMA_BYTES: usize = 256 * 1024;
/// Most shape comparisons spent proving two `oneOf` branches disjoint.
const DISJOINT_BUDGET: u32 = 10_000;
/// Largest `minLength`/`maxLength`/`minItems`/`maxItems` honoured as a bound.
const MAX_COUNT: u64 = 1 << 20;

static NULL: Value = Value::Null;

/// Keywords that only annotate: accepted and without effect on the output.
const ANNOTATIONS: [&str; 10] = [
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
];
/// Keywords enforced by the matcher.
const ENFORCED: [&str; 25] = [
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "$defs",
    "definitions",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "nullable",
    "strict",
];

/// Why a schema was refused: the keyword (or JSON pointer-ish place) and what is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct SchemaError {
    pub keyword: String,
    pub message: String,
}

impl std::fmt::Display for SchemaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.message)
    }
}

fn err<T>(keyword: &str, message: impl Into<String>) -> Result<T, SchemaError> {
    Err(SchemaError {
        keyword: keyword.to_string(),
        message: message.into(),
    })
}

/// One value shape.
#[derive(Debug, Clone)]
pub(crate) enum Node {
    /// Keys as their JSON-escaped bytes (no quotes), sorted; `values` aligned; `required` a bit per key;
    /// `additional`: the schema of other keys' values, `None` when no other key is allowed.
    Object {
        keys: Vec<Vec<u8>>,
        values: Vec<NodeId>,
        required: u64,
        additional: Option<NodeId>,
    },
    Array {
        items: NodeId,
        min: u32,
        max: u32,
    },
    /// Lengths in characters (code points); `pattern`: an index into [`Grammar::patterns`] the characters must
    /// match (`pattern` or `format`).
    String {
        min: u32,
        max: u32,
        pattern: Option<u32>,
    },
    /// `bounds`: the least and greatest integer allowed (integers only).
    Number {
        integer: bool,
        bounds: Option<(i64, i64)>,
    },
    /// Exact compact JSON texts, sorted and distinct (`enum`, `const`, booleans, null).
    Literals(Vec<Vec<u8>>),
    Union(Vec<NodeId>),
    /// A `$ref`, resolved when the graph is finished.
    Alias(NodeId),
}

/// A compiled schema: nodes, and for each node the concrete shapes a value of it can start as.
#[derive(Debug)]
pub struct Grammar {
    pub(crate) nodes: Vec<Node>,
    pub(crate) starts: Vec<Vec<NodeId>>,
    pub(crate) root: NodeId,
    pub(crate) patterns: Vec<Pattern>,
}

impl Grammar {
    /// Number of nodes (for diagnostics).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Any JSON object, values of any type.
    pub fn any_object() -> Grammar {
        let mut c = Compiler::new(&NULL);
        let any = c.any();
        let root = c.push(Node::Object {
            keys: Vec::new(),
            values: Vec::new(),
            required: 0,
            additional: Some(any),
        });
        c.finish(root).expect("the built-in object grammar is valid")
    }

    /// A call of one of `tools` (name and parameters schema) as `{"name": NAME, "arguments": {…}}`, keys in any
    /// order; each tool's `$ref`s resolve within its own parameters schema.
    pub fn tool_call(tools: &[(&str, &Value)]) -> Result<Grammar, SchemaError> {
        let mut c = Compiler::new(&NULL);
        let mut calls = Vec::new();
        for (name, params) in tools {
            c.doc = *params;
            c.refs.clear();
            let args = c.node(params, 1)?;
            let name = c.literals(&[&Value::String(name.to_string())], "name")?;
            calls.push(c.push(Node::Object {
                keys: vec![b"arguments".to_vec(), b"name".to_vec()],
                values: vec![args, name],
                required: 0b11,
                additional: None,
            }));
        }
        let root = match calls.len() {
            0 => return err("tools", "no tool to call"),
            1 => calls[0],
            _ => c.push(Node::Union(calls)),
        };
        c.finish(root)
    }

    pub fn compile(schema: &Value) -> Result<Grammar, SchemaError> {
        let size = serde_json::to_vec(schema).map_or(usize::MAX, |v| v.len());
        if size > MAX_SCHEMA_BYTES {
            return err(
                "schema",
                format!("the schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are accepted"),
            );
        }
        let mut c = Compiler::new(schema);
        let root = c.node(schema, 0)?;
        c.finish(root)
    }
}

struct Compiler<'a> {
    doc: &'a Value,
    nodes: Vec<Node>,
    refs: HashMap<String, NodeId>,
    any: Option<NodeId>,
    literal_bytes: usize,
    patterns: Vec<Pattern>,
    /// The branches of each `oneOf`, checked to be disjoint once the graph is finished.
    one_ofs: Vec<Vec<NodeId>>,
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(n) if n.as_f64().is_some_and(|f| f.fract() == 0.0) => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The numeric bounds, enforced on integers.
const BOUNDS: [&str; 4] = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"];

/// An integer's least and greatest allowed value from `minimum`, `maximum` and the numeric `exclusive*` forms.
fn integer_bounds(m: &Map<String, Value>) -> Result<Option<(i64, i64)>, SchemaError> {
    if !BOUNDS.iter().any(|k| m.contains_key(*k)) {
        return Ok(None);
    }
    let (mut lo, mut hi) = (i64::MIN as f64, i64::MAX as f64);
    for k in BOUNDS {
        let Some(v) = m.get(k) else { continue };
        let Some(x) = v.as_f64().filter(|x| x.abs() < 9.0e18) else {
            return err(
                k,
                format!("{k} must be a number within ±9e18 (the boolean form of draft 4 is not supported)"),
            );
        };
        match k {
            "minimum" => lo = lo.max(x.ceil()),
            "exclusiveMinimum" => lo = lo.max(x.floor() + 1.0),
            "maximum" => hi = hi.min(x.floor()),
            _ => hi = hi.min(x.ceil() - 1.0),
        }
    }
    if lo > hi {
        return err("minimum", "no integer lies between the minimum and the maximum");
    }
    Ok(Some((lo as i64, hi as i64)))
}

fn count(m: &Map<String, Value>, key: &str) -> Result<Option<u32>, SchemaError> {
    match m.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n <= MAX_COUNT => Ok(Some(n as u32)),
            _ => err(key, format!("{key} must be an integer between 0 and {MAX_COUNT}")),
        },
    }
}

impl<'a> Compiler<'a> {
    fn new(doc: &'a Value) -> Compiler<'a> {
        Compiler {
            doc,
            nodes: Vec::new(),
            refs: HashMap::new(),
            any: None,
            literal_bytes: 0,
            patterns: Vec::new(),
            one_ofs: Vec::new(),
        }
    }

    fn push(&mut self, n: Node) -> NodeId {
        self.nodes.push(n);
        (self.nodes.len() - 1) as NodeId
    }

    fn check_size(&self) -> Result<(), SchemaError> {
        if self.nodes.len() > MAX_NODES {
            return err("schema", format!("the schema compiles to more than {MAX_NODES} nodes"));
        }
        Ok(())
    }

    /// Any JSON value (objects of any keys, arrays of anything); made once.
    fn any(&mut self) -> NodeId {
        if let Some(a) = self.any {
            return a;
        }
        let any = self.push(Node::Union(Vec::new()));
        self.any = Some(any);
        let obj = self.push(Node::Object {
            keys: Vec::new(),
            values: Vec::new(),
            required: 0,
            additional: Some(any),
        });
        let arr = self.push(Node::Array {
            items: any,
            min: 0,
            max: u32::MAX,
        });
        let s = self.push(Node::String {
            min: 0,
            max: u32::MAX,
            pattern: None,
        });
        let n = self.push(Node::Number {
            integer: false,
            bounds: None,
        });
        let lits = self.push(Node::Literals(vec![
            b"false".to_vec(),
            b"null".to_vec(),
            b"true".to_vec(),
        ]));
        self.nodes[any as usize] = Node::Union(vec![obj, arr, s, n, lits]);
        any
    }

    fn literals(&mut self, values: &[&Value], keyword: &str) -> Result<NodeId, SchemaError> {
        if values.is_empty() {
            return err(keyword, format!("{keyword} allows no value"));
        }
        if values.len() > MAX_ENUM {
            return err(keyword, format!("{keyword} has more than {MAX_ENUM} values"));
        }
        let mut lits = Vec::with_capacity(values.len());
        for v in values {
            let b = serde_json::to_vec(v).map_err(|e| SchemaError {
                keyword: keyword.into(),
                message: e.to_string(),
            })?;
            self.literal_bytes += b.len();
            lits.push(b);
        }
        if self.literal_bytes > MAX_LITERAL_BYTES {
            return err(
                keyword,
                format!("enum and const values take more than {MAX_LITERAL_BYTES} bytes"),
            );
        }
        lits.sort();
        lits.dedup();
        Ok(self.push(Node::Literals(lits)))
    }

    fn node(&mut self, s: &Value, depth: usize) -> Result<NodeId, SchemaError> {
        self.check_size()?;
        if depth > MAX_DEPTH {
            return err("schema", format!("the schema nests deeper than {MAX_DEPTH} levels"));
        }
        let m = match s {
            Value::Bool(true) => return Ok(self.any()),
            Value::Bool(false) => return err("schema", "the schema `false` allows no value"),
            Value::Object(m) => m,
            _ => return err("schema", "a schema must be an object or a boolean"),
        };
        for k in m.keys() {
            if !ANNOTATIONS.contains(&k.as_str()) && !ENFORCED.contains(&k.as_str()) {
                return err(
                    k,
                    format!("the JSON schema keyword {k:?} is not supported by constrained sampling"),
                );
            }
        }
        let structural = |skip: &[&str]| {
            m.keys()
                .find(|k| {
                    !ANNOTATIONS.contains(&k.as_str())
                        && !["$defs", "definitions", "strict"].contains(&k.as_str())
                        && !skip.contains(&k.as_str())
                })
                .cloned()
        };
        if let Some(all) = m.get("allOf") {
            let merged = self.all_of(m, all)?;
            return self.node(&Value::Object(merged), depth + 1);
        }
        if let Some(r) = m.get("$ref") {
            if let Some(k) = structural(&["$ref"]) {
                return err(&k, format!("{k:?} beside \"$ref\" is not supported"));
            }
            let Some(r) = r.as_str() else {
                return err("$ref", "$ref must be a string");
            };
            return self.reference(r, depth);
        }
        let mut types: Vec<&str> = match m.get("type") {
            None => Vec::new(),
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => {
                let mut v = Vec::new();
                for t in ts {
                    match t.as_str() {
                        Some(t) => v.push(t),
                        None => return err("type", "type must be a string or an array of strings"),
                    }
                }
                if v.is_empty() {
                    return err("type", "type must name at least one type");
                }
                v
            }
            Some(_) => return err("type", "type must be a string or an array of strings"),
        };
        for t in &types {
            if !["object", "array", "string", "number", "integer", "boolean", "null"].contains(t) {
                return err("type", format!("unknown type {t:?}"));
            }
        }
        let nullable = match m.get("nullable") {
            None | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(_) => return err("nullable", "nullable must be a boolean"),
        };
        if nullable && !types.is_empty() && !types.contains(&"null") {
            types.push("null");
        }
        let allows = |v: &Value| {
            let k = kind(v);
            (types.is_empty() || types.contains(&k) || (k == "integer" && types.contains(&"number")))
                || (nullable && v.is_null())
        };
        if let Some(c) = m.get("const") {
            if m.contains_key("enum") {
                return err("enum", "enum beside const is not supported");
            }
            if !allows(c) {
                return err("const", "const does not have the schema's type");
            }
            return self.literals(&[c], "const");
        }
        if let Some(e) = m.get("enum") {
            let Some(vals) = e.as_array() else {
                return err("enum", "enum must be an array");
            };
            let vals: Vec<&Value> = vals.iter().filter(|v| allows(v)).collect();
            return self.literals(&vals, "enum");
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(alts) = m.get(key) {
                if let Some(k) = structural(&[key]) {
                    return err(&k, format!("{k:?} beside {key:?} is not supported"));
                }
                let Some(alts) = alts.as_array().filter(|a| !a.is_empty()) else {
                    return err(key, format!("{key} must be a non-empty array of schemas"));
                };
                if alts.len() > MAX_ALTS {
                    return err(key, format!("{key} has more than {MAX_ALTS} schemas"));
                }
                let mut ids = Vec::with_capacity(alts.len());
                for a in alts {
                    ids.push(self.node(a, depth + 1)?);
                }
                if key == "oneOf" {
                    self.one_ofs.push(ids.clone());
                }
                return Ok(self.push(Node::Union(ids)));
            }
        }
        if types.is_empty() {
            let has = |ks: &[&str]| ks.iter().any(|k| m.contains_key(*k));
            if has(&["properties", "required", "additionalProperties"]) {
                types.push("object");
            } else if has(&["items", "minItems", "maxItems"]) {
                types.push("array");
            } else if has(&["minLength", "maxLength", "pattern", "format"]) {
                types.push("string");
            } else if has(&BOUNDS) {
                types.push("number");
            } else {
                return Ok(self.any());
            }
        }
        let mut ids = Vec::new();
        for t in types {
            let id = match t {
                "object" => self.object(m, depth)?,
                "array" => {
                    let items = match m.get("items") {
                        None => self.any(),
                        Some(Value::Array(_)) => {
                            return err("items", "items as an array (tuples) is not supported");
                        }
                        Some(i) => self.node(i, depth + 1)?,
                    };
                    let min = count(m, "minItems")?.unwrap_or(0);
                    let max = count(m, "maxItems")?.unwrap_or(u32::MAX);
                    if min > max {
                        return err("minItems", "minItems is above maxItems");
                    }
                    self.push(Node::Array { items, min, max })
                }
                "string" => {
                    let min = count(m, "minLength")?.unwrap_or(0);
                    let max = count(m, "maxLength")?.unwrap_or(u32::MAX);
                    if min > max {
                        return err("minLength", "minLength is above maxLength");
                    }
                    let pattern = self.pattern(m)?;
                    self.push(Node::String { min, max, pattern })
                }
                "number" => {
                    if let Some(k) = BOUNDS.iter().find(|k| m.contains_key(**k)) {
                        return err(
                            k,
                            format!("{k} is enforced on integers only: use \"type\": \"integer\", or drop the bound"),
                        );
                    }
                    self.push(Node::Number {
                        integer: false,
                        bounds: None,
                    })
                }
                "integer" => {
                    let bounds = integer_bounds(m)?;
                    self.push(Node::Number { integer: true, bounds })
                }
                "boolean" => self.push(Node::Literals(vec![b"false".to_vec(), b"true".to_vec()])),
                _ => self.push(Node::Literals(vec![b"null".to_vec()])),
            };
            ids.push(id);
        }
        Ok(if ids.len() == 1 {
            ids[0]
        } else {
            self.push(Node::Union(ids))
        })
    }

    /// The string's `pattern` or `format`, compiled once per schema object. A length bound beside it is refused:
    /// the matcher could then reach a prefix that no allowed length completes (put the length into the pattern).
    fn pattern(&mut self, m: &Map<String, Value>) -> Result<Option<u32>, SchemaError> {
        let p = match (m.get("pattern"), m.get("format")) {
            (None, None) => return Ok(None),
            (Some(_), Some(_)) => return err("format", "format beside pattern is not supported"),
            (Some(Value::String(p)), None) => Pattern::compile(p, "pattern")?,
            (None, Some(Value::String(f))) => Pattern::format(f)?,
            (Some(_), None) => return err("pattern", "pattern must be a string"),
            (None, Some(_)) => return err("format", "format must be a string"),
        };
        for k in ["minLength", "maxLength"] {
            if m.contains_key(k) {
                return err(
                    k,
                    format!("{k} beside pattern or format is not supported: give the length in the pattern ({{m,n}})"),
                );
            }
        }
        self.patterns.push(p);
        Ok(Some((self.patterns.len() - 1) as u32))
    }

    fn object(&mut self, m: &Map<String, Value>, depth: usize) -> Result<NodeId, SchemaError> {
        let empty = Map::new();
        let props = match m.get("properties") {
            None => &empty,
            Some(Value::Object(p)) => p,
            Some(_) => return err("properties", "properties must be an object"),
        };
        let required: Vec<&str> = match m.get("required") {
            None => Vec::new(),
            Some(Value::Array(r)) => {
                let mut v = Vec::new();
                for k in r {
                    match k.as_str() {
                        Some(k) => v.push(k),
                        None => return err("required", "required must be an array of strings"),
                    }
                }
                v
            }
            Some(_) => return err("required", "required must be an array of strings"),
        };
        let additional = match m.get("additionalProperties") {
            None | Some(Value::Bool(true)) => Some(self.any()),
            Some(Value::Bool(false)) => None,
            Some(s) => Some(self.node(s, depth + 1)?),
        };
        let mut entries: Vec<(Vec<u8>, NodeId, bool)> = Vec::new();
        for (k, v) in props {
            let id = self.node(v, depth + 1)?;
            entries.push((escaped(k), id, required.contains(&k.as_str())));
        }
        for r in &required {
            if !props.contains_key(*r) {
                match additional {
                    Some(a) => entries.push((escaped(r), a, true)),
                    None => {
                        return err(
                            "required",
                            format!("{r:?} is required but not among the properties, and no other property is allowed"),
                        );
                    }
                }
            }
        }
        if entries.len() > MAX_PROPS {
            return err(
                "properties",
                format!("an object may have at most {MAX_PROPS} properties"),
            );
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let mut req = 0u64;
        for (i, e) in entries.iter().enumerate() {
            if e.2 {
                req |= 1 << i;
            }
        }
        Ok(self.push(Node::Object {
            keys: entries.iter().map(|e| e.0.clone()).collect(),
            values: entries.iter().map(|e| e.1).collect(),
            required: req,
            additional,
        }))
    }

    /// The schema a `$ref` names within the document.
    fn target(&self, r: &str) -> Result<&'a Value, SchemaError> {
        if r == "#" {
            return Ok(self.doc);
        }
        let Some((section, name)) = r
            .strip_prefix("#/$defs/")
            .map(|n| ("$defs", n))
            .or_else(|| r.strip_prefix("#/definitions/").map(|n| ("definitions", n)))
        else {
            return err(
                "$ref",
                format!("$ref {r:?}: only \"#\", \"#/$defs/NAME\" and \"#/definitions/NAME\" are supported"),
            );
        };
        let name = name.replace("~1", "/").replace("~0", "~");
        match self.doc.get(section).and_then(|d| d.get(&name)) {
            Some(t) => Ok(t),
            None => err("$ref", format!("$ref {r:?} names no definition")),
        }
    }

    /// `allOf` merged with the schema around it into one schema, where that is simple: each keyword given once,
    /// or the same everywhere; `properties` joined (a property in several with different schemas is refused);
    /// `required` joined. A branch may be a `$ref` (followed once, not through another). Anything else is a 400.
    fn all_of(&self, m: &Map<String, Value>, all: &Value) -> Result<Map<String, Value>, SchemaError> {
        let Some(branches) = all.as_array().filter(|a| !a.is_empty()) else {
            return err("allOf", "allOf must be a non-empty array of schemas");
        };
        if branches.len() > MAX_ALTS {
            return err("allOf", format!("allOf has more than {MAX_ALTS} schemas"));
        }
        let mut out = m.clone();
        out.remove("allOf");
        let cannot = |why: String| -> Result<Map<String, Value>, SchemaError> {
            err("allOf", format!("allOf cannot be merged into one schema: {why}"))
        };
        let mut parts = vec![m];
        for b in branches {
            let b = match b.get("$ref").and_then(Value::as_str) {
                Some(r) if b.as_object().is_some_and(|o| o.len() == 1) => self.target(r)?,
                _ => b,
            };
            let Some(bm) = b.as_object() else {
                if b == &Value::Bool(true) {
                    continue;
                }
                return cannot("a branch is not a schema object".into());
            };
            parts.push(bm);
            for (k, v) in bm {
                if ANNOTATIONS.contains(&k.as_str()) {
                    continue;
                }
                if ["allOf", "$ref", "$defs", "definitions"].contains(&k.as_str()) {
                    return cannot(format!("a branch holds {k:?}"));
                }
                match (k.as_str(), out.get_mut(k)) {
                    (_, None) => {
                        out.insert(k.clone(), v.clone());
                    }
                    (_, Some(have)) if have == v => {}
                    ("properties", Some(Value::Object(have))) => {
                        let Some(more) = v.as_object() else {
                            return err("properties", "properties must be an object");
                        };
                        for (p, ps) in more {
                            match have.get(p) {
                                Some(x) if x != ps => {
                                    return cannot(format!("property {p:?} has two different schemas"));
                                }
                                _ => {
                                    have.insert(p.clone(), ps.clone());
                                }
                            }
                        }
                    }
                    ("required", Some(Value::Array(have))) => {
                        let Some(more) = v.as_array() else {
                            return err("required", "required must be an array of strings");
                        };
                        for r in more {
                            if !have.contains(r) {
                                have.push(r.clone());
                            }
                        }
                    }
                    _ => return cannot(format!("{k:?} is given twice with different values")),
                }
            }
        }
        // `additionalProperties` speaks of the properties beside it only: a part that limits it must itself name
        // every property and required key of the merge, or the merge would allow keys that part forbids.
        let names = |o: &Map<String, Value>| -> Vec<String> {
            let props = o
                .get("properties")
                .and_then(Value::as_object)
                .into_iter()
                .flat_map(|p| p.keys().cloned());
            let req = o.get("required").and_then(Value::as_array).into_iter().flatten();
            props
                .chain(req.filter_map(|r| r.as_str().map(str::to_string)))
                .collect()
        };
        let merged = names(&out);
        for p in &parts {
            if p.get("additionalProperties").is_some_and(|a| a != &Value::Bool(true)) {
                let own = names(p);
                if let Some(k) = merged.iter().find(|k| !own.contains(k)) {
                    return cannot(format!(
                        "a schema with additionalProperties does not name {k:?}, which another part of the allOf does"
                    ));
                }
            }
        }
        Ok(out)
    }

    fn reference(&mut self, r: &str, depth: usize) -> Result<NodeId, SchemaError> {
        if let Some(&id) = self.refs.get(r) {
            return Ok(id);
        }
        if self.refs.len() >= MAX_REFS {
            return err("$ref", format!("more than {MAX_REFS} distinct $ref targets"));
        }
        let target = self.target(r)?;
        let id = self.push(Node::Alias(NodeId::MAX));
        self.refs.insert(r.to_string(), id);
        let t = self.node(target, depth + 1)?;
        self.nodes[id as usize] = Node::Alias(t);
        Ok(id)
    }

    /// Resolves aliases and unions into each node's start shapes; a reference cycle that never reaches an object
    /// or array (`a = anyOf[a, …]`) is refused.
    fn finish(self, root: NodeId) -> Result<Grammar, SchemaError> {
        let n = self.nodes.len();
        let mut starts: Vec<Option<Vec<NodeId>>> = vec![None; n];
        let mut visiting = vec![false; n];
        fn resolve(
            nodes: &[Node],
            id: NodeId,
            starts: &mut [Option<Vec<NodeId>>],
            visiting: &mut [bool],
        ) -> Result<Vec<NodeId>, SchemaError> {
            let i = id as usize;
            if let Some(s) = &starts[i] {
                return Ok(s.clone());
            }
            if visiting[i] {
                return err(
                    "$ref",
                    "a $ref or anyOf refers to itself without an object or array between",
                );
            }
            visiting[i] = true;
            let out = match &nodes[i] {
                Node::Alias(t) => resolve(nodes, *t, starts, visiting)?,
                Node::Union(ms) => {
                    let mut v = Vec::new();
                    for m in ms {
                        for s in resolve(nodes, *m, starts, visiting)? {
                            if !v.contains(&s) {
                                v.push(s);
                            }
                        }
                    }
                    if v.len() > MAX_ALTS {
                        return err("anyOf", format!("a value may take more than {MAX_ALTS} shapes"));
                    }
                    v
                }
                _ => vec![id],
            };
            visiting[i] = false;
            starts[i] = Some(out.clone());
            Ok(out)
        }
        for id in 0..n {
            resolve(&self.nodes, id as NodeId, &mut starts, &mut visiting)?;
        }
        let starts: Vec<Vec<NodeId>> = starts.into_iter().map(|s| s.unwrap_or_default()).collect();
        for branches in &self.one_ofs {
            for (i, &a) in branches.iter().enumerate() {
                for (j, &b) in branches.iter().enumerate().skip(i + 1) {
                    let mut budget = DISJOINT_BUDGET;
                    if !disjoint(&self.nodes, &starts, a, b, &mut budget) {
                        return err(
                            "oneOf",
                            format!(
                                "oneOf branches {i} and {j} may match the same value; oneOf is enforced only when \
                                 its branches cannot overlap (different types, different const/enum values, objects \
                                 told apart by a required property's const/enum or by a required key the other \
                                 forbids): use anyOf if a value may match both"
                            ),
                        );
                    }
                }
            }
        }
        Ok(Grammar {
            nodes: self.nodes,
            starts,
            root,
            patterns: self.patterns,
        })
    }
}

/// A key as it appears between the quotes of compact JSON.
fn escaped(k: &str) -> Vec<u8> {
    let s = serde_json::to_vec(k).unwrap_or_default();
    s[1..s.len() - 1].to_vec()
}

/// Whether no value can match both `a` and `b` (judged on their start shapes, conservatively: "may overlap" when
/// unsure).
/// `budget` bounds the comparisons (recursive and hostile schemas): when it runs out, "may overlap".
fn disjoint(nodes: &[Node], starts: &[Vec<NodeId>], a: NodeId, b: NodeId, budget: &mut u32) -> bool {
    starts[a as usize].iter().all(|&x| {
        starts[b as usize]
            .iter()
            .all(|&y| !overlap(nodes, starts, x, y, budget))
    })
}

/// Whether two concrete shapes may match one value.
fn overlap(nodes: &[Node], starts: &[Vec<NodeId>], x: NodeId, y: NodeId, budget: &mut u32) -> bool {
    if *budget == 0 {
        return true;
    }
    *budget -= 1;
    let lits_start = |l: &[Vec<u8>], f: &dyn Fn(u8) -> bool| l.iter().any(|t| t.first().copied().is_some_and(f));
    match (&nodes[x as usize], &nodes[y as usize]) {
        (Node::Literals(a), Node::Literals(b)) => a.iter().any(|t| b.contains(t)),
        (Node::Literals(l), other) | (other, Node::Literals(l)) => match other {
            Node::String { .. } => lits_start(l, &|c| c == b'"'),
            Node::Number { .. } => lits_start(l, &|c| c == b'-' || c.is_ascii_digit()),
            Node::Object { .. } => lits_start(l, &|c| c == b'{'),
            Node::Array { .. } => lits_start(l, &|c| c == b'['),
            _ => true,
        },
        (Node::Object { .. }, Node::Object { .. }) => !objects_disjoint(nodes, starts, x, y, budget),
        (Node::String { .. }, Node::String { .. })
        | (Node::Number { .. }, Node::Number { .. })
        | (Node::Array { .. }, Node::Array { .. }) => true,
        _ => false,
    }
}

/// Two object shapes no object matches both: a key both require whose values are disjoint, or a key one requires
/// that the other does not allow.
fn objects_disjoint(nodes: &[Node], starts: &[Vec<NodeId>], x: NodeId, y: NodeId, budget: &mut u32) -> bool {
    let (
        Node::Object {
            keys: kx,
            values: vx,
            required: rx,
            additional: ax,
        },
        Node::Object {
            keys: ky,
            values: vy,
            required: ry,
            additional: ay,
        },
    ) = (&nodes[x as usize], &nodes[y as usize])
    else {
        return false;
    };
    let required = |k: &[Vec<u8>], r: u64| -> Vec<usize> { (0..k.len()).filter(|&i| r >> i & 1 == 1).collect() };
    for i in required(kx, *rx) {
        let told_apart = match ky.iter().position(|k| *k == kx[i]) {
            Some(j) => ry >> j & 1 == 1 && disjoint(nodes, starts, vx[i], vy[j], budget),
            None => ay.is_none(),
        };
        if told_apart {
            return true;
        }
    }
    required(ky, *ry)
        .into_iter()
        .any(|j| ax.is_none() && !kx.contains(&ky[j]))
}
