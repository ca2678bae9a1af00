//! `wire::decode_hello` on arbitrary bytes (the first `HELLO_LEN` of the input, zero-padded).
//!
//! Properties: it never panics; it accepts exactly the hellos the format describes (magic
//! `MRAL`, this engine's protocol version, no flags, a known kind) and names what is wrong with
//! any other; an accepted hello re-encodes to the same 40 bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use multirail::segment::PROTOCOL_VERSION;
use multirail::transport::wire::{self, ConnKind, HELLO_LEN, MAGIC};

fuzz_target!(|data: &[u8]| {
    let mut hello = [0u8; HELLO_LEN];
    let n = data.len().min(HELLO_LEN);
    hello[..n].copy_from_slice(&data[..n]);

    let expected = if hello[..4] != MAGIC {
        Err("magic")
    } else if u16::from_le_bytes([hello[4], hello[5]]) != PROTOCOL_VERSION {
        Err("version")
    } else if hello[7] != 0 {
        Err("flags")
    } else {
        match hello[6] {
            1 => Ok(ConnKind::Control),
            2 => Ok(ConnKind::Data),
            3 => Ok(ConnKind::Message),
            4 => Ok(ConnKind::Rdma),
            _ => Err("kind"),
        }
    };

    match (wire::decode_hello(&hello), expected) {
        (Ok(kind), Ok(want)) => {
            assert_eq!(kind, want);
            let nonce = wire::hello_nonce(&hello);
            assert_eq!(&nonce[..], &hello[8..]);
            assert_eq!(wire::encode_hello_with_nonce(kind, &nonce), hello);
        }
        (Err(e), Err(what)) => assert!(e.contains(what), "error {e:?} does not name the {what}"),
        (got, want) => panic!("decode_hello({hello:02x?}) = {got:?}, expected {want:?}"),
    }
});
