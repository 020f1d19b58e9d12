use super::matcher::MAX_FREE_KEYS;
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
fn keys_outside_properties_never_repeat() {
    let map = json!({"type":"object","properties":{"a":{"type":"integer"}},"additionalProperties":{}});
    check(
        map.clone(),
        &[
            r#"{"x":1,"xy":2,"y":{"x":1,"y":2},"a":3}"#,
            r#"{"x":{"x":{"x":1}},"y":{"x":2}}"#,
        ],
        &[
            r#"{"x":1,"x":2}"#,
            r#"{"x":1,"y":{"z":2},"x":3}"#,
            r#"{"y":{"z":1,"z":2}}"#,
            r#"{"a":1,"a":2}"#,
        ],
    );
    let g = grammar(map);
    assert!(!prefix_ok(&g, r#"{"x":1,"x""#), "refused at the key's closing quote");
    assert!(prefix_ok(&g, r#"{"x":1,"xx""#), "a longer key is another key");
    // `json_object` has the same rule.
    let any = Grammar::any_object();
    assert!(accepts(&any, r#"{"k":[{"k":1}],"j":{"k":2}}"#));
    assert!(!accepts(&any, r#"{"k":[{"k":1}],"k":2}"#));
    // Past MAX_FREE_KEYS other keys the object may only end (or take its named keys).
    let keys: Vec<String> = (0..MAX_FREE_KEYS).map(|i| format!("\"k{i}\":0")).collect();
    let full = format!("{{{}", keys.join(","));
    assert!(accepts(&g, &format!("{full}}}")) && accepts(&g, &format!("{full},\"a\":1}}")));
    assert!(!prefix_ok(&g, &format!("{full},\"z")));
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
        (json!({"type":"string","pattern":"(?=a)"}), "pattern"),
        (json!({"type":"string","pattern":"a+","maxLength":3}), "maxLength"),
        (json!({"type":"string","format":"hostname"}), "format"),
        (json!({"type":"number","minimum":3}), "minimum"),
        (json!({"maximum":3}), "maximum"),
        (json!({"type":"integer","minimum":3,"maximum":2}), "minimum"),
        (json!({"type":"integer","exclusiveMinimum":true}), "exclusiveMinimum"),
        (json!({"type":"integer","multipleOf":2}), "multipleOf"),
        (json!({"allOf":[{"type":"string"},{"type":"integer"}]}), "allOf"),
        (json!({"allOf":[{"not":{"type":"string"}}]}), "not"),
        (json!({"oneOf":[{"type":"integer"},{"type":"number"}]}), "oneOf"),
        (
            json!({"oneOf":[{"type":"object"},{"type":"object","properties":{"a":{"const":1}}}]}),
            "oneOf",
        ),
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
        "ok":{"type":["boolean","null"]},"note":{"type":"string"},"code":{"pattern":"^[a-z]+-[0-9]{2}$"},
        "n":{"type":"integer","minimum":10,"maximum":99}},"required":["name","age"],"additionalProperties":false});
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
        "{\"note\":\"",
        "{\"note\":\"hello wor",
        "{\"note\":\"caf\u{e9}",
        "{\"note\":\"a\\",
        "{\"code\":\"ab",
        "{\"code\":\"ab-",
        "{\"n\":",
        "{\"n\":9",
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
    let any = Grammar::any_object();
    // A string with a length bound takes the full walk (no plain-subtree shortcut): the cost before it.
    let bounded = grammar(json!({"type":"object","additionalProperties":{"type":"string","maxLength":1000000}}));
    let mut levels = Vec::new();
    let mut out = Vec::new();
    for (name, g, p) in [
        ("object start", &any, "{"),
        ("inside a string", &any, "{\"text\": \"hello wor"),
        ("in a bounded str", &bounded, "{\"text\": \"hello wor"),
        ("after a value", &any, "{\"a\": 1"),
        ("in a number", &any, "{\"a\": 12"),
    ] {
        let mut m = Matcher::new(g);
        assert!(m.advance_bytes(g, p.as_bytes()));
        let n = 20;
        let t = std::time::Instant::now();
        for _ in 0..n {
            trie.allowed(g, &m, &mut levels, &mut out);
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

#[test]
fn patterns_and_formats_constrain_strings() {
    check(
        json!({"type":"string","pattern":"^[A-Z]{2}-\\d{3}$"}),
        &[r#""AB-123""#],
        &[r#""ab-123""#, r#""AB-12""#, r#""AB-1234""#, r#""A\u0042-123""#],
    );
    // Unanchored: a match anywhere.
    check(
        json!({"pattern":"cat"}),
        &[r#""concatenate""#, r#""cat""#],
        &[r#""dog""#, "1"],
    );
    let g = grammar(json!({"type":"string","pattern":"^a+$"}));
    assert!(!prefix_ok(&g, r#""ab"#), "a dead pattern stops the string at once");
    check(
        json!({"type":"string","format":"date-time"}),
        &[r#""2026-11-26T12:34:56Z""#, r#""2026-11-26T12:34:56.5+01:00""#],
        &[r#""2026-11-26""#, r#""2026-11-26T25:00:00Z""#],
    );
    check(
        json!({"format":"uuid"}),
        &[r#""123e4567-e89b-12d3-a456-426614174000""#],
        &[r#""123""#],
    );
    check(
        json!({"type":"string","format":"email"}),
        &[r#""a.b@c.io""#],
        &[r#""a@b""#, r#""@b.io""#],
    );
}

#[test]
fn integer_bounds_never_dead_end() {
    let s = json!({"type":"integer","minimum":-5,"exclusiveMaximum":120});
    check(s.clone(), &["-5", "0", "7", "119", "-0"], &["-6", "120", "1000", "-10"]);
    let g = grammar(s);
    // Every accepted prefix can still be completed inside the bounds.
    assert!(!prefix_ok(&g, "-6"), "-6 cannot become a value ≥ -5");
    assert!(!prefix_ok(&g, "1200"));
    check(
        json!({"type":"integer","minimum":1000}),
        &["1000", "99999"],
        &["999", "-1", "0"],
    );
    assert!(
        prefix_ok(&grammar(json!({"type":"integer","minimum":1000})), "9"),
        "9 can become 9000"
    );
    check(
        json!({"type":"integer","maximum":-10}),
        &["-10", "-300"],
        &["-9", "0", "5"],
    );
    check(
        json!({"type":"integer","minimum":2.5,"maximum":3.5}),
        &["3"],
        &["2", "4", "3.0"],
    );
}

#[test]
fn one_of_enforced_exactly_or_refused_and_all_of_merged() {
    // Told apart by a required const: enforced as is.
    let shapes = json!({"oneOf":[
        {"type":"object","properties":{"kind":{"const":"circle"},"r":{"type":"number"}},"required":["kind","r"]},
        {"type":"object","properties":{"kind":{"const":"square"},"side":{"type":"number"}},"required":["kind","side"]}]});
    check(
        shapes,
        &[r#"{"kind":"circle","r":1}"#, r#"{"side":2,"kind":"square"}"#],
        &[r#"{"kind":"oval","r":1}"#],
    );
    check(
        json!({"oneOf":[{"enum":[1,2]},{"enum":[3]},{"type":"string"}]}),
        &["1", "3", r#""x""#],
        &["4"],
    );
    let e = Grammar::compile(&json!({"oneOf":[{"enum":[1,2]},{"type":"integer"}]})).unwrap_err();
    assert!(e.keyword == "oneOf" && e.message.contains("anyOf"), "{e:?}");
    check(
        json!({"allOf":[{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"}},"required":["a"],
                         "additionalProperties":false},
                        {"required":["b"]}]}),
        &[r#"{"a":1,"b":"x"}"#],
        &[r#"{"a":1}"#, r#"{"b":"x"}"#, r#"{"a":1,"b":"x","c":0}"#],
    );
    // additionalProperties beside no properties forbids every key: merging the branches' properties under it would
    // accept objects JSON Schema refuses.
    for schema in [
        json!({"allOf":[{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]},
                        {"properties":{"b":{"type":"string"}},"required":["b"]}],
               "additionalProperties":false}),
        json!({"allOf":[{"type":"object","properties":{"a":{"type":"integer"}},"additionalProperties":false},
                        {"properties":{"b":{"type":"string"}}}]}),
    ] {
        let e = Grammar::compile(&schema).unwrap_err();
        assert!(
            e.keyword == "allOf" && e.message.contains("additionalProperties"),
            "{e:?}"
        );
    }
    check(
        json!({"$defs":{"id":{"type":"object","properties":{"id":{"type":"integer"}},"required":["id"]}},
               "allOf":[{"$ref":"#/$defs/id"},{"properties":{"n":{"type":"string"}}}]}),
        &[r#"{"id":1}"#, r#"{"id":1,"n":"x"}"#],
        &["{}"],
    );
}
