//! Garbage on the port: each bad connection is closed, and everyone else is
//! still served.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use common::Client;
use multirail_metadata_server::MetadataServer;

/// A small deterministic generator (xorshift64*), so a failure replays.
struct Bytes(u64);

impl Bytes {
    fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            *b = (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8;
        }
    }
}

fn connect(server: &MetadataServer) -> TcpStream {
    let stream = TcpStream::connect(server.local_addr()).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("read timeout");
    stream
        .set_write_timeout(Some(Duration::from_secs(20)))
        .expect("write timeout");
    stream
}

/// Reads until the server closes the connection; returns what it sent.
/// Fails if the server keeps it open (the read times out).
fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return received,
            Ok(n) => received.extend_from_slice(&buf[..n]),
            // A reset also means closed: the server closed with our
            // unread bytes still in its buffer.
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return received,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => panic!("server did not close the connection: {e}"),
        }
    }
}

fn still_serves(client: &Client, round: usize) {
    let key = format!("alive-{round}");
    assert_eq!(client.put(&key, b"yes").status, 200);
    assert_eq!(client.get(&key).body, b"yes");
}

#[test]
fn random_bytes_are_answered_with_400_and_closed() {
    let server = common::start_default();
    let client = Client::new(&server);
    let mut random = Bytes(0x9e37_79b9_7f4a_7c15);
    for round in 0..20 {
        let mut stream = connect(&server);
        let mut garbage = vec![0u8; 64 + round * 97];
        random.fill(&mut garbage);
        // Never a valid request line: start with a byte no method has.
        garbage[0] = 0x01;
        garbage.extend_from_slice(b"\r\n\r\n");
        let _ = stream.write_all(&garbage);
        let answer = read_until_closed(&mut stream);
        if !answer.is_empty() {
            let text = String::from_utf8_lossy(&answer);
            assert!(text.starts_with("HTTP/1.1 400"), "{text}");
        }
        still_serves(&client, round);
    }
}

#[test]
fn a_half_request_then_close_stores_nothing() {
    let server = common::start_default();
    let client = Client::new(&server);

    // Headers cut off mid-line.
    let mut stream = connect(&server);
    stream
        .write_all(b"PUT /metadata?key=half HTTP/1.1\r\nHost: t\r\nContent-Le")
        .expect("write");
    drop(stream);

    // Headers complete, body cut short.
    let mut stream = connect(&server);
    stream
        .write_all(
            b"PUT /metadata?key=half HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nonly this",
        )
        .expect("write");
    stream.shutdown(Shutdown::Write).expect("half close");
    let answer = read_until_closed(&mut stream);
    if !answer.is_empty() {
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    }

    // A chunked body whose chunk header is garbage.
    let mut stream = connect(&server);
    let _ = stream.write_all(
        b"PUT /metadata?key=half HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n",
    );
    read_until_closed(&mut stream);

    assert_eq!(client.get("half").status, 404);
    still_serves(&client, 0);
}

#[test]
fn an_endless_header_line_is_cut_off() {
    let server = common::start_default();
    let client = Client::new(&server);
    let mut stream = connect(&server);
    stream
        .write_all(b"GET /metadata?key=x HTTP/1.1\r\nX-Endless: ")
        .expect("write");
    let chunk = vec![b'a'; 64 * 1024];
    let mut sent = 0usize;
    // The server gives up long before 64 MiB; stop when it closes on us.
    while sent < 64 << 20 {
        match stream.write(&chunk) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    assert!(sent < 64 << 20, "server kept reading an endless header");
    read_until_closed(&mut stream);
    still_serves(&client, 0);
}

#[test]
fn an_endless_request_line_is_cut_off() {
    let server = common::start_default();
    let client = Client::new(&server);
    let mut stream = connect(&server);
    stream.write_all(b"GET /metadata?key=").expect("write");
    let chunk = vec![b'a'; 64 * 1024];
    let mut sent = 0usize;
    while sent < 64 << 20 {
        match stream.write(&chunk) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    assert!(
        sent < 64 << 20,
        "server kept reading an endless request line"
    );
    read_until_closed(&mut stream);
    still_serves(&client, 0);
}

#[test]
fn garbage_from_many_connections_at_once() {
    let server = common::start_default();
    let client = Client::new(&server);
    let threads: Vec<_> = (0..16u64)
        .map(|t| {
            let addr = server.local_addr();
            std::thread::spawn(move || {
                let mut random = Bytes(0x1234_5678 + t);
                for _ in 0..10 {
                    let mut stream = TcpStream::connect(addr).expect("connect");
                    stream
                        .set_read_timeout(Some(Duration::from_secs(20)))
                        .expect("timeout");
                    let mut garbage = vec![0u8; 512];
                    random.fill(&mut garbage);
                    garbage[0] = b'\n';
                    let _ = stream.write_all(&garbage);
                    let _ = stream.shutdown(Shutdown::Write);
                    read_until_closed(&mut stream);
                }
            })
        })
        .collect();
    for round in 0..20 {
        still_serves(&client, round);
    }
    for thread in threads {
        thread.join().expect("garbage thread");
    }
    still_serves(&client, 99);
}
