//! Tests that need a real RDMA device (soft-RoCE is enough). Each one skips,
//! saying why, on a machine without libibverbs or without an active port;
//! `scripts/rdma-vm` runs them where both exist.

#![warn(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

use multirail_verbs::*;
use std::time::Duration;

/// The first active port with a usable GID, opened.
struct Port {
    ctx: Context,
    info: PortInfo,
    sgid: u8,
}

fn active_port(test: &str) -> Option<Port> {
    let verbs = match Verbs::load() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("{test}: skipped: {e}");
            return None;
        }
    };
    let devices = verbs.devices().expect("devices()");
    for dev in devices {
        for info in dev.ports {
            if !info.is_active() {
                continue;
            }
            let Some(gid) = info.roce_v2_gid() else {
                continue;
            };
            let sgid = u8::try_from(gid.index).expect("small GID index");
            let ctx = Context::open(&verbs, &dev.name).expect("open device");
            return Some(Port { ctx, info, sgid });
        }
    }
    eprintln!("{test}: skipped: no active RDMA port");
    None
}

fn remote(port: &Port, qp: &QueuePair, psn: u32) -> RemoteQp {
    RemoteQp {
        qp_num: qp.qp_num(),
        psn,
        gid: port.info.roce_v2_gid().expect("gid").gid.0,
        lid: port.info.lid,
    }
}

const ACCESS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ);

/// Two RC QPs on one port connected to each other, without an SRQ.
fn connected_pair(port: &Port, pd: &ProtectionDomain, cq: &CompletionQueue) -> [QueuePair; 2] {
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let a = QueuePair::new_rc(pd, cq, cq, None, caps).expect("create QP");
    let b = QueuePair::new_rc(pd, cq, cq, None, caps).expect("create QP");
    let p = port.info.port;
    for qp in [&a, &b] {
        qp.to_init(p, ACCESS).expect("INIT");
    }
    let mtu = port.info.active_mtu;
    a.to_rtr(&remote(port, &b, 2), mtu, port.sgid, p)
        .expect("RTR");
    b.to_rtr(&remote(port, &a, 1), mtu, port.sgid, p)
        .expect("RTR");
    a.to_rts(1, 14, 7, 7, 1).expect("RTS");
    b.to_rts(2, 14, 7, 7, 1).expect("RTS");
    [a, b]
}

/// Heap memory the device may write; read back only after completions.
struct Mem(Box<[u8]>);

impl Mem {
    fn new(len: usize, fill: u8) -> Self {
        Self(vec![fill; len].into_boxed_slice())
    }

    fn register(&mut self, pd: &ProtectionDomain) -> MemoryRegion {
        // SAFETY: the box outlives the region in every test (declared
        // first, dropped last) and is only read after the completions of
        // the requests that write it.
        unsafe { MemoryRegion::register(pd, self.0.as_mut_ptr(), self.0.len(), ACCESS) }
            .expect("register")
    }
}

