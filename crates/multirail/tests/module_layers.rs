//! The engine crate's modules form layers with no import cycle (docs/architecture.md, "The
//! engine's layers"). This test reads every `.rs` file under `crates/multirail/src`, finds for
//! each top-level module the other top-level modules its non-test code refers to (`use
//! crate::x`, `crate::x::...` paths anywhere, `super::` paths that climb to the crate root, and
//! names the crate root re-exports), prints the edge list, and fails naming every strongly
//! connected group of more than one module. It checks the sibling files of `transport/rdma/`
//! the same way.
//!
//! The scanner is a small Rust lexer, not a regex: comments (line, nested block, doc), string
//! literals (plain, byte, C, raw with any number of `#`), char literals and lifetimes are
//! dropped before paths are read, and items under `#[cfg(test)]` (inline test modules and the
//! files of out-of-line ones) are skipped. The synthetic checks at the bottom show that it does
//! find a cycle, so the check on the real crate cannot pass vacuously.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

// ---------------------------------------------------------------------------------------------
// Lexer
// ---------------------------------------------------------------------------------------------

/// One token of Rust source: only what path extraction needs.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    /// An identifier or keyword (`crate`, `$crate`, `super`, names, numbers).
    Ident(String),
    /// `::`.
    PathSep,
    /// Any other single punctuation character.
    Punct(char),
}

/// A token and the line it starts on.
#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    line: usize,
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// If a string literal (plain, byte, C, raw, raw byte, raw C) starts at `i`, the index just
/// past its end.
fn string_end(c: &[char], i: usize) -> Option<usize> {
    let at = |k: usize| c.get(k).copied();
    let mut j = i;
    // Optional prefix: b, c, r, br, cr.
    if matches!(at(j), Some('b') | Some('c')) && matches!(at(j + 1), Some('"') | Some('r')) {
        j += 1;
    }
    if at(j) == Some('r') {
        // Raw: r#*"...."#*
        let mut k = j + 1;
        let mut hashes = 0;
        while at(k) == Some('#') {
            hashes += 1;
            k += 1;
        }
        if at(k) != Some('"') {
            return None; // r#ident or a plain identifier starting with r
        }
        k += 1;
        loop {
            let ch = at(k)?;
            k += 1;
            if ch == '"' && (0..hashes).all(|h| at(k + h) == Some('#')) {
                return Some(k + hashes);
            }
        }
    }
    if at(j) != Some('"') {
        return None;
    }
    let mut k = j + 1;
    loop {
        match at(k)? {
            '\\' => k += 2,
            '"' => return Some(k + 1),
            _ => k += 1,
        }
    }
}

/// If a char literal starts at `i` (the `'`), the index just past it; `None` for a lifetime
/// or label.
fn char_end(c: &[char], i: usize) -> Option<usize> {
    let at = |k: usize| c.get(k).copied();
    if at(i + 1) == Some('\\') {
        let mut k = i + 3; // past the escaped character
        while let Some(ch) = at(k) {
            k += 1;
            if ch == '\'' {
                return Some(k);
            }
        }
        return Some(k);
    }
    if at(i + 1).is_some() && at(i + 2) == Some('\'') {
        return Some(i + 3);
    }
    None
}

