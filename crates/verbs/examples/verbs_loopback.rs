//! Exercises multirail-verbs end to end on every active port: two RC queue
//! pairs on one port connected to each other (loopback) with the port's
//! RoCE v2 GID, a 64 MiB RDMA_WRITE posted as one chain of 1 MiB requests
//! (one doorbell, only the last signalled), an RDMA_READ of it back, and
//! 1000 SEND-with-immediate messages received through a shared receive
//! queue. Every byte and the message order are checked; any failure exits 1.
//!
//! Run: `cargo run -p multirail-verbs --example verbs_loopback --release`
//! (needs an RDMA device; `scripts/rdma-vm` provides soft-RoCE ones).

#![warn(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

use multirail_verbs::*;
use std::error::Error;
use std::process::ExitCode;
use std::time::{Duration, Instant};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

const BUF_LEN: usize = 64 << 20;
const CHUNK: usize = 1 << 20;
const MSGS: usize = 1000;
const MSG_LEN: usize = 64;
const SEND_DEPTH: u32 = 128;
const MSG_CHUNK: usize = 100;
const CQ_DEPTH: u32 = 4096;
/// Generous: soft-RoCE under an emulated CPU moves a few MB/s.
const WAIT: Duration = Duration::from_secs(300);

fn main() -> ExitCode {
    match run() {
        Ok(ports) => {
            println!("verbs_loopback: OK: {ports} port(s) verified");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("verbs_loopback: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<usize> {
    let verbs = Verbs::get()?;
    println!("library: {}", verbs.library());
    let devices = verbs.devices()?;
    println!("devices: {}", devices.len());
    let mut verified = 0;
    for dev in &devices {
        print_device(dev);
        probe_limits(&verbs, dev)?;
        for port in dev.ports.iter().filter(|p| p.is_active()) {
            println!("== {} port {}", dev.name, port.port);
            loopback(&verbs, dev, port)
                .map_err(|e| format!("{} port {}: {e}", dev.name, port.port))?;
            verified += 1;
        }
    }
    if verified == 0 {
        return Err("no active RDMA port to test".into());
    }
    Ok(verified)
}

fn print_device(dev: &DeviceInfo) {
    let a = &dev.attr;
    println!(
        "device {} guid {} numa {:?} fw {:?} vendor {:#x}:{:#x}",
        dev.name,
        dev.guid_string(),
        dev.numa_node,
        a.fw_ver,
        a.vendor_id,
        a.vendor_part_id
    );
    println!(
        "  limits: max_qp {} max_qp_wr {} max_sge {} max_cqe {} max_mr_size {} max_qp_rd_atom {} max_qp_init_rd_atom {} max_srq {} max_srq_wr {} max_srq_sge {}",
        a.max_qp,
        a.max_qp_wr,
        a.max_sge,
        a.max_cqe,
        a.max_mr_size,
        a.max_qp_rd_atom,
        a.max_qp_init_rd_atom,
        a.max_srq,
        a.max_srq_wr,
        a.max_srq_sge
    );
    for p in &dev.ports {
        println!(
            "  port {}: {:?} {:?} mtu {}/{} speed code {} ({:?} Gbit/s/lane) width code {} ({:?} lanes) rate {:?} Gbit/s lid {} max_msg {} gid_tbl_len {}",
            p.port,
            p.state,
            p.link_layer,
            p.active_mtu,
            p.max_mtu,
            p.active_speed,
            p.lane_gbps(),
            p.active_width,
            p.lanes(),
            p.rate_gbps(),
            p.lid,
            p.max_msg_sz,
            p.gid_tbl_len
        );
        for g in &p.gids {
            println!(
                "    gid[{}] {} {:?} netdev {:?}",
                g.index, g.gid, g.gid_type, g.netdev
            );
        }
        println!(
            "    chosen: {:?}",
            p.roce_v2_gid().map(|g| (g.index, g.gid.to_string()))
        );
    }
}

/// Finds what the provider really grants: the largest inline payload a QP
/// accepts, and whether an SRQ as deep as `max_srq_wr` can be created.
fn probe_limits(verbs: &std::sync::Arc<Verbs>, dev: &DeviceInfo) -> Result<()> {
    let ctx = Context::open(verbs, &dev.name)?;
    let pd = ProtectionDomain::new(&ctx)?;
    let cq = CompletionQueue::new(&ctx, 256)?;
    let qp_with_inline = |inline: u32| {
        let caps = QpCaps {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: inline,
        };
        QueuePair::new_rc(&pd, &cq, &cq, None, caps).map(|qp| qp.caps().max_inline_data)
    };
    let (mut ok, mut bad) = (0u32, 1u32 << 20);
    while bad - ok > 1 {
        let mid = ok + (bad - ok) / 2;
        match qp_with_inline(mid) {
            Ok(_) => ok = mid,
            Err(_) => bad = mid,
        }
    }
    let granted = qp_with_inline(ok)?;
    let err = qp_with_inline(bad).map(|_| ()).unwrap_err();
    println!(
        "  probe: largest max_inline_data accepted {ok} (granted {granted}); {bad} fails: {err}"
    );
    let max = ctx.attr().max_srq_wr;
    match SharedReceiveQueue::new(&pd, max, 1) {
        Ok(srq) => println!(
            "  probe: SRQ of max_srq_wr {max} created, granted {}",
            srq.max_wr()
        ),
        Err(e) => println!("  probe: SRQ of max_srq_wr {max} refused: {e}"),
    }
    Ok(())
}

/// Anonymous page-aligned memory, unmapped on drop. Only read through
/// slices once the device is done with it.
struct Buffer {
    ptr: *mut u8,
    len: usize,
}

impl Buffer {
    fn new(len: usize) -> Result<Self> {
        // SAFETY: an anonymous private mapping has no preconditions.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!("mmap {len}: {}", std::io::Error::last_os_error()).into());
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// # Safety
    /// No posted request may be writing the buffer.
    unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: mapped for `len` bytes; no concurrent device write (caller).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// # Safety
    /// No posted request may be reading or writing the buffer.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: as above, and no other slice of it is alive (caller).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: mapped by `new`; every MemoryRegion over it is dropped
        // first (declared after the buffers in `loopback`).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn pattern(i: usize) -> u8 {
    ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

fn first_mismatch(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Polls `cq` until `want` completions satisfying `done` arrived, passing
/// every completion to `each`; fails on an error status or the deadline.
fn wait_for(
    cq: &CompletionQueue,
    wcs: &mut [WorkCompletion],
    mut each: impl FnMut(&WorkCompletion) -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + WAIT;
    loop {
        let n = cq.poll(wcs)?;
        for wc in &wcs[..n] {
            cq.check(wc)?;
            if each(wc)? {
                return Ok(());
            }
        }
        if n == 0 {
            if Instant::now() > deadline {
                return Err(format!("no completion within {WAIT:?}").into());
            }
            std::thread::yield_now();
        }
    }
}

/// Receive-side progress of the message test.
struct RecvState {
    received: usize,
    next_slot: usize,
}

fn mbps(bytes: usize, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64() / 1e6
}

fn loopback(verbs: &std::sync::Arc<Verbs>, dev: &DeviceInfo, port: &PortInfo) -> Result<()> {
    let gid = port
        .roce_v2_gid()
        .ok_or("port has no RoCE v2 GID (nor is it InfiniBand)")?;
    let ctx = Context::open(verbs, &dev.name)?;
    let pd = ProtectionDomain::new(&ctx)?;
    let cq = CompletionQueue::new(&ctx, CQ_DEPTH.min(ctx.attr().max_cqe))?;
    let srq_depth = 1024.min(ctx.attr().max_srq_wr);
    let srq = SharedReceiveQueue::new(&pd, srq_depth, 1)?;
    println!(
        "cq depth {} srq asked {srq_depth} x 1 granted {} x {}",
        cq.depth(),
        srq.max_wr(),
        srq.max_sge()
    );
    let caps = QpCaps {
        max_send_wr: SEND_DEPTH,
        max_recv_wr: 0,
        max_send_sge: 1,
        max_recv_sge: 0,
        max_inline_data: MSG_LEN as u32,
    };
    let qa = QueuePair::new_rc(&pd, &cq, &cq, Some(&srq), caps)?;
    let qb = QueuePair::new_rc(&pd, &cq, &cq, Some(&srq), caps)?;
    println!(
        "qp {} and {}: asked {caps:?}, granted {:?}",
        qa.qp_num(),
        qb.qp_num(),
        qa.caps()
    );

    // Connect each QP to the other, through the same port and GID.
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let (psn_a, psn_b) = (0x00_1234, 0xab_cdef);
    let sgid = u8::try_from(gid.index).map_err(|_| "GID index above 255")?;
    let remote = |qp: &QueuePair, psn| RemoteQp {
        qp_num: qp.qp_num(),
        psn,
        gid: gid.gid.0,
        lid: port.lid,
    };
    for qp in [&qa, &qb] {
        qp.to_init(port.port, access)?;
    }
    qa.to_rtr(&remote(&qb, psn_b), port.active_mtu, sgid, port.port)?;
    qb.to_rtr(&remote(&qa, psn_a), port.active_mtu, sgid, port.port)?;
    qa.to_rts(psn_a, 14, 7, 7, 16)?;
    qb.to_rts(psn_b, 14, 7, 7, 16)?;
    if qa.state()? != QpState::Rts || qb.state()? != QpState::Rts {
        return Err(format!("QPs not in RTS: {:?} {:?}", qa.state()?, qb.state()?).into());
    }
    println!(
        "connected via gid[{}] {} mtu {}",
        gid.index, gid.gid, port.active_mtu
    );

    // Buffers first, so that the regions over them drop before they unmap.
    let src = Buffer::new(BUF_LEN)?;
    let dst = Buffer::new(BUF_LEN)?;
    let back = Buffer::new(BUF_LEN)?;
    let msgs_out = Buffer::new(MSGS * MSG_LEN)?;
    let msgs_in = Buffer::new(MSGS * MSG_LEN)?;
    // SAFETY: nothing is posted yet.
    for (i, b) in unsafe { src.bytes_mut() }.iter_mut().enumerate() {
        *b = pattern(i);
    }
    let register = |buf: &Buffer, access: Access| {
        // SAFETY: each buffer outlives its region (declared earlier, so
        // dropped later); we take slices of a buffer only after the
        // completions of the requests writing it, and no rkey leaves this
        // process.
        unsafe { MemoryRegion::register(&pd, buf.ptr, buf.len, access) }
    };
    let src_mr = register(&src, Access::LOCAL_WRITE)?;
    let dst_mr = register(&dst, access)?;
    let back_mr = register(&back, Access::LOCAL_WRITE)?;
    let out_mr = register(&msgs_out, Access::LOCAL_WRITE)?;
    let in_mr = register(&msgs_in, Access::LOCAL_WRITE)?;

    let mut wcs = [WorkCompletion::default(); 64];
    let chunks = BUF_LEN / CHUNK;
    let mut batch = SendBatch::new(chunks);

    // RDMA_WRITE src -> dst: one chain, one doorbell, last one signalled.
    for i in 0..chunks {
        let op = SendOp::RdmaWrite {
            remote_addr: dst.addr() + (i * CHUNK) as u64,
            rkey: dst_mr.rkey(),
        };
        batch.push(
            i as u64,
            op,
            SendFlags::empty(),
            &[src_mr.sge(i * CHUNK, CHUNK)?],
        )?;
    }
    batch.signal_last();
    let t = Instant::now();
    // SAFETY: every sge is inside src_mr; nothing touches src or dst until
    // the completion below.
    unsafe { qa.post_send(&mut batch) }?;
    wait_for(&cq, &mut wcs, |wc| {
        Ok(wc.opcode() == WcOpcode::RDMA_WRITE && wc.wr_id() == (chunks - 1) as u64)
    })?;
    let took = t.elapsed();
    // SAFETY: the write's last (signalled) request has completed, so all have.
    if let Some(at) = first_mismatch(unsafe { src.bytes() }, unsafe { dst.bytes() }) {
        return Err(format!("RDMA_WRITE: byte {at} differs").into());
    }
    println!(
        "RDMA_WRITE: {} MiB in {chunks} requests of {} KiB, one post: {:.1} MB/s, verified",
        BUF_LEN >> 20,
        CHUNK >> 10,
        mbps(BUF_LEN, took)
    );

    // RDMA_READ dst -> back, the same way.
    batch.clear();
    for i in 0..chunks {
        let op = SendOp::RdmaRead {
            remote_addr: dst.addr() + (i * CHUNK) as u64,
            rkey: dst_mr.rkey(),
        };
        batch.push(
            i as u64,
            op,
            SendFlags::empty(),
            &[back_mr.sge(i * CHUNK, CHUNK)?],
        )?;
    }
    batch.signal_last();
    let t = Instant::now();
    // SAFETY: sges inside back_mr; `back` is not read until the completion.
    unsafe { qa.post_send(&mut batch) }?;
    wait_for(&cq, &mut wcs, |wc| {
        Ok(wc.opcode() == WcOpcode::RDMA_READ && wc.wr_id() == (chunks - 1) as u64)
    })?;
    let took = t.elapsed();
    // SAFETY: every read has completed.
    if let Some(at) = first_mismatch(unsafe { src.bytes() }, unsafe { back.bytes() }) {
        return Err(format!("RDMA_READ: byte {at} differs").into());
    }
    println!(
        "RDMA_READ: {} MiB in {chunks} requests, one post: {:.1} MB/s, verified",
        BUF_LEN >> 20,
        mbps(BUF_LEN, took)
    );

    // SEND with immediate data, A -> B, received through the SRQ.
    // SAFETY: nothing is posted on msgs_out yet.
    for (i, b) in unsafe { msgs_out.bytes_mut() }.iter_mut().enumerate() {
        *b = pattern(i ^ 0x5a5a);
    }
    // SAFETY: as above.
    let out = unsafe { msgs_out.bytes_mut() };
    for (m, msg) in out.chunks_exact_mut(MSG_LEN).enumerate() {
        msg[..4].copy_from_slice(&(m as u32).to_le_bytes());
    }
    let inline_ok = qa.caps().max_inline_data >= MSG_LEN as u32;
    let mut recvs = RecvBatch::new(srq_depth as usize);
    let mut next_slot = 0usize;
    let post_recvs = |upto: usize, next_slot: &mut usize, recvs: &mut RecvBatch| -> Result<()> {
        recvs.clear();
        while *next_slot < upto {
            recvs.push(
                *next_slot as u64,
                &[in_mr.sge(*next_slot * MSG_LEN, MSG_LEN)?],
            )?;
            *next_slot += 1;
        }
        // SAFETY: sges inside in_mr (LOCAL_WRITE); a slot is read only
        // after its receive completion.
        unsafe { srq.post_recv(recvs) }?;
        Ok(())
    };
    post_recvs(MSGS.min(srq_depth as usize), &mut next_slot, &mut recvs)?;

    let mut state = RecvState {
        received: 0,
        next_slot,
    };
    let on_recv = |wc: &WorkCompletion, st: &mut RecvState| -> Result<()> {
        if wc.opcode() != WcOpcode::RECV {
            return Err(format!("unexpected receive opcode {:?}", wc.opcode()).into());
        }
        let slot = usize::try_from(wc.wr_id())?;
        if slot >= MSGS || wc.byte_len() as usize != MSG_LEN {
            return Err(format!("bad receive: slot {slot}, {} bytes", wc.byte_len()).into());
        }
        if wc.imm_data() != Some(st.received as u32) || wc.qp_num() != qb.qp_num() {
            return Err(format!(
                "message {} out of order: imm {:?} on qp {}",
                st.received,
                wc.imm_data(),
                wc.qp_num()
            )
            .into());
        }
        let at = slot * MSG_LEN;
        // SAFETY: this slot's receive has completed and is not reposted.
        let got = &unsafe { msgs_in.bytes() }[at..at + MSG_LEN];
        let m = st.received * MSG_LEN;
        // SAFETY: sends only read msgs_out.
        let want = &unsafe { msgs_out.bytes() }[m..m + MSG_LEN];
        if got != want {
            return Err(format!("message {}: payload differs", st.received).into());
        }
        st.received += 1;
        if st.next_slot < MSGS {
            let mut one = RecvBatch::new(1);
            one.push(
                st.next_slot as u64,
                &[in_mr.sge(st.next_slot * MSG_LEN, MSG_LEN)?],
            )?;
            // SAFETY: as for the first receives.
            unsafe { srq.post_recv(&mut one) }?;
            st.next_slot += 1;
        }
        Ok(())
    };

    let t = Instant::now();
    let mut inline_sent = 0usize;
    let mut sends = SendBatch::new(MSG_CHUNK);
    for first in (0..MSGS).step_by(MSG_CHUNK) {
        sends.clear();
        let last = (first + MSG_CHUNK).min(MSGS) - 1;
        for m in first..=last {
            // Half the messages go inline (copied at post), half by DMA.
            let flags = if inline_ok && m % 2 == 0 {
                inline_sent += 1;
                SendFlags::INLINE
            } else {
                SendFlags::empty()
            };
            let op = SendOp::SendImm { imm: m as u32 };
            sends.push(m as u64, op, flags, &[out_mr.sge(m * MSG_LEN, MSG_LEN)?])?;
        }
        sends.signal_last();
        // SAFETY: sges inside out_mr, which is only read.
        unsafe { qa.post_send(&mut sends) }?;
        let mut sent = false;
        wait_for(&cq, &mut wcs, |wc| {
            if wc.opcode().is_recv() {
                on_recv(wc, &mut state)?;
            } else if wc.opcode() == WcOpcode::SEND && wc.wr_id() == last as u64 {
                sent = true;
            } else {
                return Err(format!("unexpected completion {wc:?}").into());
            }
            Ok(sent && state.received > last)
        })?;
    }
    let took = t.elapsed();
    println!(
        "SEND/RECV: {} messages of {MSG_LEN} B ({inline_sent} inline) through the SRQ, in order: {:.0} msg/s",
        state.received,
        state.received as f64 / took.as_secs_f64()
    );

    // Tear down through the error state, as a transport would.
    qa.to_error()?;
    if qa.state()? != QpState::Error {
        return Err("QP not in ERROR after to_error".into());
    }
    drop((src_mr, dst_mr, back_mr, out_mr, in_mr));
    Ok(())
}
