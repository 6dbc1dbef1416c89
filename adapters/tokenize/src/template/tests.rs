use super::*;
use serde_json::json;

fn templates(source: &str) -> Templates {
    Templates::compile(vec![("default".into(), source.into())], false, Arc::new(|| 1_721_952_000)).unwrap()
}

#[track_caller]
fn check(source: &str, ctx: serde_json::Value, want: &str) {
    let ctx = Value::from(minijinja::value::Serde(ctx));
    assert_eq!(templates(source).render("default", &ctx).unwrap(), want, "{source}");
}

#[test]
fn renders_like_transformers_jinja() {
    let x = json!({"x": {"b": 1, "a": "é"}, "n": null, "t": true, "l": ["a"]});
    check("{{ x | tojson }}", x.clone(), r#"{"b": 1, "a": "é"}"#);
    check("{{ x | tojson(indent=2) }}", x.clone(), "{\n  \"b\": 1,\n  \"a\": \"é\"\n}");
    check("{{ x | tojson(true) }}", x.clone(), r#"{"b": 1, "a": "\u00e9"}"#);
    check("{{ x | tojson(sort_keys=true, separators=(',', ':')) }}", x.clone(), r#"{"a":"é","b":1}"#);
    check("{{ n }} {{ t }} {{ l }} {{ x }} {{ missing }}|", x.clone(), "None True ['a'] {'b': 1, 'a': 'é'} |");
    check("{{ n | string }}", x.clone(), "None");
    check("{{ strftime_now('%d %b %Y') }}", x.clone(), "26 Jul 2024");
    check("{{ '  a b  '.strip().split(' ') | length }}", x.clone(), "2");
    // trim_blocks and lstrip_blocks on, trailing newline dropped, as in transformers.
    check("a\n  {% if t %}\nb\n  {% endif %}\nc\n", x.clone(), "a\nb\nc");
    check("{% for i in l %}{% break %}{% endfor %}ok", x.clone(), "ok");
    check("{%- generation -%} body {%- endgeneration %}", x, "body");
}

#[test]
fn raise_exception_becomes_a_typed_error() {
    let t = templates("{% if messages | length == 0 %}{{ raise_exception('no messages: ' ~ 1) }}{% endif %}");
    let err = t.render("default", &Value::from(minijinja::value::Serde(json!({"messages": []})))).unwrap_err();
    assert!(matches!(&err, TokenizeError::TemplateRaised { message } if message == "no messages: 1"), "{err:?}");
    assert!(err.is_bad_request());
    let t = templates("{{ messages.content.strip() }}");
    let err = t.render("default", &Value::from(minijinja::value::Serde(json!({"messages": 3})))).unwrap_err();
    assert!(matches!(err, TokenizeError::TemplateRender { .. }), "{err:?}");
}

#[test]
fn bad_templates_fail_at_compile() {
    let err = Templates::compile(vec![("default".into(), "{% if %}".into())], false, Arc::new(|| 0)).unwrap_err();
    assert!(matches!(err, TokenizeError::TemplateSyntax { .. }), "{err:?}");
}

#[test]
fn selects_templates_like_get_chat_template() {
    let named = |names: &[&str]| {
        let sources = names.iter().map(|n| (n.to_string(), n.to_string())).collect();
        Templates::compile(sources, true, Arc::new(|| 0)).unwrap()
    };
    let t = named(&["default", "tool_use"]);
    assert_eq!(t.select(false).unwrap(), "default");
    assert_eq!(t.select(true).unwrap(), "tool_use");
    assert_eq!(named(&["default", "rag"]).select(true).unwrap(), "default");
    let err = named(&["tool_use", "rag"]).select(false).unwrap_err();
    assert!(
        matches!(&err, TokenizeError::NoDefaultTemplate { available } if available == &["rag", "tool_use"]),
        "{err:?}"
    );
    assert!(matches!(named(&[]).select(false), Err(TokenizeError::NoChatTemplate)));
    assert_eq!(templates("x").select(true).unwrap(), "default");
}

#[test]
fn rewrites_only_generation_tags() {
    let cases = [
        ("{% generation %}x{% endgeneration %}", "{% if true %}x{% endif %}"),
        ("{%- generation -%}x{%+ endgeneration +%}", "{%- if true -%}x{%+ endif +%}"),
        ("{% if generation %}{% endif %}{% raw %}", "{% if generation %}{% endif %}{% raw %}"),
        ("unclosed {% generation", "unclosed {% generation"),
    ];
    for (src, want) in cases {
        assert_eq!(rewrite_generation_tags(src), want);
    }
}