/// Splits Rust source into tokens, dropping whitespace, comments and literals.
fn lex(src: &str) -> Vec<Token> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let lines_in = |from: usize, to: usize| {
        c[from..to.min(c.len())]
            .iter()
            .filter(|&&ch| ch == '\n')
            .count()
    };
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let start = i;
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            line += lines_in(start, i);
        } else if let Some(end) = string_end(&c, i) {
            line += lines_in(i, end);
            i = end.min(c.len());
        } else if ch == 'b' && next == Some('\'') {
            i = char_end(&c, i + 1).unwrap_or(i + 2);
        } else if ch == '\'' {
            match char_end(&c, i) {
                Some(end) => {
                    line += lines_in(i, end);
                    i = end;
                }
                None => {
                    // A lifetime or a label: skip it whole.
                    i += 1;
                    while i < c.len() && is_ident_char(c[i]) {
                        i += 1;
                    }
                }
            }
        } else if ch == 'r' && next == Some('#') && c.get(i + 2).is_some_and(|&d| is_ident_start(d))
        {
            // A raw identifier: r#name is the identifier `name`.
            let start = i + 2;
            i = start;
            while i < c.len() && is_ident_char(c[i]) {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Ident(c[start..i].iter().collect()),
                line,
            });
        } else if is_ident_start(ch)
            || ch.is_ascii_digit()
            || (ch == '$' && next.is_some_and(is_ident_start))
        {
            let start = i;
            i += 1;
            while i < c.len() && is_ident_char(c[i]) {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Ident(c[start..i].iter().collect()),
                line,
            });
        } else if ch == ':' && next == Some(':') {
            out.push(Token {
                tok: Tok::PathSep,
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                tok: Tok::Punct(ch),
                line,
            });
            i += 1;
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Paths
// ---------------------------------------------------------------------------------------------

/// One path a file refers to, resolved to an absolute module path where it can be.
#[derive(Debug, Clone)]
struct Ref {
    /// Absolute path from the crate root (without `crate`).
    abs: Vec<String>,
    /// For a `use` item: the name it binds (`None` for a glob).
    bound: Option<String>,
    /// Whether it came from a `use` item.
    from_use: bool,
    /// Line of the reference.
    line: usize,
}

/// What a file contributes.
#[derive(Debug, Default)]
struct FileScan {
    refs: Vec<Ref>,
    /// Out-of-line modules declared under `#[cfg(test)]` (absolute module paths).
    test_mods: Vec<Vec<String>>,
}

fn ident(t: Option<&Token>) -> Option<&str> {
    match t {
        Some(Token {
            tok: Tok::Ident(s), ..
        }) => Some(s.as_str()),
        _ => None,
    }
}

fn is_punct(t: Option<&Token>, p: char) -> bool {
    matches!(t, Some(Token { tok: Tok::Punct(c), .. }) if *c == p)
}

fn is_sep(t: Option<&Token>) -> bool {
    matches!(
        t,
        Some(Token {
            tok: Tok::PathSep,
            ..
        })
    )
}

/// Resolves `segs` (as written) against the module path `module`. Paths that start with
/// `crate`, `$crate`, `super` or `self` are anchored; others are taken as relative to the
/// current module (true for `use` of child modules; an extern crate's path then simply names
/// no module of this crate).
fn resolve(module: &[String], segs: &[String]) -> Option<Vec<String>> {
    let first = segs.first()?;
    match first.as_str() {
        "crate" | "$crate" => Some(segs[1..].to_vec()),
        "super" => {
            let k = segs.iter().take_while(|s| *s == "super").count();
            if k > module.len() {
                return None;
            }
            let mut abs = module[..module.len() - k].to_vec();
            abs.extend_from_slice(&segs[k..]);
            Some(abs)
        }
        "self" => {
            let mut abs = module.to_vec();
            abs.extend_from_slice(&segs[1..]);
            Some(abs)
        }
        _ => {
            let mut abs = module.to_vec();
            abs.extend_from_slice(segs);
            Some(abs)
        }
    }
}

/// A parsed `use` leaf: its path, the name it binds (`None` for a glob).
type UseLeaf = (Vec<String>, Option<String>);

/// Parses a use tree at `*i` with `prefix` already read; pushes its leaves.
fn parse_use_tree(t: &[Token], i: &mut usize, mut prefix: Vec<String>, out: &mut Vec<UseLeaf>) {
    if is_sep(t.get(*i)) {
        *i += 1; // a leading `::`
    }
    loop {
        match t.get(*i).map(|t| &t.tok) {
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    if is_punct(t.get(*i), '}') || *i >= t.len() {
                        break;
                    }
                    parse_use_tree(t, i, prefix.clone(), out);
                    if is_punct(t.get(*i), ',') {
                        *i += 1;
                    } else if !is_punct(t.get(*i), '}') {
                        break; // malformed: stop here
                    }
                }
                if is_punct(t.get(*i), '}') {
                    *i += 1;
                }
                return;
            }
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push((prefix, None));
                return;
            }
            Some(Tok::Ident(s)) => {
                let s = s.clone();
                *i += 1;
                if is_sep(t.get(*i)) {
                    prefix.push(s);
                    *i += 1;
                    continue;
                }
                let path = if s == "self" {
                    prefix.clone()
                } else {
                    prefix.push(s);
                    prefix.clone()
                };
                let mut name = path.last().cloned().unwrap_or_default();
                if ident(t.get(*i)) == Some("as") {
                    if let Some(alias) = ident(t.get(*i + 1)) {
                        name = alias.to_string();
                    }
                    *i += 2;
                }
                out.push((path, Some(name)));
                return;
            }
            _ => return,
        }
    }
}

