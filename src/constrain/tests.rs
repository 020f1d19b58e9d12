use super::*;
use serde_json::json;

fn grammar(schema: serde_json::Value) -> Grammar {
    Grammar::compile(&schema).unwrap_or_else(|e| panic!("{schema}: {e}"))
}

/// Whether `text` is a whole value of `g`.
fn accepts(g: &Grammar, text: &str) -> bool {
    let mut m = Matcher::new(g);
    m.advance_bytes(g, text.as_bytes()) && m.is_complete(g)
}

/// Whether `text` can still become a value of `g`.
fn prefix_ok(g: &Grammar, text: &str) -> bool {
    Matcher::new(g).advance_bytes(g, text.as_bytes())
}

fn check(schema: serde_json::Value, good: &[&str], bad: &[&str]) {
    let g = grammar(schema.clone());
    for t in good {
        assert!(accepts(&g, t), "{schema} should accept {t}");
        serde_json::from_str::<serde_json::Value>(t).expect("the good cases are JSON");
    }
    for t in bad {
        assert!(!accepts(&g, t), "{schema} should reject {t}");
    }
}

#[test]
fn objects_follow_properties_required_and_additional() {
    let s = json!({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"}},
                   "required":["a"],"additionalProperties":false});
    check(
        s.clone(),
        &[r#"{"a":1}"#, r#"{"b":"x","a":-20}"#, "{ \"a\" : 0 ,\n \"b\": \"\" }"],
        &[
            r#"{}"#,
            r#"{"b":"x"}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,"c":2}"#,
            r#"{"a":1.5}"#,
            r#"{"a":1,}"#,
            r#"{"a":01}"#,
        ],
    );
    let g = grammar(s);
    assert!(!prefix_ok(&g, r#"{"c"#), "no key starts with c");
    assert!(!prefix_ok(&g, r#"{"a":1} "#), "nothing after the value");
    check(
        json!({"type":"object","properties":{"a":{"type":"integer"}}}),
        &[r#"{"a":1,"zz":[true,null,{"q":"w"}]}"#, "{}"],
        &[r#"{"a":"1"}"#, r#"{"zz":1,"zz":2}"#.replace("zz", "a").as_str()],
    );
    check(
        json!({"type":"object","additionalProperties":{"type":"boolean"}}),
        &[r#"{"x":true,"y":false}"#],
        &[r#"{"x":1}"#],
    );
}

#[test]
fn strings_enums_and_consts() {
    check(
        json!({"type":"string","minLength":2,"maxLength":3}),
        &[r#""ab""#, r#""é\n""#, r#""\u00e9ab""#],
        &[r#""a""#, r#""abcd""#, r#""a"#, "\"a\u{1}\"", r#""\ud800x""#, r#""\q""#],
    );
    check(
        json!({"enum":["red","green",3,null,{"k":[1]}]}),
        &[r#""red""#, r#""green""#, "3", "null", r#"{"k":[1]}"#],
        &[r#""blue""#, "30", r#""re""#, "true"],
    );
    check(json!({"const":"x"}), &[r#""x""#], &[r#""y""#]);
    check(json!({"type":"string","enum":["a",1]}), &[r#""a""#], &["1"]);
}

#[test]
fn numbers_booleans_and_null() {
    check(
        json!({"type":"number"}),
        &["0", "-1.5", "3e10", "2.5E-3", "12"],
        &["01", "-", "1.", ".5", "1e", "+1", "NaN"],
    );
    check(json!({"type":"integer"}), &["0", "-7", "123"], &["1.0", "1e3", "-0.5"]);
    check(json!({"type":"boolean"}), &["true", "false"], &["null", "tru"]);
    check(json!({"type":"null"}), &["null"], &["0"]);
    check(json!({"type":["string","null"]}), &["null", r#""s""#], &["1"]);
    check(json!({"type":"integer","nullable":true}), &["null", "4"], &[r#""4""#]);
    let long = "1".repeat(40);
    check(json!({"type":"integer"}), &[], &[&long]);
}

#[test]
fn arrays_with_items_and_counts() {
    check(
        json!({"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":3}),
        &["[1]", "[1,2,3]", "[ 1 , 2 ]"],
        &["[]", "[1,2,3,4]", r#"["a"]"#, "[1,]", "[1"],
    );
    check(json!({"type":"array"}), &["[]", r#"[1,"a",[{}]]"#], &["[,]"]);
}

#[test]
fn any_of_one_of_and_refs() {
    check(
        json!({"anyOf":[{"type":"object","properties":{"cat":{"type":"string"}},"required":["cat"],
                          "additionalProperties":false},
                         {"type":"object","properties":{"dog":{"type":"integer"}},"required":["dog"],
                          "additionalProperties":false}]}),
        &[r#"{"cat":"tom"}"#, r#"{"dog":3}"#],
        &[r#"{"cat":3}"#, r#"{"dog":"x"}"#, "{}"],
    );
    check(
        json!({"oneOf":[{"type":"integer"},{"type":"string"}]}),
        &["1", r#""1""#],
        &["true"],
    );
    // A recursive list through $defs.
    let tree = json!({"$ref":"#/$defs/node","$defs":{"node":{"type":"object","properties":{
        "v":{"type":"integer"},"kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},
        "required":["v"],"additionalProperties":false}}});
    check(
        tree,
        &[r#"{"v":1}"#, r#"{"v":1,"kids":[{"v":2,"kids":[]},{"v":3}]}"#],
        &[r#"{"v":1,"kids":[{}]}"#],
    );
    check(
        json!({"definitions":{"n":{"type":"number"}},"type":"object","properties":{"x":{"$ref":"#/definitions/n"}},
               "required":["x"]}),
        &[r#"{"x":2.5}"#],
        &[r#"{"x":"2"}"#],
    );
}

#[test]
fn json_object_mode_is_any_object() {
    let g = Grammar::any_object();
    assert!(accepts(&g, r#"{"a":[1,{"b":null}],"c":"d"}"#));
    assert!(accepts(&g, "{}"));
    assert!(!accepts(&g, "[1]"));
    assert!(!accepts(&g, "\"s\""));
    // Bounded whitespace.
    assert!(prefix_ok(&g, "{  \n  "));
    assert!(!prefix_ok(&g, &format!("{{{}", " ".repeat(40))));
}

#[test]
fn unsupported_and_hostile_schemas_are_refused_by_name() {
    for (schema, keyword) in [
        (json!({"type":"string","pattern":"a+"}), "pattern"),
        (json!({"type":"string","format":"email"}), "format"),
        (json!({"type":"number","minimum":3}), "minimum"),
        (json!({"allOf":[{"type":"string"}]}), "allOf"),
        (json!({"type":"array","items":[{"type":"string"}]}), "items"),
        (json!({"$ref":"http://example.com/s"}), "$ref"),
        (json!({"$ref":"#/$defs/missing"}), "$ref"),
        (json!({"$ref":"#/$defs/a","$defs":{"a":{"$ref":"#/$defs/a"}}}), "$ref"),
        (
            json!({"$ref":"#/$defs/a","$defs":{"a":{"anyOf":[{"$ref":"#/$defs/a"},{"type":"null"}]}}}),
            "$ref",
        ),
        (json!({"enum":[]}), "enum"),
        (json!(false), "schema"),
        (json!({"type":"bogus"}), "type"),
        (
            json!({"type":"object","required":["x"],"additionalProperties":false}),
            "required",
        ),
    ] {
        let e = Grammar::compile(&schema).expect_err(&schema.to_string());
        assert_eq!(e.keyword, keyword, "{schema}: {}", e.message);
    }
    // Size bounds: enum count, properties, depth, distinct refs.
    let many: Vec<i64> = (0..1000).collect();
    assert_eq!(Grammar::compile(&json!({"enum":many})).unwrap_err().keyword, "enum");
    let props: serde_json::Map<String, serde_json::Value> =
        (0..100).map(|i| (format!("p{i}"), json!({"type":"null"}))).collect();
    assert_eq!(
        Grammar::compile(&json!({"type":"object","properties":props}))
            .unwrap_err()
            .keyword,
        "properties"
    );
    let mut deep = json!({"type":"string"});
    for _ in 0..100 {
        deep = json!({"type":"array","items":deep});
    }
    assert_eq!(Grammar::compile(&deep).unwrap_err().keyword, "schema");
    let defs: serde_json::Map<String, serde_json::Value> = (0..300)
        .map(|i| (format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)})))
        .collect();
    let e = Grammar::compile(&json!({"$ref":"#/$defs/d0","$defs":defs})).unwrap_err();
    assert!(e.keyword == "$ref" || e.keyword == "schema", "{e:?}");
}

#[test]
fn deep_output_nesting_is_bounded() {
    let g = Grammar::any_object();
    let mut m = Matcher::new(&g);
    assert!(m.advance(&g, b'{'));
    let mut ok = true;
    for _ in 0..200 {
        ok = m.advance_bytes(&g, br#""a":["#) && ok;
        if !ok {
            break;
        }
    }
    assert!(!ok, "nesting stops at the stack bound");
}

/// The mask from the trie walk equals checking every token's bytes one by one, on SmolLM2's real vocabulary.
#[test]
fn mask_equals_brute_force_on_a_real_vocabulary() {
    let path = crate::fetch::resolve("smollm2").expect("smollm2 in the model cache");
    let text = crate::generate::TextModel::open(&path).unwrap();
    let v = &text.vocab;
    let trie = text.token_trie();
    let schema = json!({"type":"object","properties":{"name":{"type":"string","maxLength":8},
        "age":{"type":"integer"},"tags":{"type":"array","items":{"enum":["a","bc"]},"maxItems":2},
        "ok":{"type":["boolean","null"]}},"required":["name","age"],"additionalProperties":false});
    let g = grammar(schema);
    let prefixes = [
        "",
        "{",
        "{\"",
        "{\"na",
        "{\"name\": \"Bob",
        "{\"name\":\"abcdefgh",
        "{\"name\":\"x\",\"age\":1",
        "{\"name\":\"x\",\"age\":12,\"tags\":[\"bc\"",
        "{\"name\":\"x\",\"age\":12,\"ok\":nu",
        "{\"name\":\"x\",\"age\":12}",
    ];
    let mut levels = Vec::new();
    let mut out = Vec::new();
    for p in prefixes {
        let mut m = Matcher::new(&g);
        assert!(m.advance_bytes(&g, p.as_bytes()), "{p}");
        trie.allowed(&g, &m, &mut levels, &mut out);
        let mut fast = out.clone();
        fast.sort_unstable();
        fast.dedup();
        let mut brute = Vec::new();
        for id in 0..v.n_tokens() as u32 {
            if v.is_eog(id) {
                if m.is_complete(&g) {
                    brute.push(id);
                }
                continue;
            }
            let b = v.token_bytes(id);
            if v.is_control(id) || b.is_empty() {
                continue;
            }
            let mut c = m.clone();
            if c.advance_bytes(&g, b) {
                brute.push(id);
            }
        }
        assert_eq!(fast, brute, "after {p:?}");
        assert!(!fast.is_empty(), "after {p:?} something is allowed");
    }
}

/// Per-step mask cost on SmolLM2's vocabulary (printed; `cargo nextest run --lib constrain::tests::mask_cost
/// --no-capture`). Bounded so it also guards against a pathological slowdown.
#[test]
fn mask_cost() {
    let path = crate::fetch::resolve("smollm2").expect("smollm2 in the model cache");
    let text = crate::generate::TextModel::open(&path).unwrap();
    let t0 = std::time::Instant::now();
    let trie = text.token_trie();
    let build = t0.elapsed();
    let g = Grammar::any_object();
    let mut levels = Vec::new();
    let mut out = Vec::new();
    for (name, p) in [
        ("object start", "{"),
        ("inside a string", "{\"text\": \"hello wor"),
        ("after a value", "{\"a\": 1"),
        ("in a number", "{\"a\": 12"),
    ] {
        let mut m = Matcher::new(&g);
        assert!(m.advance_bytes(&g, p.as_bytes()));
        let n = 20;
        let t = std::time::Instant::now();
        for _ in 0..n {
            trie.allowed(&g, &m, &mut levels, &mut out);
        }
        let per = t.elapsed() / n;
        println!(
            "mask {name:16} {:7.3} ms, {} tokens allowed (trie {} nodes, built in {:.1} ms)",
            per.as_secs_f64() * 1e3,
            out.len(),
            trie.n_nodes(),
            build.as_secs_f64() * 1e3
        );
        assert!(per < std::time::Duration::from_millis(200), "{name}: {per:?}");
    }
}
