//! Guesses a chat template's content format the way vLLM's `_detect_content_format` does:
//! "openai" (content as a list of parts) if the template has a `{% for x in m.content %}`
//! loop where `m` is bound by a loop over `messages` (or over a variable set from it),
//! "string" otherwise. vLLM walks Jinja2's syntax tree; this reads the `{% ... %}` tags as
//! text, which sees the same `for` and `set` statements for the templates models ship. It
//! leaves acting on the answer to `request.rs`.

/// True when the template iterates over a message's `content`.
pub(crate) fn loops_over_content(template: &str) -> bool {
    let stmts = statements(template);
    // Variables holding the message list: `messages` and anything `set` from it.
    let mut lists = vec!["messages".to_owned()];
    loop {
        let before = lists.len();
        for s in &stmts {
            if let Some((target, expr)) = parse_set(s) {
                if base_access(expr, &lists, None) && !lists.contains(&target) {
                    lists.push(target);
                }
            }
        }
        if lists.len() == before {
            break;
        }
    }
    let messages: Vec<String> = stmts
        .iter()
        .filter_map(|s| parse_for(s))
        .filter(|(_, iter)| base_access(iter, &lists, None))
        .map(|(target, _)| target)
        .collect();
    stmts.iter().filter_map(|s| parse_for(s)).any(|(_, iter)| base_access(iter, &messages, Some("content")))
}

/// The inside of every `{% ... %}` tag, whitespace-control markers removed.
fn statements(template: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(start) = rest.find("{%") {
        let tag = &rest[start + 2..];
        let Some(end) = tag.find("%}") else { break };
        let inner = tag[..end].trim_matches(|c: char| c == '-' || c == '+').trim();
        out.push(inner);
        rest = &tag[end + 2..];
    }
    out
}

/// `set name = expr` (not `set ns.attr = ...`, not block sets).
fn parse_set(stmt: &str) -> Option<(String, &str)> {
    let rest = stmt.strip_prefix("set ")?.trim_start();
    let (name, expr) = rest.split_once('=')?;
    let name = name.trim();
    is_ident(name).then(|| (name.to_owned(), expr.trim()))
}

/// `for name in expr` with a single loop variable; vLLM gives up on tuple targets.
fn parse_for(stmt: &str) -> Option<(String, &str)> {
    let rest = stmt.strip_prefix("for ")?.trim_start();
    let (name, iter) = rest.split_once(" in ")?;
    let name = name.trim();
    is_ident(name).then(|| (name.to_owned(), iter.trim()))
}

fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Whether `expr` is one of `vars` (then `.key` / `['key']` when `key` is given), optionally
/// sliced before the key and followed by filters, a test, or a loop condition.
fn base_access(expr: &str, vars: &[String], key: Option<&str>) -> bool {
    let end = expr.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(expr.len());
    if !vars.iter().any(|v| v == &expr[..end]) {
        return false;
    }
    let mut rest = expr[end..].trim_start();
    // Slices (`messages[1:]`, `messages[::-1]`) keep the variable's identity.
    while let Some(inner) = rest.strip_prefix('[').and_then(|r| r.split_once(']')) {
        if !inner.0.contains(':') {
            break;
        }
        rest = inner.1.trim_start();
    }
    if let Some(key) = key {
        let quoted = [format!("['{key}']"), format!("[\"{key}\"]"), format!(".{key}")];
        match quoted.iter().find(|q| rest.starts_with(q.as_str())) {
            Some(q) => rest = &rest[q.len()..],
            None => return false,
        }
        if rest.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            return false;
        }
    }
    let rest = rest.trim_start();
    rest.is_empty() || rest.starts_with('|') || rest.starts_with("is ") || rest.starts_with("if ")
}

#[cfg(test)]
mod tests {
    use super::loops_over_content;

    #[track_caller]
    fn check(template: &str, want: bool) {
        assert_eq!(loops_over_content(template), want, "{template}");
    }

    #[test]
    fn detects_content_loops_like_vllm() {
        check("{% for m in messages %}{{ m.content }}{% endfor %}", false);
        check("{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}", true);
        check(
            "{%- for m in messages -%}{%- for c in m['content'] | selectattr('type') -%}x{%- endfor -%}{%- endfor -%}",
            true,
        );
        check(
            "{% set msgs = messages[1:] %}{% for m in msgs %}{% for c in m[\"content\"] %}{% endfor %}{% endfor %}",
            true,
        );
        check(
            "{% for m in messages[::-1] %}{% for c in m.content if c.type == 'text' %}{% endfor %}{% endfor %}",
            true,
        );
        check("{% for m in messages %}{% for c in m.contents %}{% endfor %}{% endfor %}", false);
        check("{% for c in message.content %}{% endfor %}", false);
        check("{% for i, m in messages %}{% for c in m.content %}{% endfor %}{% endfor %}", false);
        check("{% for m in messages %}{% for c in m.content.split('x') %}{% endfor %}{% endfor %}", false);
    }
}
