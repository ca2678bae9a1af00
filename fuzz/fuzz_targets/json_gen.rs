//! Structure-aware JSON for the `descriptor` and `config` targets: a schema taken from a real
//! value of the type (so it follows the type's fields as they change), and JSON text written
//! from it with the fuzzer's bytes choosing values, mostly of the right kind and near the
//! limits, sometimes of the wrong kind, with keys left out, repeated or unknown.

use arbitrary::{Result, Unstructured};
use serde_json::Value;

/// What a JSON value at some place is expected to be.
#[derive(Debug, Clone)]
#[allow(dead_code)] // each target that includes this module builds only the kinds it needs
pub enum Schema {
    /// `true` / `false`.
    Bool,
    /// An integer; the default value seen is one candidate.
    Int(i128),
    /// A float; the default value seen is one candidate.
    Float(f64),
    /// A string; the candidates are plausible values (the first is the default seen).
    Str(Vec<String>),
    /// `null` or the inner schema.
    Opt(Box<Schema>),
    /// An array of the inner schema.
    Arr(Box<Schema>),
    /// An object with these keys.
    Obj(Vec<(String, Schema)>),
    /// An object whose keys are strings of the first schema and values of the second.
    Map(Box<Schema>, Box<Schema>),
    /// Anything.
    Any,
}

/// Derives a schema from a sample value; `over` may replace the schema at a dotted path
/// (`rails`, `transports.tcp.receive.return_policy`) before the sample is looked at.
pub fn schema_of(v: &Value, path: &str, over: &dyn Fn(&str) -> Option<Schema>) -> Schema {
    if let Some(s) = over(path) {
        return s;
    }
    let join = |k: &str| {
        if path.is_empty() {
            k.to_owned()
        } else {
            format!("{path}.{k}")
        }
    };
    match v {
        Value::Null => Schema::Opt(Box::new(Schema::Any)),
        Value::Bool(_) => Schema::Bool,
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Schema::Int(i.into()),
            (_, Some(u)) => Schema::Int(u.into()),
            _ => Schema::Float(n.as_f64().unwrap_or(0.0)),
        },
        Value::String(s) => Schema::Str(vec![s.clone()]),
        Value::Array(a) => Schema::Arr(Box::new(match a.first() {
            Some(first) => schema_of(first, &join("[]"), over),
            None => Schema::Any,
        })),
        Value::Object(m) => Schema::Obj(
            m.iter()
                .map(|(k, v)| (k.clone(), schema_of(v, &join(k), over)))
                .collect(),
        ),
    }
}

/// Strings that are valid somewhere and near-misses of them.
pub fn strs(candidates: &[&str]) -> Schema {
    Schema::Str(candidates.iter().map(|s| (*s).to_owned()).collect())
}

/// IP addresses, valid and not.
pub fn ip() -> Schema {
    strs(&[
        "127.0.0.1",
        "10.0.0.1",
        "0.0.0.0",
        "::1",
        "::",
        "fe80::1",
        "fe80::1%eth0",
        "::ffff:1.2.3.4",
        "256.0.0.1",
        "1.2.3",
        "01.2.3.4",
        "",
        "localhost",
    ])
}

/// Memory locations, valid and not.
pub fn location() -> Schema {
    strs(&[
        "*",
        "cpu:0",
        "cpu:1",
        "cpu:4294967295",
        "cpu:4294967296",
        "cpu:-1",
        "cpu:",
        "cpu:+1",
        "cpu: 1",
        "CPU:0",
        "gpu:0",
        "**",
        "",
    ])
}

const INT_EDGES: &[i128] = &[
    0,
    1,
    2,
    3,
    -1,
    -2,
    7,
    8,
    15,
    16,
    19,
    20,
    31,
    32,
    33,
    63,
    64,
    65,
    255,
    256,
    1023,
    1024,
    4095,
    4096,
    8192,
    10_000,
    10_001,
    65_535,
    65_536,
    1 << 20,
    (1 << 20) + 1,
    1 << 30,
    (1 << 30) + 1,
    64 << 20,
    (64 << 20) + 1,
    i32::MAX as i128,
    i32::MAX as i128 + 1,
    i32::MIN as i128,
    i32::MIN as i128 - 1,
    u32::MAX as i128,
    u32::MAX as i128 + 1,
    1 << 53,
    (1 << 53) + 1,
    i64::MAX as i128,
    i64::MAX as i128 + 1,
    i64::MIN as i128,
    i64::MIN as i128 - 1,
    u64::MAX as i128,
    u64::MAX as i128 + 1,
];

const FLOAT_EDGES: &[&str] = &[
    "0",
    "0.0",
    "-0.0",
    "-0",
    "1",
    "1.0",
    "0.5",
    "-1",
    "-0.5",
    "2",
    "1e-12",
    "1e-9",
    "5e-324",
    "2.2250738585072014e-308",
    "1e308",
    "1.7976931348623157e308",
    "1e309",
    "-1e309",
    "1e400",
    "0.1",
    "0.01",
    "0.99999999999999999",
    "1.00000000000000001",
    "10",
    "400",
    "800",
    "801",
    "123456789012345678901234567890",
    "1E2",
    "1e+2",
    "1.5e-5",
];

