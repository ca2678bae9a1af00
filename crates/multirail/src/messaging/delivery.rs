//! What arrived and the order it is handed out in: messages wait for `recv`, notifications
//! and lane messages are taken out at once, and whatever comes on a sender's later lane waits
//! until its earlier lanes ended (their fences), so that a lane switch never reorders.

use super::*;

/// A message waiting for `recv`, with its sender.
pub(super) struct Ready {
    pub(super) from: Arc<str>,
    pub(super) body: Body,
}

/// Where a message's bytes wait for `recv`.
pub(super) enum Body {
    /// In receive buffer `buf` of pool `pool`, which goes back to the sender once consumed.
    Pooled {
        pool: u64,
        buf: BufferId,
        len: usize,
    },
    /// Copied out of the shared shm ring when it was taken in, so the ring's space went back
    /// to every sender at once.
    Owned(Vec<u8>),
}

impl Ready {
    fn uses_pool(&self, key: u64) -> bool {
        matches!(self.body, Body::Pooled { pool, .. } if pool == key)
    }
}

/// What arrived: messages and notifications to hand out, and what waits for an earlier lane.
#[derive(Default)]
pub(super) struct Delivered {
    pub(super) ready: VecDeque<Ready>,
    pub(super) notifications: VecDeque<Notification>,
    /// Arrived on a lane whose predecessor has not ended yet, in arrival order.
    pub(super) held: VecDeque<Held>,
    /// Lane messages for the granting negotiation, with their sender, in order.
    pub(super) lanes: VecDeque<(Arc<str>, LaneMsg)>,
}

/// A message or notification held back, with the connection it came on.
pub(super) struct Held {
    conn: ConnId,
    item: HeldItem,
}

enum HeldItem {
    Message(Ready),
    Notification(Notification),
    Lane(Arc<str>, LaneMsg),
}

/// What a waiting receiver waits for: a receive waits for a message and leaves notifications
/// where they are, a notification wait the other way round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Want {
    Message,
    Notification,
}

impl Delivered {
    /// Whether what `want` waits for is here to be handed out.
    pub(super) fn has(&self, want: Want) -> bool {
        match want {
            Want::Message => !self.ready.is_empty(),
            Want::Notification => !self.notifications.is_empty(),
        }
    }

    pub(super) fn count(&self) -> usize {
        self.ready.len() + self.notifications.len() + self.held.len() + self.lanes.len()
    }

    /// Hands out what connection `conn` had held back, in arrival order.
    pub(super) fn release(&mut self, conn: ConnId) {
        let mut kept = VecDeque::with_capacity(self.held.len());
        for h in self.held.drain(..) {
            if h.conn != conn {
                kept.push_back(h);
                continue;
            }
            match h.item {
                HeldItem::Message(r) => self.ready.push_back(r),
                HeldItem::Notification(n) => self.notifications.push_back(n),
                HeldItem::Lane(from, m) => self.lanes.push_back((from, m)),
            }
        }
        self.held = kept;
    }

    pub(super) fn uses_pool(&self, key: u64) -> bool {
        self.ready.iter().any(|r| r.uses_pool(key))
            || self
                .held
                .iter()
                .any(|h| matches!(&h.item, HeldItem::Message(r) if r.uses_pool(key)))
    }
}

/// The kind of a message that arrived with kind code `code` (a ring entry's or an RDMA
/// immediate: the values of [`MsgKind`]) and `len` bytes. Fails on a code a sender may not
/// send or a length above the receive buffers.
pub(super) fn arrived_kind(
    code: u32,
    len: usize,
    max_len: usize,
) -> std::result::Result<MsgKind, String> {
    if len > max_len {
        return Err(format!("message of {len} bytes above {max_len}"));
    }
    match code {
        1 => Ok(MsgKind::Message),
        2 => Ok(MsgKind::Notification),
        4 => Ok(MsgKind::Fence),
        5 => Ok(MsgKind::Lane),
        k => Err(format!("unknown message kind {k}")),
    }
}