/// Skips a balanced group opened at `t[i]` (`{`, `(` or `[`); returns the index past its close.
fn skip_group(t: &[Token], mut i: usize) -> usize {
    let mut depth = 0i32;
    while i < t.len() {
        match t[i].tok {
            Tok::Punct('{') | Tok::Punct('(') | Tok::Punct('[') => depth += 1,
            Tok::Punct('}') | Tok::Punct(')') | Tok::Punct(']') => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i
}

/// Whether `t[i..]` is the attribute `#[cfg(test)]` (or `#![cfg(test)]` when `inner`).
fn is_cfg_test(t: &[Token], i: usize, inner: bool) -> bool {
    let mut k = i;
    if !is_punct(t.get(k), '#') {
        return false;
    }
    k += 1;
    if inner {
        if !is_punct(t.get(k), '!') {
            return false;
        }
        k += 1;
    }
    is_punct(t.get(k), '[')
        && ident(t.get(k + 1)) == Some("cfg")
        && is_punct(t.get(k + 2), '(')
        && ident(t.get(k + 3)) == Some("test")
        && is_punct(t.get(k + 4), ')')
        && is_punct(t.get(k + 5), ']')
}

/// Skips the item after a `#[cfg(test)]` attribute (further attributes, then up to a `;` or
/// a closing brace at depth 0, or an unmatched closer). Returns the index past it and, when
/// the item is `mod name;`, the name.
fn skip_item(t: &[Token], mut i: usize) -> (usize, Option<String>) {
    while is_punct(t.get(i), '#') && is_punct(t.get(i + 1), '[') {
        i = skip_group(t, i + 1);
    }
    let start = i;
    let mut depth = 0i32;
    while i < t.len() {
        match t[i].tok {
            Tok::Punct('(') | Tok::Punct('[') => depth += 1,
            Tok::Punct(')') | Tok::Punct(']') | Tok::Punct('}') if depth == 0 => return (i, None),
            Tok::Punct(')') | Tok::Punct(']') => depth -= 1,
            Tok::Punct('{') if depth == 0 => return (skip_group(t, i), None),
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth -= 1,
            Tok::Punct(';') if depth == 0 => {
                // `[pub[(..)]] mod name;`
                let words: Vec<&str> = t[start..i].iter().filter_map(|x| ident(Some(x))).collect();
                let name = match words.as_slice() {
                    [.., "mod", name] => Some(name.to_string()),
                    _ => None,
                };
                return (i + 1, name);
            }
            _ => {}
        }
        i += 1;
    }
    (i, None)
}

/// Scans one file whose module path is `file_module`.
fn scan(src: &str, file_module: &[String]) -> FileScan {
    let t = lex(src);
    let mut out = FileScan::default();
    if t.iter().enumerate().any(|(i, _)| is_cfg_test(&t, i, true)) {
        return out; // the whole file is test code
    }
    // Brace frames: Some(name) for an inline `mod name { .. }`.
    let mut frames: Vec<Option<String>> = Vec::new();
    let module = |frames: &[Option<String>]| -> Vec<String> {
        let mut m = file_module.to_vec();
        m.extend(frames.iter().flatten().cloned());
        m
    };
    let mut i = 0;
    while i < t.len() {
        if is_cfg_test(&t, i, false) {
            let (next, name) = skip_item(&t, i + 7);
            if let Some(name) = name {
                let mut m = module(&frames);
                m.push(name);
                out.test_mods.push(m);
            }
            i = next;
            continue;
        }
        match &t[i].tok {
            Tok::Punct('{') => {
                let name = match i.checked_sub(2) {
                    Some(k) if ident(t.get(k)) == Some("mod") => {
                        ident(t.get(k + 1)).map(str::to_string)
                    }
                    _ => None,
                };
                frames.push(name);
                i += 1;
            }
            Tok::Punct('}') => {
                frames.pop();
                i += 1;
            }
            Tok::Ident(kw) if kw == "use" && !is_punct(t.get(i + 1), '<') => {
                let line = t[i].line;
                let mut k = i + 1;
                let mut leaves = Vec::new();
                parse_use_tree(&t, &mut k, Vec::new(), &mut leaves);
                let m = module(&frames);
                for (path, bound) in leaves {
                    if let Some(abs) = resolve(&m, &path) {
                        out.refs.push(Ref {
                            abs,
                            bound,
                            from_use: true,
                            line,
                        });
                    }
                }
                if is_punct(t.get(k), ';') {
                    k += 1;
                }
                i = k.max(i + 1);
            }
            Tok::Ident(kw)
                if matches!(kw.as_str(), "crate" | "$crate" | "super" | "self")
                    && is_sep(t.get(i + 1))
                    && !is_sep(i.checked_sub(1).and_then(|k| t.get(k))) =>
            {
                let line = t[i].line;
                let mut segs = vec![kw.clone()];
                let mut k = i + 1;
                while is_sep(t.get(k)) {
                    match ident(t.get(k + 1)) {
                        Some(s) => {
                            segs.push(s.to_string());
                            k += 2;
                        }
                        None => break,
                    }
                }
                if let Some(abs) = resolve(&module(&frames), &segs) {
                    out.refs.push(Ref {
                        abs,
                        bound: None,
                        from_use: false,
                        line,
                    });
                }
                i = k;
            }
            _ => i += 1,
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Graph
// ---------------------------------------------------------------------------------------------

/// The module path of a file, from its path relative to `src/` (`lib.rs` is the root).
fn module_path(rel: &str) -> Vec<String> {
    let rel = rel.trim_end_matches(".rs");
    let mut parts: Vec<String> = rel.split('/').map(str::to_string).collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// Edges between the children of one module, with where each was seen.
#[derive(Debug, Default)]
struct Graph {
    nodes: BTreeSet<String>,
    /// (from, to) -> "file:line" of every reference.
    edges: BTreeMap<(String, String), Vec<String>>,
}

/// Builds the graph among the child modules of the module `parent` (`[]` for the crate's
/// top-level modules) from `files` (path relative to `src/`, source).
fn graph(files: &[(String, String)], parent: &[&str]) -> Graph {
    let parent: Vec<String> = parent.iter().map(|s| s.to_string()).collect();
    let mut files: Vec<(Vec<String>, &str, &str)> = files
        .iter()
        .map(|(rel, src)| (module_path(rel), rel.as_str(), src.as_str()))
        .collect();
    // Parents before children, so out-of-line test modules are known before their files.
    files.sort_by(|a, b| a.0.len().cmp(&b.0.len()).then(a.1.cmp(b.1)));

    let mut excluded: Vec<Vec<String>> = Vec::new();
    let mut scans: Vec<(Vec<String>, &str, FileScan)> = Vec::new();
    for (m, rel, src) in files {
        if excluded.iter().any(|e| m.starts_with(e)) {
            continue;
        }
        let s = scan(src, &m);
        excluded.extend(s.test_mods.iter().cloned());
        scans.push((m, rel, s));
    }

    let depth = parent.len();
    let mut g = Graph::default();
    for (m, _, _) in &scans {
        if m.len() > depth && m.starts_with(&parent) {
            g.nodes.insert(m[depth].clone());
        }
    }
    // Names the parent module imports (and so re-exports to its children): name -> child.
    let mut reexports: BTreeMap<String, String> = BTreeMap::new();
    for (m, _, s) in &scans {
        if *m != parent {
            continue;
        }
        for r in s.refs.iter().filter(|r| r.from_use) {
            if let (Some(name), true) = (
                &r.bound,
                r.abs.len() > depth + 1 && r.abs.starts_with(&parent),
            ) {
                if g.nodes.contains(&r.abs[depth]) {
                    reexports.insert(name.clone(), r.abs[depth].clone());
                }
            }
        }
    }
    for (m, rel, s) in &scans {
        if m.len() <= depth || !m.starts_with(&parent) {
            continue;
        }
        let from = &m[depth];
        for r in &s.refs {
            if r.abs.len() <= depth || !r.abs.starts_with(&parent) {
                continue;
            }
            let first = &r.abs[depth];
            let to = if g.nodes.contains(first) {
                first.clone()
            } else if let Some(child) = reexports.get(first) {
                child.clone()
            } else {
                continue; // an item of the parent itself
            };
            if &to != from {
                g.edges
                    .entry((from.clone(), to))
                    .or_default()
                    .push(format!("{rel}:{}", r.line));
            }
        }
    }
    g
}

/// Strongly connected components of more than one node, each with one cycle through it.
fn cycles(g: &Graph) -> Vec<(Vec<String>, Vec<String>)> {
    let adj = |n: &str| -> Vec<String> {
        g.edges
            .keys()
            .filter(|(f, _)| f == n)
            .map(|(_, t)| t.clone())
            .collect()
    };
    let reach = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(n) = todo.pop() {
            for t in adj(&n) {
                if seen.insert(t.clone()) {
                    todo.push(t);
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<String, BTreeSet<String>> =
        g.nodes.iter().map(|n| (n.clone(), reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for n in &g.nodes {
        if done.contains(n) {
            continue;
        }
        let scc: Vec<String> = g
            .nodes
            .iter()
            .filter(|m| *m == n || (reaches[n].contains(*m) && reaches[*m].contains(n)))
            .cloned()
            .collect();
        done.extend(scc.iter().cloned());
        if scc.len() < 2 {
            continue;
        }
        // One shortest cycle through `n`, inside the component.
        let inside: BTreeSet<&String> = scc.iter().collect();
        let mut prev: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = VecDeque::from([n.clone()]);
        let mut cycle = vec![n.clone()];
        'bfs: while let Some(x) = queue.pop_front() {
            for y in adj(&x) {
                if !inside.contains(&y) {
                    continue;
                }
                if &y == n {
                    let mut path = vec![x.clone()];
                    let mut cur = x.clone();
                    while let Some(p) = prev.get(&cur) {
                        path.push(p.clone());
                        cur = p.clone();
                    }
                    path.reverse();
                    if path.first() != Some(n) {
                        path.insert(0, n.clone());
                    }
                    path.push(n.clone());
                    cycle = path;
                    break 'bfs;
                }
                if y != *n && !prev.contains_key(&y) {
                    prev.insert(y.clone(), x.clone());
                    queue.push_back(y);
                }
            }
        }
        out.push((scc, cycle));
    }
    out
}

/// Prints the edge list of `g` and returns a description of each cycle.
fn report(title: &str, g: &Graph) -> Vec<String> {
    println!(
        "{title}: {} modules, {} edges",
        g.nodes.len(),
        g.edges.len()
    );
    for ((from, to), at) in &g.edges {
        println!("  {from} -> {to}  ({} refs, first at {})", at.len(), at[0]);
        if std::env::var_os("MODULE_LAYERS_ALL_REFS").is_some() {
            for a in at {
                println!("      {a}");
            }
        }
    }
    let found: Vec<String> = cycles(g)
        .into_iter()
        .map(|(scc, cycle)| {
            let legs: Vec<String> = cycle
                .windows(2)
                .map(|w| {
                    let at = &g.edges[&(w[0].clone(), w[1].clone())][0];
                    format!("{} -> {} ({at})", w[0], w[1])
                })
                .collect();
            format!(
                "{title}: cycle among {{{}}}: {}",
                scc.join(", "),
                legs.join(", ")
            )
        })
        .collect();
    for c in &found {
        println!("  {c}");
    }
    found
}

/// Every `.rs` file under `dir`, as (path relative to `dir` with `/`, contents).
fn read_sources(dir: &Path) -> Vec<(String, String)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(root, &p, out);
            } else if p.extension().is_some_and(|e| e == "rs") {
                let rel = p.strip_prefix(root).unwrap();
                let rel: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                let src = std::fs::read_to_string(&p).unwrap();
                out.push((rel.join("/"), src));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out
}

/// The module groups the check covers: the crate's top-level modules, and the sibling files
/// of `transport/rdma`.
const GROUPS: &[(&str, &[&str])] = &[
    ("top-level modules", &[]),
    ("transport/rdma files", &["transport", "rdma"]),
];

#[test]
fn engine_modules_have_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = read_sources(&src);
    assert!(files.len() > 20, "read only {} files", files.len());
    let mut found = Vec::new();
    for (title, parent) in GROUPS {
        let g = graph(&files, parent);
        assert!(g.nodes.len() > 3, "{title}: too few modules found");
        assert!(!g.edges.is_empty(), "{title}: no edges found");
        found.extend(report(title, &g));
    }
    assert!(
        found.is_empty(),
        "the engine's modules must form layers with no import cycle \
         (docs/architecture.md); found:\n{}",
        found.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// The scanner on synthetic input
// ---------------------------------------------------------------------------------------------

fn files(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(p, s)| (p.to_string(), s.to_string()))
        .collect()
}

fn edge_set(g: &Graph) -> BTreeSet<(String, String)> {
    g.edges.keys().cloned().collect()
}

fn e(a: &str, b: &str) -> (String, String) {
    (a.to_string(), b.to_string())
}

#[test]
fn synthetic_cycle_is_found() {
    let f = files(&[
        ("lib.rs", "pub mod a; pub mod b; pub mod c;"),
        ("a.rs", "use crate::b::Thing;\npub struct A;"),
        ("b/mod.rs", "mod inner;\npub struct Thing;"),
        ("b/inner.rs", "fn f() -> crate::c::C { todo!() }"),
        ("c.rs", "pub struct C(super::a::A);"),
    ]);
    let g = graph(&f, &[]);
    assert_eq!(
        edge_set(&g),
        BTreeSet::from([e("a", "b"), e("b", "c"), e("c", "a")])
    );
    let found = cycles(&g);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].0, vec!["a", "b", "c"]);
    assert_eq!(found[0].1.len(), 4, "{:?}", found[0].1);
    assert_eq!(found[0].1.first(), found[0].1.last());
    assert_eq!(report("synthetic", &g).len(), 1);
}

#[test]
fn comments_strings_and_tests_are_not_references() {
    let f = files(&[
        ("lib.rs", "pub mod a; pub mod b;"),
        ("a.rs", "pub struct A;"),
        (
            "b.rs",
            r####"
//! Module docs naming crate::a::A.
/// Doc on an item: crate::a::A.
/* a block /* nested crate::a::A */ still a comment: crate::a::A */
const S: &str = "crate::a::A \" crate::a::A";
const R: &str = r##"crate::a::A "# crate::a::A"##;
const B: &[u8] = b"crate::a::A";
const Q: char = '"';
const E: char = '\'';
fn f<'a>(x: &'a str) -> &'a str { 'outer: loop { break 'outer; } x }
#[cfg(test)]
mod tests {
    use crate::a::A;
    fn g() { let _ = crate::a::A; }
}
#[cfg(test)]
mod more_tests;
#[cfg(test)]
fn helper() -> crate::a::A { crate::a::A }
pub struct B;
"####,
        ),
        ("b/more_tests.rs", "use crate::a::A;"),
    ]);
    let g = graph(&f, &[]);
    assert!(g.edges.is_empty(), "{:?}", g.edges);
}

#[test]
fn grouped_uses_super_and_root_reexports_are_references() {
    let f = files(&[
        (
            "lib.rs",
            "pub mod a; pub mod b; pub mod c; pub mod d;\npub use d::{Dee as Renamed};",
        ),
        (
            "a.rs",
            "use crate::{b::{self, Bee}, c};\nfn f() -> super::Renamed { todo!() }",
        ),
        ("b.rs", "pub struct Bee;"),
        (
            "c.rs",
            "pub struct Cee;\nmod inner { use super::super::b::Bee; }",
        ),
        ("d.rs", "pub struct Dee;"),
    ]);
    let g = graph(&f, &[]);
    assert_eq!(
        edge_set(&g),
        BTreeSet::from([e("a", "b"), e("a", "c"), e("a", "d"), e("c", "b")])
    );
    assert!(cycles(&g).is_empty());
}

#[test]
fn sibling_files_of_a_submodule_are_checked() {
    let f = files(&[
        ("lib.rs", "pub mod t;"),
        ("t/mod.rs", "pub mod r;"),
        (
            "t/r/mod.rs",
            "mod x; mod y; mod z;\npub(crate) use z::Zed;\npub struct Own;",
        ),
        ("t/r/x.rs", "use super::y::Why; use super::Own;"),
        ("t/r/y.rs", "use crate::t::r::Zed;"),
        ("t/r/z.rs", "pub struct Zed; fn f() { super::x::g(); }"),
    ]);
    let g = graph(&f, &["t", "r"]);
    assert_eq!(
        g.nodes,
        BTreeSet::from(["x".into(), "y".into(), "z".into()])
    );
    assert_eq!(
        edge_set(&g),
        BTreeSet::from([e("x", "y"), e("y", "z"), e("z", "x")])
    );
    assert_eq!(cycles(&g).len(), 1);
}
