//! The checked-in include/multirail.h is what cbindgen generates from crates/capi/src now.

use std::path::PathBuf;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The header as cbindgen generates it from this crate with crates/capi/cbindgen.toml.
fn generate() -> String {
    let dir = crate_dir();
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml"))
        .expect("crates/capi/cbindgen.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header");
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("the header is UTF-8")
}

fn header_path() -> PathBuf {
    crate_dir().join("../../include/multirail.h")
}

#[test]
fn header_is_up_to_date() {
    let generated = generate();
    let path = header_path();
    if std::env::var_os("MULTIRAIL_BLESS_HEADER").is_some() {
        std::fs::write(&path, &generated).expect("writing include/multirail.h");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != generated {
        let first = checked_in
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| checked_in.lines().count().min(generated.lines().count()));
        panic!(
            "{} differs from what cbindgen generates from crates/capi/src (first at line {}: \
             checked in {:?}, generated {:?}).\nRegenerate it with \
             `MULTIRAIL_BLESS_HEADER=1 cargo test -p multirail-capi --test header` and commit it.",
            path.display(),
            first + 1,
            checked_in.lines().nth(first).unwrap_or("<end of file>"),
            generated.lines().nth(first).unwrap_or("<end of file>"),
        );
    }
}

/// Every function the agreed surface names is declared, and every declared function has a
/// doc comment that states its failures and its thread safety.
#[test]
fn header_declares_the_agreed_functions_with_their_docs() {
    let header = generate();
    let functions = [
        "multirail_last_error",
        "multirail_engine_new",
        "multirail_engine_free",
        "multirail_engine_name",
        "multirail_segment_name",
        "multirail_allocate",
        "multirail_register",
        "multirail_unregister",
        "multirail_open_segment",
        "multirail_close_segment",
        "multirail_segment_buffers",
        "multirail_batch_allocate",
        "multirail_batch_submit",
        "multirail_batch_status",
        "multirail_batch_request_error",
        "multirail_batch_overall_status",
        "multirail_batch_wait",
        "multirail_batch_free",
        "multirail_prepare",
        "multirail_prepared_submit",
        "multirail_prepared_len",
        "multirail_prepared_free",
        "multirail_notify",
        "multirail_notifications",
        "multirail_send",
        "multirail_recv",
        "multirail_traffic_stats_json",
    ];
    for f in functions {
        let at = [format!(" {f}("), format!("*{f}(")]
            .iter()
            .find_map(|decl| header.find(decl.as_str()))
            .unwrap_or_else(|| panic!("{f} is not declared"));
        let doc_end = header[..at].rfind("*/").expect("a doc comment");
        let doc_start = header[..doc_end].rfind("/**").expect("a doc comment");
        let doc = &header[doc_start..doc_end];
        assert!(
            header[doc_end..at].lines().count() <= 2,
            "{f}: the doc comment is not right above it"
        );
        assert!(
            doc.contains("Thread safety"),
            "{f}: no thread safety in its doc"
        );
        assert!(
            f == "multirail_last_error" || doc.contains("Returns MULTIRAIL_OK"),
            "{f}: its doc does not say what it returns"
        );
    }
    let declared = header.matches("\nint32_t multirail_").count()
        + header.matches("\nconst char *multirail_").count();
    assert_eq!(
        declared,
        functions.len(),
        "functions declared beyond the agreed surface"
    );
    for name in [
        "MULTIRAIL_OK = 0",
        "MULTIRAIL_ERR_TRANSFER_FAILED = -14",
        "#define MULTIRAIL_OP_WRITE 1",
        "#define MULTIRAIL_PRIO_LOW 2",
        "#define MULTIRAIL_TRANSPORT_RDMA 3",
        "#define MULTIRAIL_STATUS_FAILED 2",
        "typedef uint64_t multirail_engine_t;",
        "multirail_request_t",
        "multirail_prepared_entry_t",
        "multirail_buffer_info_t",
    ] {
        assert!(header.contains(name), "the header lacks {name}");
    }
}