/// A small JSON value of any kind.
fn any(u: &mut Unstructured, depth: u32, out: &mut String) -> Result<()> {
    let pick = if depth >= 3 {
        u.int_in_range(0..=4)?
    } else {
        u.int_in_range(0..=6)?
    };
    match pick {
        0 => out.push_str("null"),
        1 => out.push_str(if u.arbitrary()? { "true" } else { "false" }),
        2 => int(u, 0, out)?,
        3 => float(u, 0.0, out)?,
        4 => string(u, &[], out)?,
        5 => {
            out.push('[');
            for i in 0..u.int_in_range(0..=3)? {
                if i > 0 {
                    out.push(',');
                }
                any(u, depth + 1, out)?;
            }
            out.push(']');
        }
        _ => {
            out.push('{');
            for i in 0..u.int_in_range(0..=3)? {
                if i > 0 {
                    out.push(',');
                }
                string(u, &[], out)?;
                out.push(':');
                any(u, depth + 1, out)?;
            }
            out.push('}');
        }
    }
    Ok(())
}

fn int(u: &mut Unstructured, default: i128, out: &mut String) -> Result<()> {
    let s = match u.int_in_range(0..=6)? {
        0 => default.to_string(),
        1 => u.choose(INT_EDGES)?.to_string(),
        2 => u.arbitrary::<u8>()?.to_string(),
        3 => u.arbitrary::<u64>()?.to_string(),
        4 => u.arbitrary::<i64>()?.to_string(),
        5 => (default + i128::from(u.int_in_range(-2i8..=2)?)).to_string(),
        // Integers written as floats, and numbers too long for any integer type.
        _ => {
            (*u.choose(&["1.0", "1e3", "-0", "0.5", "18446744073709551616000", "1E1"])?).to_owned()
        }
    };
    out.push_str(&s);
    Ok(())
}

fn float(u: &mut Unstructured, default: f64, out: &mut String) -> Result<()> {
    match u.int_in_range(0..=3)? {
        0 => out.push_str(&format!("{default:?}")),
        1 => out.push_str(u.choose(FLOAT_EDGES)?),
        2 => {
            let f: f64 = u.arbitrary()?;
            if f.is_finite() {
                out.push_str(&format!("{f:?}"));
            } else {
                out.push_str("1e999");
            }
        }
        _ => int(u, default as i128, out)?,
    }
    Ok(())
}

fn string(u: &mut Unstructured, candidates: &[String], out: &mut String) -> Result<()> {
    let s: String = if !candidates.is_empty() && u.ratio(3, 4)? {
        u.choose(candidates)?.clone()
    } else {
        u.arbitrary()?
    };
    out.push_str(&serde_json::to_string(&s).expect("a string serializes"));
    Ok(())
}

/// Writes JSON text shaped by `schema` into `out`.
pub fn emit(u: &mut Unstructured, schema: &Schema, depth: u32, out: &mut String) -> Result<()> {
    // Now and then a value of any kind where the schema wants another.
    if u.ratio(1, 24)? {
        return any(u, depth, out);
    }
    match schema {
        Schema::Bool => out.push_str(if u.arbitrary()? { "true" } else { "false" }),
        Schema::Int(d) => int(u, *d, out)?,
        Schema::Float(d) => float(u, *d, out)?,
        Schema::Str(c) => string(u, c, out)?,
        Schema::Opt(inner) => {
            if u.arbitrary()? {
                out.push_str("null");
            } else {
                emit(u, inner, depth + 1, out)?;
            }
        }
        Schema::Any => any(u, depth, out)?,
        Schema::Arr(inner) => {
            out.push('[');
            let n = if depth > 6 { 0 } else { u.int_in_range(0..=4)? };
            for i in 0..n {
                if i > 0 {
                    out.push(',');
                }
                emit(u, inner, depth + 1, out)?;
            }
            out.push(']');
        }
        Schema::Map(key, value) => {
            out.push('{');
            let n = if depth > 6 { 0 } else { u.int_in_range(0..=3)? };
            for i in 0..n {
                if i > 0 {
                    out.push(',');
                }
                match &**key {
                    Schema::Str(c) => string(u, c, out)?,
                    _ => string(u, &[], out)?,
                }
                out.push(':');
                emit(u, value, depth + 1, out)?;
            }
            out.push('}');
        }
        Schema::Obj(fields) => {
            out.push('{');
            let mut first = true;
            let mut key = |out: &mut String, k: &str| {
                if !first {
                    out.push(',');
                }
                first = false;
                out.push_str(&serde_json::to_string(k).expect("a string serializes"));
                out.push(':');
            };
            for (k, s) in fields {
                // Most keys once, some left out, a few twice.
                let times = match u.int_in_range(0u8..=15)? {
                    0..=1 => 0,
                    2 => 2,
                    _ => 1,
                };
                for _ in 0..times {
                    key(out, k);
                    emit(u, s, depth + 1, out)?;
                }
            }
            if u.ratio(1, 16)? {
                // A key this object does not have (or a known one in the wrong place).
                let k: String = if u.arbitrary()? {
                    u.arbitrary()?
                } else {
                    u.choose(fields)
                        .map(|(k, _)| format!("{k}_"))
                        .unwrap_or_default()
                };
                key(out, &k);
                any(u, depth + 1, out)?;
            }
            out.push('}');
        }
    }
    Ok(())
}

/// JSON text shaped by `schema` from the fuzzer's bytes, with a little whitespace or trailing
/// garbage now and then.
pub fn document(u: &mut Unstructured, schema: &Schema) -> Result<String> {
    let mut out = String::new();
    emit(u, schema, 0, &mut out)?;
    match u.int_in_range(0u8..=31)? {
        0 => out.push_str(" }"),
        1 => out.insert(0, '\u{feff}'),
        2 => out.push_str("\n\t "),
        3 => {
            out.pop();
        }
        _ => {}
    }
    Ok(out)
}
