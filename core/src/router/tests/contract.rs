//! The calling contract in `Router`'s rustdoc names every public method of `Router`, and
//! ARCHITECTURE.md's summary of it names every input and output: a method added without
//! its place in the contract fails here. The sources are read at test time, so a new
//! file under `src/router` is covered too.

use alloc::string::{String, ToString};
use alloc::vec::Vec;
use std::fs;
use std::path::{Path, PathBuf};

const ROUTER_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/router");
const ARCHITECTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../ARCHITECTURE.md");

/// The router's source files, tests excluded, in path order.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() && p.file_name().is_some_and(|n| n != "tests") {
            sources(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Names of the `pub fn`s written inside `impl Router { … }` blocks of `src`.
fn router_methods(src: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut inside = false;
    for line in src.lines() {
        if line.starts_with("impl Router {") {
            inside = true;
        } else if line == "}" {
            inside = false;
        } else if let (true, Some(rest)) = (inside, line.strip_prefix("    pub fn ")) {
            names.push(rest.split(['(', '<']).next().unwrap().to_string());
        }
    }
    names
}

/// Every public method of `Router`, from the sources.
fn methods() -> Vec<String> {
    let mut files = Vec::new();
    sources(Path::new(ROUTER_DIR), &mut files);
    files.iter().flat_map(|f| router_methods(&fs::read_to_string(f).unwrap())).collect()
}

/// The rustdoc of `pub struct Router`, from `mod.rs`.
fn router_doc() -> String {
    let src = include_str!("../mod.rs");
    let end = src.find("\npub struct Router {").expect("Router is declared in router/mod.rs");
    let doc: Vec<&str> = src[..end].lines().rev().take_while(|l| l.starts_with("///")).collect();
    doc.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// ARCHITECTURE.md's section on the façade's calling contract.
fn architecture_contract() -> String {
    let text = fs::read_to_string(ARCHITECTURE).unwrap();
    let start = text.find("## The façade's calling contract").expect("the section exists");
    let rest = &text[start + 3..];
    rest[..rest.find("\n## ").unwrap_or(rest.len())].to_string()
}

#[track_caller]
fn check(text: &str, what: &str, names: &[String], names_it: fn(&str, &str) -> bool) {
    let missing: Vec<&String> = names.iter().filter(|n| !names_it(text, n)).collect();
    assert!(missing.is_empty(), "{what} does not name {missing:?}");
}

#[test]
fn the_rustdoc_contract_names_every_public_method() {
    let names = methods();
    for expected in ["new", "handle_request", "handle_observation", "poll_output", "poll_replica_update"] {
        assert!(names.iter().any(|n| n == expected), "the source scan missed {expected}: {names:?}");
    }
    check(&router_doc(), "Router's rustdoc", &names, |text, n| text.contains(&alloc::format!("](Self::{n})")));
}

#[test]
fn architecture_names_every_input_and_output() {
    let names: Vec<String> =
        methods().into_iter().filter(|n| n.starts_with("handle_") || n.starts_with("poll_")).collect();
    let names_it =
        |text: &str, n: &str| text.contains(&alloc::format!("`{n}`")) || text.contains(&alloc::format!("`{n}("));
    check(&architecture_contract(), "ARCHITECTURE.md's calling contract", &names, names_it);
}