/// A message of `len` bytes is in buffer `buf` of `pool`: a notification is taken out and the
/// buffer returned at once; a message waits for `recv`; both wait in `held` instead when the
/// lane is held back (`hold` names its connection). A fence's buffer is returned at once;
/// returns true for a fence.
#[allow(clippy::too_many_arguments)]
pub(super) fn take_in(
    from: &Arc<str>,
    key: u64,
    pool: &mut Pool,
    kind: MsgKind,
    buf: BufferId,
    len: usize,
    hold: Option<ConnId>,
    out: &mut Delivered,
) -> std::result::Result<bool, String> {
    let item = match kind {
        MsgKind::Fence => {
            pool.consumed(buf)?;
            return Ok(true);
        }
        MsgKind::Notification => {
            // SAFETY: the buffer holds the message's `len` bytes until it is consumed below.
            let bytes = unsafe { std::slice::from_raw_parts(pool.ptr(buf), len) };
            let n = Notification {
                from: from.to_string(),
                msg: String::from_utf8_lossy(bytes).into_owned(),
            };
            pool.consumed(buf)?;
            HeldItem::Notification(n)
        }
        MsgKind::Message => HeldItem::Message(Ready {
            from: from.clone(),
            body: Body::Pooled {
                pool: key,
                buf,
                len,
            },
        }),
        MsgKind::Lane => {
            // SAFETY: the buffer holds the message's `len` bytes until it is consumed below.
            let bytes = unsafe { std::slice::from_raw_parts(pool.ptr(buf), len) };
            let m = LaneMsg::decode(bytes);
            pool.consumed(buf)?;
            HeldItem::Lane(from.clone(), m.map_err(|e| format!("lane message: {e}"))?)
        }
        k @ (MsgKind::Credit
        | MsgKind::LaneAnswer
        | MsgKind::ReverseOpen
        | MsgKind::ReverseAccept
        | MsgKind::ReverseRefuse) => return Err(format!("a sender sent a {k:?} frame")),
    };
    hand_out(item, hold, out);
    Ok(false)
}

/// A message of `kind` whose bytes were copied out of the shared shm ring: as [`take_in`],
/// with a message keeping `bytes` itself. Returns true for a fence.
pub(super) fn take_in_bytes(
    from: &Arc<str>,
    kind: MsgKind,
    bytes: &[u8],
    hold: Option<ConnId>,
    out: &mut Delivered,
) -> std::result::Result<bool, String> {
    let item = match kind {
        MsgKind::Fence => return Ok(true),
        MsgKind::Notification => HeldItem::Notification(Notification {
            from: from.to_string(),
            msg: String::from_utf8_lossy(bytes).into_owned(),
        }),
        MsgKind::Message => HeldItem::Message(Ready {
            from: from.clone(),
            body: Body::Owned(bytes.to_vec()),
        }),
        MsgKind::Lane => HeldItem::Lane(
            from.clone(),
            LaneMsg::decode(bytes).map_err(|e| format!("lane message: {e}"))?,
        ),
        k @ (MsgKind::Credit
        | MsgKind::LaneAnswer
        | MsgKind::ReverseOpen
        | MsgKind::ReverseAccept
        | MsgKind::ReverseRefuse) => return Err(format!("a sender sent a {k:?} frame")),
    };
    hand_out(item, hold, out);
    Ok(false)
}

/// Queues what arrived for the application, or holds it back behind an earlier lane.
fn hand_out(item: HeldItem, hold: Option<ConnId>, out: &mut Delivered) {
    match (hold, item) {
        (Some(conn), item) => out.held.push_back(Held { conn, item }),
        (None, HeldItem::Message(r)) => out.ready.push_back(r),
        (None, HeldItem::Notification(n)) => out.notifications.push_back(n),
        (None, HeldItem::Lane(from, m)) => out.lanes.push_back((from, m)),
    }
}

impl Rx {
    /// After fences and ends: a sender's lane is delivered once every earlier lane of it has
    /// ended (fenced, or closed with everything it carried taken in); what it held back is
    /// handed out then, before anything that arrives later. A fenced lane that is delivered
    /// is done and closes.
    pub(super) fn settle_lanes(&mut self) {
        let mut order: Vec<usize> = (0..self.conns.len()).collect();
        order.sort_by(|&a, &b| {
            let (x, y) = (&self.conns[a], &self.conns[b]);
            x.from.cmp(&y.from).then(x.epoch.cmp(&y.epoch))
        });
        // The sender whose open lane blocks its later ones (the name, shared by reference).
        let mut blocked: Option<Arc<str>> = None;
        let mut released = Vec::new();
        for &i in &order {
            let c = &mut self.conns[i];
            if blocked.as_ref().is_some_and(|b| *b != c.from) {
                blocked = None;
            }
            let hold = blocked.is_some();
            if c.held_back && !hold {
                released.push(c.id);
            }
            c.held_back = hold;
            if !hold && c.fenced {
                c.dead = true;
            }
            if !(c.fenced || c.dead) && blocked.is_none() {
                blocked = Some(c.from.clone());
            }
        }
        for id in released {
            self.delivered.release(id);
        }
    }
}
