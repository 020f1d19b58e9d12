//! Compact-but-readable JSON: containers go one element per line, except that arrays of scalars and
//! short flat objects stay on one line, so golden files diff well and stay small.

use serde_json::Value;

const INLINE_WIDTH: usize = 160;

pub fn render(v: &Value) -> String {
    let mut out = String::new();
    write(v, 0, &mut out);
    out.push('\n');
    out
}

fn is_scalar(v: &Value) -> bool {
    !matches!(v, Value::Array(_) | Value::Object(_))
}

/// A value that stays on one line: a scalar, an array of scalars (any length), or a flat object or
/// short array whose compact form fits the width.
fn inline(v: &Value) -> Option<String> {
    let compact = || serde_json::to_string(v).unwrap_or_default();
    match v {
        Value::Array(items) if items.iter().all(is_scalar) => Some(compact()),
        Value::Array(items)
            if items
                .iter()
                .all(|i| matches!(i, Value::Array(a) if a.iter().all(is_scalar))) =>
        {
            let s = compact();
            (s.len() <= INLINE_WIDTH).then_some(s)
        }
        Value::Object(map) if map.values().all(|x| is_scalar(x) || inline(x).is_some()) => {
            let s = compact();
            (s.len() <= INLINE_WIDTH).then_some(s)
        }
        _ if is_scalar(v) => Some(compact()),
        _ => None,
    }
}

fn write(v: &Value, indent: usize, out: &mut String) {
    if let Some(s) = inline(v) {
        out.push_str(&s);
        return;
    }
    let pad = " ".repeat(indent + 1);
    match v {
        Value::Array(items) => {
            out.push_str("[\n");
            for (i, item) in items.iter().enumerate() {
                out.push_str(&pad);
                write(item, indent + 1, out);
                out.push_str(if i + 1 < items.len() { ",\n" } else { "\n" });
            }
            out.push_str(&" ".repeat(indent));
            out.push(']');
        }
        Value::Object(map) => {
            out.push_str("{\n");
            let n = map.len();
            for (i, (k, item)) in map.iter().enumerate() {
                out.push_str(&pad);
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                write(item, indent + 1, out);
                out.push_str(if i + 1 < n { ",\n" } else { "\n" });
            }
            out.push_str(&" ".repeat(indent));
            out.push('}');
        }
        _ => unreachable!("scalars are inlined"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn round_trips_and_keeps_scalar_arrays_inline() {
        let v = json!({"a": [1, 2, 3], "b": {"x": 1}, "c": [{"t": "long"}, [1, [2]]]});
        let s = render(&v);
        assert!(s.contains("\"a\": [1,2,3]"));
        let back: Value = serde_json::from_str(&s).unwrap();
        assert_eq!(back, v);
    }
}