fn poll_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::default()];
    for _ in 0..100_000 {
        if cq.poll(&mut wc).expect("poll") == 1 {
            return wc[0];
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    panic!("no completion within 10 s");
}

#[test]
fn qp_walks_states_and_rejects_bad_arguments() {
    let Some(port) = active_port("qp_walks_states") else {
        return;
    };
    let pd = ProtectionDomain::new(&port.ctx).unwrap();
    let cq = CompletionQueue::new(&port.ctx, 64).unwrap();
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = QueuePair::new_rc(&pd, &cq, &cq, None, caps).unwrap();
    assert_eq!(qp.state().unwrap(), QpState::Reset);

    // Posting to a QP in RESET is refused at the first request.
    let mut batch = SendBatch::new(2);
    batch
        .push(1, SendOp::Send, SendFlags::SIGNALED, &[])
        .unwrap();
    // SAFETY: no scatter/gather entries: no memory is touched.
    let err = unsafe { qp.post_send(&mut batch) };
    if let Err(e) = err {
        assert_eq!(e.index_of_bad_wr, 0, "{e}");
    }

    qp.to_init(port.info.port, ACCESS).unwrap();
    assert_eq!(qp.state().unwrap(), QpState::Init);
    let bad_mtu = qp.to_rtr(&remote(&port, &qp, 0), 1500, port.sgid, port.info.port);
    assert!(matches!(bad_mtu, Err(VerbsError::InvalidArgument(_))));
    let bad_psn = RemoteQp {
        psn: MAX_PSN + 1,
        ..remote(&port, &qp, 0)
    };
    assert!(qp
        .to_rtr(&bad_psn, 1024, port.sgid, port.info.port)
        .is_err());
    // A GID index past the table is refused by the kernel; the error names
    // the verb and the step.
    let err = qp
        .to_rtr(&remote(&port, &qp, 0), 1024, 250, port.info.port)
        .unwrap_err();
    assert!(
        err.to_string().starts_with("ibv_modify_qp(RTR) failed: "),
        "{err}"
    );
    assert!(err.errno().is_some());
    qp.to_error().unwrap();
    assert_eq!(qp.state().unwrap(), QpState::Error);
    qp.to_reset().unwrap();
    assert_eq!(qp.state().unwrap(), QpState::Reset);

    assert!(matches!(
        CompletionQueue::new(&port.ctx, 0),
        Err(VerbsError::InvalidArgument(_))
    ));
    assert!(matches!(
        Context::open(port.ctx.verbs(), "no-such-device"),
        Err(VerbsError::NoSuchDevice { .. })
    ));
}

#[test]
fn srq_attached_qp_refuses_its_own_receives() {
    let Some(port) = active_port("srq_attached_qp") else {
        return;
    };
    let pd = ProtectionDomain::new(&port.ctx).unwrap();
    let cq = CompletionQueue::new(&port.ctx, 64).unwrap();
    let srq = SharedReceiveQueue::new(&pd, 16, 1).unwrap();
    assert!(srq.max_wr() >= 16);
    let caps = QpCaps {
        max_send_wr: 4,
        max_send_sge: 1,
        ..QpCaps::default()
    };
    let qp = QueuePair::new_rc(&pd, &cq, &cq, Some(&srq), caps).unwrap();
    let mut mem = Mem::new(64, 0);
    let mr = mem.register(&pd);
    let mut recvs = RecvBatch::new(1);
    recvs.push(7, &[mr.sge(0, 64).unwrap()]).unwrap();
    // SAFETY: the sge lies in `mr`; `mem` is not read afterwards.
    let err = unsafe { qp.post_recv(&mut recvs) }.unwrap_err();
    assert_eq!((err.index_of_bad_wr, err.errno), (0, libc::EINVAL));
    // SAFETY: as above.
    unsafe { srq.post_recv(&mut recvs) }.unwrap();
    assert!(mr.sge(1, 64).is_err());
    drop(qp);
    drop(mr);
}

#[test]
fn flushed_receive_reports_its_status() {
    let Some(port) = active_port("flushed_receive") else {
        return;
    };
    let pd = ProtectionDomain::new(&port.ctx).unwrap();
    let cq = CompletionQueue::new(&port.ctx, 64).unwrap();
    let mut mem = Mem::new(256, 0);
    let mr = mem.register(&pd);
    let [a, _b] = connected_pair(&port, &pd, &cq);
    let mut recvs = RecvBatch::new(2);
    recvs.push(41, &[mr.sge(0, 128).unwrap()]).unwrap();
    recvs.push(42, &[mr.sge(128, 128).unwrap()]).unwrap();
    // SAFETY: sges in `mr`; `mem` is not read before the flush completions.
    unsafe { a.post_recv(&mut recvs) }.unwrap();
    a.to_error().unwrap();
    let first = poll_one(&cq);
    let second = poll_one(&cq);
    assert_eq!((first.wr_id(), second.wr_id()), (41, 42));
    assert_eq!(first.status(), WcStatus::WR_FLUSH_ERR);
    let err = cq.check(&first).unwrap_err();
    assert_eq!(cq.status_str(&first), "Work Request Flushed Error");
    assert!(
        err.to_string().contains("Work Request Flushed Error"),
        "{err}"
    );
}

#[test]
fn completion_channel_wakes_on_a_signalled_write() {
    let Some(port) = active_port("completion_channel") else {
        return;
    };
    let pd = ProtectionDomain::new(&port.ctx).unwrap();
    let channel = CompletionChannel::new(&port.ctx).unwrap();
    let cq = CompletionQueue::with_channel(&port.ctx, 16, &channel, 0xc0ffee, 0).unwrap();
    let mut src = Mem::new(4096, 0xab);
    let mut dst = Mem::new(4096, 0);
    let src_mr = src.register(&pd);
    let dst_mr = dst.register(&pd);
    let [a, b] = connected_pair(&port, &pd, &cq);
    cq.req_notify(false).unwrap();
    let mut batch = SendBatch::new(1);
    let op = SendOp::RdmaWriteImm {
        remote_addr: dst_mr.addr() as u64,
        rkey: dst_mr.rkey(),
        imm: 5,
    };
    batch
        .push(9, op, SendFlags::SIGNALED, &[src_mr.sge(0, 4096).unwrap()])
        .unwrap();
    // A write with immediate consumes a receive at the target.
    let mut recvs = RecvBatch::new(1);
    recvs.push(77, &[]).unwrap();
    // SAFETY: a zero-length receive touches no memory.
    unsafe { b.post_recv(&mut recvs) }.unwrap();
    // SAFETY: sges in src_mr; dst is read only after the completions.
    unsafe { a.post_send(&mut batch) }.unwrap();

    let mut fds = libc::pollfd {
        fd: channel.fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut fds, 1, 10_000) };
    assert_eq!(ready, 1, "no completion event within 10 s");
    assert_eq!(channel.wait().unwrap(), 0xc0ffee);

    let mut seen = Vec::new();
    while seen.len() < 2 {
        let wc = poll_one(&cq);
        cq.check(&wc).unwrap();
        seen.push((wc.wr_id(), wc.opcode(), wc.imm_data()));
    }
    seen.sort_by_key(|s| s.0);
    assert_eq!(
        seen,
        [
            (9, WcOpcode::RDMA_WRITE, None),
            (77, WcOpcode::RECV_RDMA_WITH_IMM, Some(5))
        ]
    );
    assert!(dst.0.iter().all(|&b| b == 0xab));
}
